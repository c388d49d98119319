"""Where a server binds and what it tells others to dial: not always the same host.

A server bound on a wildcard (``0.0.0.0``) or on a private address behind a NAT must advertise
something else: ``--advertise-host`` when given (the router's public address, whose ports are
forwarded to this machine), else the bind host, else this machine's address. The data-parallel
peer server (node/daemon/peer_dataplane.py) and a stage peer's two servers (node/pipeline/
stage_peer.py) follow the same rule.
"""

from __future__ import annotations

import socket

WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def advertised(host: str, advertise_host: str) -> str:
    """The host peers dial: --advertise-host, else the listen host, else this machine's address."""
    if advertise_host:
        return advertise_host
    if host not in WILDCARDS:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def advertised_address(bound: str, host: str, advertise_host: str) -> str:
    """``bound`` ("host:port", what a server bound) as others should dial it: the advertised host,
    the bound port."""
    return f"{advertised(host, advertise_host)}:{bound.rpartition(':')[2]}"

