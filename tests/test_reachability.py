"""The coordinator's dial-back (protocol/reachability.py): a listening port is reachable, a closed
one and a malformed address are not, each with a one-line reason. The exchange's death check: only
a refused connect says a process is gone."""

from __future__ import annotations

import asyncio
import socket

import pytest

from murmur.protocol.reachability import (
    CLIENT_ADDRESS,
    dial_back,
    dialable,
    is_client,
    refuses_connections,
    split_address,
)


def test_a_listening_port_is_reachable_and_a_closed_one_is_not():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert asyncio.run(dial_back(f"127.0.0.1:{port}")) == (True, "")
    ok, why = asyncio.run(dial_back(f"127.0.0.1:{port}"))  # closed now
    assert not ok and "refused" in why and "\n" not in why


def test_only_a_refused_connect_says_the_process_is_gone():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()  # a hung process: the kernel still accepts for it
        port = srv.getsockname()[1]
        assert refuses_connections(f"127.0.0.1:{port}") is False
    assert refuses_connections(f"127.0.0.1:{port}") is True  # its socket closed: dead
    assert refuses_connections(CLIENT_ADDRESS) is False  # nothing to dial: not known dead


@pytest.mark.parametrize("bad", ["", "nohost", "host:", ":80", "h:99999", "h:x", CLIENT_ADDRESS, "a" * 400])
def test_what_is_not_host_port_is_not_dialed(bad):
    ok, why = asyncio.run(dial_back(bad))
    assert not ok and "is not host:port" in why
    with pytest.raises(ValueError):
        split_address(bad)


def test_client_mode_peers_are_left_out_of_what_is_dialed():
    assert split_address("[::1]:7") == ("::1", 7)
    peers = {"a": "10.0.0.1:5", "b": CLIENT_ADDRESS}
    assert dialable(peers) == {"a": "10.0.0.1:5"}
    assert is_client(CLIENT_ADDRESS) and not is_client("10.0.0.1:5") and not is_client("")
