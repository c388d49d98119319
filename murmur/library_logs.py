"""Only murmur's own lines in a node's and a coordinator's log at the default level.

The libraries under the node write to the same stderr, and a volunteer reads their lines as errors:
gRPC's C core logs ``fork_posix.cc ... skipping fork() handlers`` whenever hivemind forks its DHT
child and ``chttp2_transport.cc ... Got goaway`` whenever a peer closes a connection; hivemind logs
its INFO lines (a new DHT identity) and relays p2pd's (libp2p's) errors about single peers, which
the node already handles. Each is silenced where it comes from, by the setting its library reads:

    GRPC_VERBOSITY=ERROR     gRPC's C core, read once when grpc is imported
    HIVEMIND_LOGLEVEL=ERROR  hivemind's Python loggers, read when hivemind is imported
    GOLOG_LOG_LEVEL=fatal    the p2pd child's libp2p loggers (hivemind passes the environment on)

An operator's own value of any of them wins, and ``MURMUR_LOG_LEVEL=debug`` sets none of them: the
libraries then speak as they do by default. Because gRPC and hivemind read theirs on import, this
runs before either is imported: first thing in `murmur` (murmur/cli.py), and before the testnet's
fork server imports them for its warm children (node/testnet/warm.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

QUIET = {"GRPC_VERBOSITY": "ERROR", "HIVEMIND_LOGLEVEL": "ERROR", "GOLOG_LOG_LEVEL": "fatal"}
DEBUG_ENV = "MURMUR_LOG_LEVEL"  # debug: the libraries' own lines too (node/daemon/cli.py)


def quiet_library_logs(environ: MutableMapping[str, str] | None = None) -> None:
    """Set the libraries' log settings in ``environ`` (this process's by default, which its children
    inherit) unless the operator set them or asked for debug lines."""
    env = os.environ if environ is None else environ
    if env.get(DEBUG_ENV, "").strip().lower() == "debug":
        return
    for name, value in QUIET.items():
        env.setdefault(name, value)
    if environ is None:
        # A warm child (node/testnet/warm.py) was forked with hivemind imported: its level is set
        # already, so set the loggers' level here too (a cold process's import reads the variable).
        logging.getLogger("hivemind").setLevel(env["HIVEMIND_LOGLEVEL"])
