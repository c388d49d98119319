"""A bootstrap-only DHT as its own process, for tests whose peers are processes too.

    python tests/_dht_boot.py CA_CERT_FILE RUN

Prints ``ready <multiaddr>`` and serves until its stdin closes (or a signal). Started from a fresh
interpreter, not forked from the test process: a pytest worker that has run hundreds of tests holds
many threads (gRPC's among them), and a DHT process forked from it late in a run died at start-up
twice in a row in one suite run (the cause was not found).
"""

from __future__ import annotations

import sys
from pathlib import Path

from murmur.protocol.dht import MurmurDHT


def main() -> int:
    dht = MurmurDHT(sys.argv[2], ca_cert_pem=Path(sys.argv[1]).read_bytes()).start()
    try:
        print("ready", dht.addresses[0], flush=True)
        sys.stdin.read()  # until the test closes our stdin
    finally:
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
