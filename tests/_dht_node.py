"""A DHT-only node as its own process, driven over stdin by tests/test_dht.py.

    python tests/_dht_node.py IDENTITY_DIR RUN TTL [BOOTSTRAP]

Prints ``ready <multiaddr>``, then keeps its peer record alive (re-announcing every TTL/3) and
answers one command per stdin line: ``rendezvous ROUND EXPECTED DEADLINE`` -> a JSON line of the
members; ``exit`` -> leaves cleanly. A SIGKILL stops the re-announcing, so its record expires.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from murmur.protocol.dht import DHTSettings, MurmurDHT, PeerRecord
from murmur.protocol.identity import Identity


def main() -> int:
    ident = Identity.load(sys.argv[1])
    run, ttl = sys.argv[2], float(sys.argv[3])
    boot = sys.argv[4:5]
    dht = MurmurDHT(
        run,
        ca_cert_pem=ident.ca_cert_pem,
        identity=ident,
        initial_peers=boot,
        settings=DHTSettings(record_ttl=ttl),
    ).start()
    stop = threading.Event()
    record = PeerRecord(node_id=ident.node_id, address=f"127.0.0.1:{1000 + len(ident.node_id)}")

    def keep_alive() -> None:
        while not stop.is_set():
            dht.announce(record)
            stop.wait(ttl / 3)

    threading.Thread(target=keep_alive, daemon=True).start()
    print("ready", dht.addresses[0], flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if cmd and cmd[0] == "rendezvous":
                members = dht.rendezvous(
                    int(cmd[1]),
                    "k",
                    record.address,
                    expected=int(cmd[2]),
                    deadline=time.monotonic() + float(cmd[3]),
                )
                print(json.dumps(sorted(members)), flush=True)
            elif cmd and cmd[0] == "exit":
                break
    finally:
        stop.set()
        dht.withdraw()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
