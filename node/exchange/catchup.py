"""Completed results: publishing them, and catching up from the peers that completed a call.

A peer that completed a call publishes the result (``GetState`` name ``result/<round>/<key>``)
and its hash (``Hello`` lists the calls it completed; later attempts are answered ALREADY_DONE).
A peer whose round did not complete (it lost a reply, its input was refused, it came late) asks
who completed, fetches the result from the peers that agree on the most common hash, verifies
the hash, and returns that, instead of drifting away. Polls every ``catch_up_poll`` until the
round deadline.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import torch

from murmur.node.exchange.attempt import DoneRecord
from murmur.node.exchange.send import Call
from murmur.node.net.server import PublishedState
from murmur.node.net.state_transfer import StateError, StateFetchSettings, afetch, result_name
from murmur.optim.exchange import ExchangeError
from murmur.protocol import peer_pb2, peer_pb2_grpc
from murmur.protocol.version import PROTOCOL_VERSION, VERSION_METADATA_KEY
from murmur.protocol.wire import tensors_hash

if TYPE_CHECKING:
    from murmur.node.exchange.grpc_exchange import GrpcExchange


async def publish(ex: GrpcExchange, call: Call, named: dict[str, torch.Tensor], members: list[str]) -> None:
    digest = await asyncio.to_thread(tensors_hash, list(named.items()))  # an update-sized hash: off the loop
    ex.book.mark_done(call.round_id, call.key, DoneRecord(digest, members))
    ex.server.publish_state(
        PublishedState(result_name(call.round_id, call.key), list(named.items()), digest, members)
    )
    ex.server.unpublish_state(result_name(call.round_id - ex.settings.keep_results, call.key))


async def catch_up(
    ex: GrpcExchange, call: Call, hints: dict[str, bytes], why: str
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Fetch the result of this call from peers that completed it, or raise ExchangeError."""
    loop = asyncio.get_running_loop()
    fetch_settings = StateFetchSettings(
        call_timeout=max(ex.settings.peer_timeout, 1.0),
        max_message_bytes=ex.settings.max_message_bytes,
    )
    while True:
        if not hints:
            hints = await ask_done(ex, call)
        if hints:
            counts: dict[bytes, int] = {}
            for h in hints.values():
                counts[h] = counts.get(h, 0) + 1
            digest = max(counts, key=lambda h: (counts[h], h))
            sources = {o: call.peers[o] for o, h in hints.items() if h == digest}
            try:
                named, members = await afetch(
                    ex.server.identity,
                    sources,
                    result_name(call.round_id, call.key),
                    digest,
                    settings=fetch_settings,
                    ban_list=ex.server.ban_list,
                )
            except StateError as err:
                why = f"catching up failed: {err}"
            else:
                await publish(ex, call, named, members)
                return named, members
            hints = {}
        if loop.time() + ex.settings.catch_up_poll >= call.deadline:
            raise ExchangeError(f"round {call.round_id} {call.key!r} did not complete: {why}")
        await asyncio.sleep(ex.settings.catch_up_poll)


async def ask_done(ex: GrpcExchange, call: Call) -> dict[str, bytes]:
    """peer -> result hash, for the peers that say they completed this call."""

    async def hello(node_id: str, address: str) -> tuple[str, bytes]:
        stub = peer_pb2_grpc.PeerStub(ex.channel(node_id, address))
        reply = await stub.Hello(
            peer_pb2.HelloRequest(protocol_version=PROTOCOL_VERSION, run_id=ex.server.run_id),
            metadata=((VERSION_METADATA_KEY, str(PROTOCOL_VERSION)),),
            timeout=ex.settings.peer_timeout,
        )
        for d in reply.done:
            if d.round == call.round_id and d.key == call.key:
                return node_id, d.result_hash
        return node_id, b""

    others = [
        (n, a) for n, a in call.peers.items() if n != ex.peer_id and not ex.server.ban_list.is_banned(n)
    ]
    results = await asyncio.gather(*[hello(n, a) for n, a in others], return_exceptions=True)
    return {r[0]: r[1] for r in results if isinstance(r, tuple) and r[1]}
