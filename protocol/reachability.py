"""Whether a node can be dialed, and how a node that cannot (client mode) shows up to its peers.

Most volunteers sit behind a home router or a cloud NAT: they can dial out, but nobody can dial
them. Such a node takes part in rounds in client mode (docs/protocol.md, "Client mode"): it owns no
span of the all-reduce, streams its input to the owners and reads the reduced spans back on its own
calls, and is never asked for state. Where peers would dial it (its rendezvous entry, its DHT
record, the address its heartbeats report) it writes ``CLIENT_ADDRESS`` instead of host:port, so
every peer derives the same owner list from the same member list, and none ever waits out a
connect timeout on it.

``dial_back`` is the coordinator's half of the auto-detection: a plain TCP connect to the address a
node says it listens on. A NAT drops the SYN (a timeout) or a firewall refuses it; either way the
node is told it is not reachable and picks client mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

CLIENT_ADDRESS = "client-mode"  # not host:port: nothing ever dials it
DIAL_BACK_TIMEOUT_S = 3.0
DEATH_PROBE_TIMEOUT_S = 1.0  # a refusal comes back at once; longer is an unknown, not a death
MAX_ADDRESS_CHARS = 300


def is_client(address: str) -> bool:
    """Whether ``address`` is a client-mode node's: one that owns no span and serves no state."""
    return address == CLIENT_ADDRESS


def dialable(peers: dict[str, str]) -> dict[str, str]:
    """The entries of a {node id: address} map that a peer may dial (client-mode nodes left out)."""
    return {n: a for n, a in peers.items() if not is_client(a)}


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of ``host:port`` or ``[v6]:port``; ValueError with a one-line reason if not one."""
    if not address or len(address) > MAX_ADDRESS_CHARS:
        raise ValueError(f"{address[:40]!r} is not host:port")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address[:MAX_ADDRESS_CHARS]!r} is not host:port")
    return host.strip("[]"), int(port)


def refuses_connections(address: str, timeout_s: float = DEATH_PROBE_TIMEOUT_S) -> bool:
    """Whether nothing listens at ``address`` any more: a TCP connect to it is refused. The kernel
    closes a dead process's listening socket (SIGKILL included), so a dead peer answers this at
    once; a hung process still accepts, and a host that drops the SYN times out: neither is a
    known death. Blocking (``asyncio.to_thread`` it on a loop)."""
    try:
        host, port = split_address(address)
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except (ValueError, OSError):  # TimeoutError is an OSError
        return False
    return False


async def arefuses_connections(address: str) -> bool:
    """`refuses_connections` from a loop: the blocking dial runs in a worker thread."""
    return await asyncio.to_thread(refuses_connections, address)


async def dial_back(address: str, timeout_s: float = DIAL_BACK_TIMEOUT_S) -> tuple[bool, str]:
    """(reachable, why not) for a TCP connect to ``address`` within ``timeout_s``."""
    try:
        host, port = split_address(address)
    except ValueError as err:
        return False, str(err)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except TimeoutError:
        return False, f"no answer from {address} within {timeout_s:g}s (behind a NAT or a firewall that drops it)"
    except OSError as err:
        return False, f"{address} refused the connection ({err.strerror or err})"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True, ""
