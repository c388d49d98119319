"""Completed results: publishing them, and catching up from the peers that completed a call.

A peer that completed a call first claims it for its group with the run's arbiter, if it has one
(``gate``: node/exchange/group.py's RoundGate; a refusal ends the call with ExchangeError, and the
result is neither served nor applied), then publishes the result (``GetState`` name ``result/<round>/<key>``)
and its hash (``Hello`` lists the calls it completed; later attempts are answered ALREADY_DONE).
A peer whose round did not complete (it lost a reply, its input was refused, it came late) asks
who completed, fetches the result from the peers that agree on the most common hash, verifies
the hash, and returns that, instead of drifting away. Polls every ``catch_up_poll`` until the
round deadline.
"""

from __future__ import annotations

import asyncio
import hashlib

import torch

from murmur.node.exchange.attempt import DoneRecord, RoundBook
from murmur.node.exchange.calls import Call
from murmur.node.exchange.channels import Channels
from murmur.node.exchange.group import RoundGate
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

    def __init__(
        self,
        server: PeerServer,
        book: RoundBook,
        channels: Channels,
        settings: ExchangeSettings,
        gate: RoundGate | None = None,
    ) -> None:
        self.server, self.book, self.channels, self.settings, self.gate = server, book, channels, settings, gate
        self.fetch_settings = StateFetchSettings(
            call_timeout=max(settings.peer_timeout, 1.0), max_message_bytes=settings.max_message_bytes
        )

    async def publish(self, call: Call, named: dict[str, torch.Tensor], members: list[str]) -> None:
        """Claim the call's result for ``members`` (ExchangeError if the run refuses it), then
        serve it and answer ALREADY_DONE for the call from now on."""
        if self.gate is not None:
            await self.gate.claim(call.round_id, call.key, members)
        digest = await asyncio.to_thread(tensors_hash, list(named.items()))  # an update-sized hash: off the loop
        self.book.mark_done(call.round_id, call.key, DoneRecord(digest, members))
        self.server.publish_state(
            PublishedState(result_name(call.round_id, call.key), list(named.items()), digest, members)
        )
        self.server.unpublish_state(result_name(call.round_id - self.settings.keep_results, call.key))

    async def publish_owned(self, call: Call, members: list[str]) -> None:
        """A completed reduce-scatter: claimed like any result, answered ALREADY_DONE from now on
        (late attempts end at once), but nothing to serve: each member holds only its own span.
        The hash stands for the call's completed attempt, not for a result anyone could fetch."""
        if self.gate is not None:
            await self.gate.claim(call.round_id, call.key, members)
        digest = hashlib.sha256(f"owned\x00{call.round_id}\x00{call.key}\x00{members}".encode()).digest()
        self.book.mark_done(call.round_id, call.key, DoneRecord(digest, members))

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
                if await self._result_dropped(call):
                    # Its completers serve only their last keep_results results: polling until the
                    # deadline would hold this peer out of the run (and the others' rendezvous
                    # would wait for it each round). Fail now; the caller re-syncs to the newest state.
                    raise ExchangeError(
                        f"round {call.round_id} {call.key!r} did not complete: the peers that completed it "
                        "moved on and no longer serve its result"
                    )
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
        return {node_id: digest for node_id, digest, _ in await self._ask(call) if digest}

    async def done_members(self, call: Call, hints: dict[str, bytes]) -> list[str] | None:
        """The members of the attempt that completed this call, as the first of the peers that
        say they completed it (``hints``) answers; None if none does."""
        for node_id in hints:
            address = call.peers.get(node_id)
            if not address:
                continue
            try:
                reply = await self._hello_reply(node_id, address)
            except Exception:  # noqa: BLE001 - gone or busy: ask the next one
                continue
            done = next((d for d in reply.done if d.key == call.key and d.round == call.round_id), None)
            if done is not None:
                return list(done.members)
        return None

    async def _result_dropped(self, call: Call) -> bool:
        """Whether a peer has completed keep_results later calls of this key: it published their
        results and unpublished this one (``publish`` above), so no one serves it any more."""
        newest = max((n for _, _, n in await self._ask(call)), default=-1)
        return newest >= call.round_id + self.settings.keep_results

    async def _ask(self, call: Call) -> list[tuple[str, bytes, int]]:
        """(peer, its result hash for this call or b"", the newest round of this key it completed)
        for every peer of the call that answers."""
        me, bans = self.server.node_id, self.server.ban_list
        others = [(n, a) for n, a in dialable(call.peers).items() if n != me and not bans.is_banned(n)]
        results = await asyncio.gather(*[self._hello(call, n, a) for n, a in others], return_exceptions=True)
        return [r for r in results if isinstance(r, tuple)]

    async def _hello_reply(self, node_id: str, address: str) -> peer_pb2.HelloReply:
        stub = peer_pb2_grpc.PeerStub(self.channels.get(node_id, address))
        return await stub.Hello(
            peer_pb2.HelloRequest(protocol_version=PROTOCOL_VERSION, run_id=self.server.run_id),
            metadata=((VERSION_METADATA_KEY, str(PROTOCOL_VERSION)),),
            timeout=self.settings.peer_timeout,
        )

    async def _hello(self, call: Call, node_id: str, address: str) -> tuple[str, bytes, int]:
        reply = await self._hello_reply(node_id, address)
        mine = [d for d in reply.done if d.key == call.key]
        digest = next((d.result_hash for d in mine if d.round == call.round_id), b"")
        return node_id, digest, max((d.round for d in mine), default=-1)
