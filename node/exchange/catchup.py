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

import torch

from murmur.node.exchange.attempt import DoneRecord, RoundBook
from murmur.node.exchange.calls import Call
from murmur.node.exchange.channels import Channels
from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.net.server import PeerServer, PublishedState
from murmur.node.net.state_transfer import StateError, StateFetchSettings, afetch, result_name
from murmur.optim.exchange import ExchangeError
from murmur.protocol import peer_pb2, peer_pb2_grpc
from murmur.protocol.reachability import dialable
from murmur.protocol.version import PROTOCOL_VERSION, VERSION_METADATA_KEY
from murmur.protocol.wire import tensors_hash


class CatchUp:
    """Publishes this peer's completed results, and fetches the results it missed from its peers."""

    def __init__(self, server: PeerServer, book: RoundBook, channels: Channels, settings: ExchangeSettings) -> None:
        self.server, self.book, self.channels, self.settings = server, book, channels, settings
        self.fetch_settings = StateFetchSettings(
            call_timeout=max(settings.peer_timeout, 1.0), max_message_bytes=settings.max_message_bytes
        )

    async def publish(self, call: Call, named: dict[str, torch.Tensor], members: list[str]) -> None:
        digest = await asyncio.to_thread(tensors_hash, list(named.items()))  # an update-sized hash: off the loop
        self.book.mark_done(call.round_id, call.key, DoneRecord(digest, members))
        self.server.publish_state(
            PublishedState(result_name(call.round_id, call.key), list(named.items()), digest, members)
        )
        self.server.unpublish_state(result_name(call.round_id - self.settings.keep_results, call.key))

    async def fetch(
        self, call: Call, hints: dict[str, bytes], why: str
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The result of this call from peers that completed it (``hints``: peer -> their result's
        hash, asked again while empty), or ExchangeError once the call's deadline is near."""
        loop = asyncio.get_running_loop()
        while True:
            if not hints:
                hints = await self.ask_done(call)
            if hints:
                try:
                    return await self._fetch_most_common(call, hints)
                except StateError as err:
                    why = f"catching up failed: {err}"
                hints = {}
            if loop.time() + self.settings.catch_up_poll >= call.deadline:
                raise ExchangeError(f"round {call.round_id} {call.key!r} did not complete: {why}")
            await asyncio.sleep(self.settings.catch_up_poll)

    async def _fetch_most_common(
        self, call: Call, hints: dict[str, bytes]
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        counts: dict[bytes, int] = {}
        for h in hints.values():
            counts[h] = counts.get(h, 0) + 1
        digest = max(counts, key=lambda h: (counts[h], h))
        sources = {o: call.peers[o] for o, h in hints.items() if h == digest}
        named, members = await afetch(
            self.server.identity,
            sources,
            result_name(call.round_id, call.key),
            digest,
            settings=self.fetch_settings,
            ban_list=self.server.ban_list,
        )
        await self.publish(call, named, members)
        return named, members

    async def ask_done(self, call: Call) -> dict[str, bytes]:
        """peer -> result hash, for the peers that say they completed this call."""
        me, bans = self.server.node_id, self.server.ban_list
        others = [(n, a) for n, a in dialable(call.peers).items() if n != me and not bans.is_banned(n)]
        results = await asyncio.gather(*[self._hello(call, n, a) for n, a in others], return_exceptions=True)
        return {r[0]: r[1] for r in results if isinstance(r, tuple) and r[1]}

    async def _hello(self, call: Call, node_id: str, address: str) -> tuple[str, bytes]:
        stub = peer_pb2_grpc.PeerStub(self.channels.get(node_id, address))
        reply = await stub.Hello(
            peer_pb2.HelloRequest(protocol_version=PROTOCOL_VERSION, run_id=self.server.run_id),
            metadata=((VERSION_METADATA_KEY, str(PROTOCOL_VERSION)),),
            timeout=self.settings.peer_timeout,
        )
        for d in reply.done:
            if d.round == call.round_id and d.key == call.key:
                return node_id, d.result_hash
        return node_id, b""
