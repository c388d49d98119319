"""`GrpcExchange`: optim's `Exchange` between nodes, over gRPC streams with mutual TLS.

All-reduce (dense codecs): the update is flattened; the sorted member list cuts it into one span
per member, and each span into pipeline chunks (node/exchange/settings.py). Each peer streams
span i, chunk by chunk, to member i (node/exchange/send.py); member i checks and decodes every
chunk as it arrives, and as soon as it holds every member's chunk j it aggregates it (the run's
rule: mean, trimmed mean, CenteredClip), re-encodes it once and streams it back to everyone while
later chunks are still arriving (node/exchange/attempt.py, node/exchange/collect.py). Codec work
runs in worker threads, off the event loop. Each peer sends about (N-1)/N of its payload and
(N-1)/N of the result: the butterfly's 2(N-1)/N.
Sparse codecs (top-k) and all-gather: every peer streams its payload to every other member;
a sparse all-reduce then aggregates every payload locally, in sorted order.

Rounds, attempts and failures. A call is one round (round_id, key). It runs in attempts: an
attempt has a fixed member list and succeeds only if every member's whole input reached every
owner and every owner answered OK after its last chunk. Anything else (a peer died, stalled, was
refused, disagreed on the member list) aborts the attempt everywhere; the callers learn who
failed and why from the owners' answers and retry without them, so a dead peer's span is
re-owned by the survivors and a result is never a partial average (chunks of an aborted attempt
are overwritten by the attempt that completes). A peer that completed a round answers later
attempts with ALREADY_DONE and publishes the result; a peer whose round did not complete catches
up from the peers that did (node/exchange/catchup.py). A round needs more than ``quorum`` of the
peers it started with, so a cut-off minority can never finish on its own. Every wait is bounded
by ``peer_timeout`` (per peer) and ``round_deadline`` (per call).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
from collections.abc import Sequence
from concurrent.futures import Future

import grpc
import torch
from google.protobuf.message import DecodeError

from murmur.node.exchange.attempt import Attempt, GatherAttempt, ReduceAttempt, RoundBook, chunk_reducer
from murmur.node.exchange.catchup import ask_done, catch_up, publish
from murmur.node.exchange.collect import ABORT, DONE, OK, REFUSED, ServeSettings, serve_exchange
from murmur.node.exchange.group import GroupProvider
from murmur.node.exchange.send import ERROR, Call, Reply, call_owner
from murmur.node.exchange.settings import (
    ExchangeSettings,
    ExchangeSettingsError,
    alignment,
    chunk_ranges,
    spans,
)
from murmur.node.exchange.snapshot import Snapshot
from murmur.node.exchange.stats import PhaseTimes, Timeline
from murmur.node.exchange.validate import InputRejected, validate_gather
from murmur.node.net.faults import FAULTS, FaultInjector
from murmur.node.net.loop import LoopThread
from murmur.node.net.server import STREAM_WINDOW_OPTION, PeerServer
from murmur.optim.aggregate import Aggregator
from murmur.optim.codecs import Codec
from murmur.optim.exchange import Exchange, ExchangeError, GatherResult, ReduceResult
from murmur.optim.reduce import reduce_payloads
from murmur.optim.wire import WireTensor
from murmur.protocol import peer_pb2, tls
from murmur.protocol.wire import WireError, WireLimits, layout_hash, wire_to_proto

OWN_LEAD_CHUNKS = 4  # how far our own input to our span may run ahead of the slowest member

__all__ = ["ExchangeSettings", "ExchangeSettingsError", "GrpcExchange", "spans"]



class GrpcExchange(Exchange):
    def __init__(
        self,
        server: PeerServer,
        loop: LoopThread,
        group: GroupProvider,
        codec: Codec,
        *,
        aggregator: Aggregator | None = None,
        settings: ExchangeSettings | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        self.server = server
        self.loop = loop
        self.group = group
        self.codec = codec
        self.aggregator = aggregator or Aggregator(rule="mean", filter=False)
        self.settings = settings or ExchangeSettings()
        self.faults = faults or FaultInjector()
        self.book = RoundBook()
        self.times = PhaseTimes()  # worker-thread CPU seconds by phase (node/exchange/stats.py)
        self.timeline = Timeline()  # wall-clock events by chunk, off unless enabled (diagnosis)
        self.caught_up: list[tuple[int, str]] = []  # calls whose result came from peers (observability)
        self.limits = WireLimits(max_numel=self.settings.max_payload_bytes)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._serve = ServeSettings(
            peer_timeout=self.settings.peer_timeout,
            round_deadline=self.settings.round_deadline,
            max_payload_bytes=self.settings.max_payload_bytes,
            run_id=server.run_id,
            node_id=server.node_id,
            times=self.times,
            timeline=self.timeline,
        )
        server.exchange_handler = lambda peer, ctx: serve_exchange(
            self.book, self._serve, peer, ctx, lambda: self.codec, self.limits
        )
        server.hello_rounds = self._done_list
        server.on_refusal = self._drop_everywhere

    # -- the Exchange interface (called from the training thread) ----------------------------------

    @property
    def peer_id(self) -> str:
        return self.server.node_id

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, round_id: int, key: str = "", weight: float = 1.0
    ) -> Future[ReduceResult]:
        return self.loop.submit(self.areduce(list(tensors), round_id=round_id, key=key, weight=weight))

    def all_gather(self, wire: Sequence[WireTensor], *, round_id: int, key: str = "") -> Future[GatherResult]:
        return self.loop.submit(self.agather(list(wire), round_id=round_id, key=key))

    def close(self) -> None:
        self.loop.run(self.aclose())

    async def aclose(self) -> None:
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.close()

    # -- the two collectives ----------------------------------------------------------------------

    async def areduce(
        self, tensors: list[torch.Tensor], *, round_id: int, key: str = "", weight: float = 1.0
    ) -> ReduceResult:
        self._check_weight(weight)
        self.timeline.mark("call", round=round_id)
        if not self.codec.dense:  # codec.encode adds (and keeps) the key's error feedback itself
            flat = await asyncio.to_thread(_flatten, tensors)  # one fp32 copy: the caller may go on
            return await self._sparse_reduce(tensors, flat, round_id, key, weight)
        align = alignment(self.settings.span_align, self.codec)
        chunk = self.settings.chunk_elements(align)
        # One flat fp32 copy of the update (plus the key's error feedback), made chunk by chunk in a
        # worker thread from now on: the chunks that go first are copied first (exchange_snapshot).
        residual = self.codec.residuals.get(key) if self.codec.error_feedback else None
        snap = Snapshot(tensors, residual, chunk)
        snap.start()
        try:
            layout = layout_hash(
                self.codec.name,
                [(t.shape, t.dtype) for t in tensors],
                f"reduce|align={align}|chunk={chunk}",
            )
            call = await self._new_call(peer_pb2.OP_REDUCE, round_id, key, weight, layout)
            x = snap.flat
            call.x, call.snapshot, call.numel, call.align, call.chunk = x, snap, x.numel(), align, chunk
            call.result = torch.empty(call.numel)
            if self.codec.error_feedback:
                call.own = torch.empty(call.numel)
            named, members, fetched = await self._run(call)
            result = named.get("0")
            if result is None or result.dtype != torch.float32 or tuple(result.shape) != (call.numel,):
                raise ExchangeError(f"round {round_id} {key!r}: the fetched result does not fit this update")
            if self.codec.error_feedback and not fetched:
                assert call.own is not None
                await snap.wait()  # every chunk went out, so every piece is in; to be sure
                self.codec.residuals[key] = x.sub_(call.own)  # x is ours: the residual reuses its memory
        finally:
            snap.cancel()
        out, pos = [], 0
        for t in tensors:
            out.append(result[pos : pos + t.numel()].reshape(t.shape))
            pos += t.numel()
        return ReduceResult(out, members, dict(call.dropped), call.sent, call.received, self.codec.name)

    async def agather(
        self, wires: list[WireTensor], *, round_id: int, key: str = "", weight: float = 1.0
    ) -> GatherResult:
        res, _ = await self._gather(wires, round_id, key, weight)
        return res

    async def _gather(
        self, wires: list[WireTensor], round_id: int, key: str, weight: float
    ) -> tuple[GatherResult, dict[str, float]]:
        self._check_weight(weight)
        parts = [
            (
                w.codec,
                tuple(w.shape),
                w.dtype,
                sorted((n, str(t.dtype), tuple(t.shape)) for n, t in w.parts.items()),
            )
            for w in wires
        ]
        layout = layout_hash("gather", [], repr(parts))
        call = await self._new_call(peer_pb2.OP_GATHER, round_id, key, weight, layout)
        call.gather_wires = wires
        call.gather_payload = peer_pb2.Payload(tensors=[wire_to_proto(w) for w in wires]).SerializeToString()
        named, members, _ = await self._run(call)
        check = validate_gather(wires, self.codec, self.limits)
        updates: dict[str, list[WireTensor]] = {}
        weights = named.get("weights")
        if weights is None or weights.numel() != len(members):
            raise ExchangeError(f"round {round_id} {key!r}: the gathered result has no weights")
        for m in members:
            raw = named.get(f"m/{m}")
            if raw is None:
                raise ExchangeError(f"round {round_id} {key!r}: the gathered result misses {m}")
            try:
                updates[m] = check(m, peer_pb2.Payload.FromString(raw.numpy().tobytes()))  # type: ignore[assignment]
            except (WireError, InputRejected, DecodeError) as err:
                raise ExchangeError(
                    f"round {round_id} {key!r}: the gathered input of {m} is invalid: {err}"
                ) from None
        res = GatherResult(updates, dict(call.dropped), call.sent, call.received, self.codec.name)
        return res, {m: float(w) for m, w in zip(members, weights.tolist(), strict=True)}

    async def _sparse_reduce(self, tensors, x, round_id: int, key: str, weight: float) -> ReduceResult:
        wire = await asyncio.to_thread(self.codec.encode, x, key)
        res, weights = await self._gather([wire], round_id, key, weight)
        agg, members, dropped, _ = await asyncio.to_thread(
            reduce_payloads, self.codec, self.aggregator, res.updates, weights, key
        )
        out, pos = [], 0
        for t in tensors:
            out.append(agg[0].reshape(-1)[pos : pos + t.numel()].reshape(t.shape))
            pos += t.numel()
        dropped = {**res.dropped, **dropped}
        return ReduceResult(out, members, dropped, res.bytes_sent, res.bytes_received, self.codec.name)

    @staticmethod
    def _check_weight(weight: float) -> None:
        if not math.isfinite(weight) or weight < 0:
            raise ExchangeError(f"weight must be a finite non-negative number, got {weight}")

    async def _new_call(self, op: int, round_id: int, key: str, weight: float, layout: bytes) -> Call:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.round_deadline
        try:
            peers = await asyncio.wait_for(self.group.members(round_id, key), self.settings.round_deadline)
        except Exception as err:  # noqa: BLE001 - rendezvous failures end the call with one line
            raise ExchangeError(f"round {round_id} {key!r}: rendezvous failed: {err}") from None
        peers = {n: a for n, a in peers.items() if not self.server.ban_list.is_banned(n)}
        peers[self.peer_id] = self.server.address
        call = Call(op, round_id, key, weight, layout, dict(sorted(peers.items())), len(peers), deadline)
        call.faults = {f for f in FAULTS if self.faults.take(f, self.peer_id, round_id)}
        if "stall" in call.faults:  # a machine that hangs: it still sends, but never answers
            self.book.stalled.set()
        return call

    # -- attempts ---------------------------------------------------------------------------------

    async def _run(self, call: Call) -> tuple[dict[str, torch.Tensor], list[str], bool]:
        """(named result tensors, members, fetched from a peer?) of a call, or ExchangeError."""
        me, loop = self.peer_id, asyncio.get_running_loop()
        members, excluded = sorted(call.peers), dict[str, str]()
        number, hints, why = 0, dict[str, bytes](), "the round deadline passed"
        try:
            while loop.time() < call.deadline:
                if len(members) <= call.start_members * self.settings.quorum:
                    why = f"only {len(members)} of {call.start_members} peers left (no quorum)"
                    # Do not just sit in catch-up until the deadline: that waits for someone else
                    # to complete, and when every peer lost quorum (e.g. a peer killed mid-round
                    # left a rendezvous entry at its old address, and then came back under the
                    # same node id at a new one) nobody ever does: each waits, deaf to the others'
                    # new attempts, until the round deadline, and the retried round meets the
                    # same stale attempts again. So: adopt a result if someone has one, else
                    # meet again (fresh rendezvous, fresh addresses, nobody excluded) and retry.
                    hints = await ask_done(self, call)
                    if hints:
                        why = "other peers completed this round first"
                        break
                    if loop.time() + self.settings.catch_up_poll >= call.deadline:
                        break
                    await asyncio.sleep(self.settings.catch_up_poll)
                    members, excluded = await self._regroup(call, members), {}
                    if len(members) <= call.start_members * self.settings.quorum:
                        continue
                att = await self._make_attempt(call, number, tuple(members))
                self.timeline.mark("attempt", number=number, members=len(members))
                await self.book.register(att)
                replies = await self._attempt(call, att)
                hints = {o: r.result_hash for o, r in replies.items() if r.code == DONE}
                if hints:
                    why = "other peers completed this round first"
                    break
                call.received += att.bytes_received  # the inputs this peer took in as an owner
                if att.done.is_set() and not att.failed and all(r.code == OK for r in replies.values()):
                    # As an owner it sends its re-encoded span to every other member.
                    if isinstance(att, ReduceAttempt):
                        call.sent += att.result_bytes * (len(att.members) - 1)
                    self.timeline.mark("complete")
                    return await self._complete(call, att, replies), list(att.members), False
                failed, seen, at = self._failures(call, att, replies)
                att.close()
                if me in failed:
                    why = f"this peer's input was refused: {failed[me]}"
                    call.dropped[me] = failed[me]
                    break
                call.dropped.update(failed)
                excluded.update(failed)
                members = sorted((set(members) | (seen & set(call.peers))) - set(excluded))
                number = max(number + 1, at)
            named, members_done = await catch_up(self, call, hints, why)
            self.caught_up.append((call.round_id, call.key))
            return named, members_done, True
        finally:
            self.book.forget(call.round_id, call.key)

    async def _regroup(self, call: Call, members: list[str]) -> list[str]:
        """The round's members as the group shows them now (``members`` if it cannot tell).

        A peer that was killed and restarted under the same node id is back at a new address:
        ``call.peers`` takes the new one, so the next attempt dials the live incarnation."""
        loop = asyncio.get_running_loop()
        try:
            peers = await asyncio.wait_for(
                self.group.members(call.round_id, call.key), max(call.deadline - loop.time(), 0.001)
            )
        except Exception:  # noqa: BLE001 - a failed rendezvous read: keep what we have, retry later
            return members
        peers = {n: a for n, a in peers.items() if not self.server.ban_list.is_banned(n)}
        peers[self.peer_id] = self.server.address
        call.peers.update(peers)
        return sorted(peers)

    def _failures(
        self, call: Call, att: Attempt, replies: dict[str, Reply]
    ) -> tuple[dict[str, str], set[str], int]:
        me, failed, seen, at = self.peer_id, {}, set(), att.number
        for o, r in replies.items():
            if r.code == ERROR:
                failed[o] = r.reason
            elif r.code == REFUSED:
                failed[me] = f"{o} refused it: {r.reason}"
            elif r.code == ABORT:
                failed.update({k: v for k, v in r.failed.items() if k in call.peers})
                seen |= set(r.members)
                at = max(at, r.attempt)
        if att.done.is_set():
            failed.update({k: v for k, v in att.failed.items() if k in call.peers})
        else:
            # We leave before our own inputs settled: say so to whoever still sends to us, without
            # blaming members that may simply not have reached us yet.
            att.disagree("the owner left this attempt early")
        return {k: v for k, v in failed.items() if k in call.peers}, seen, at

    async def _make_attempt(self, call: Call, number: int, members: tuple[str, ...]) -> Attempt:
        me = self.peer_id
        if call.op != peer_pb2.OP_REDUCE:
            gather = GatherAttempt(
                op=peer_pb2.OP_GATHER,
                round_id=call.round_id,
                key=call.key,
                number=number,
                members=members,
                layout=call.layout,
                validate=validate_gather(call.gather_wires, self.codec, self.limits),
            )
            gather.started.add(me)
            gather.add(me, call.gather_wires, call.weight)
            return gather
        start, end = spans(call.numel, len(members), call.align)[members.index(me)]
        ranges = chunk_ranges(end - start, call.chunk)
        result = call.result
        assert result is not None

        def sink(j: int, value: torch.Tensor) -> None:
            self.timeline.mark("red", j=j)
            a, b = ranges[j]
            result[start + a : start + b] = value

        att = ReduceAttempt(
            op=peer_pb2.OP_REDUCE,
            round_id=call.round_id,
            key=call.key,
            number=number,
            members=members,
            layout=call.layout,
            span=(start, end),
            chunks=ranges,
            reduce_chunk=self.times.wrap("reduce", chunk_reducer(self.codec, self.aggregator, call.key)),
            sink=sink,
        )
        att.started.add(me)
        att.weights[me] = call.weight
        att.start()
        att.tasks.append(asyncio.get_running_loop().create_task(self._feed_own(call, att)))
        return att

    async def _feed_own(self, call: Call, att: ReduceAttempt) -> None:
        """Our own input to the span we own, chunk by chunk, encoded and decoded like everyone's."""
        codec, start = self.codec, att.span[0]
        round_trip = self.times.wrap("own", _round_trip)
        assert call.x is not None
        others = [m for m in att.members if m != self.peer_id]
        for j, (a, b) in enumerate(att.chunks):
            # Stay a few chunks ahead of the slowest member, not a whole span: each chunk waiting
            # for the others is held decoded, in fp32.
            while others and j - min(att.received.get(m, 0) for m in others) > OWN_LEAD_CHUNKS:
                ev = att.changed
                if att.done.is_set():
                    return
                await ev.wait()
            if call.snapshot is not None:
                await call.snapshot.ready(start + a, start + b)
            piece = call.x[start + a : start + b]
            own = await asyncio.to_thread(round_trip, codec, piece, call.key)
            if call.own is not None:
                call.own[start + a : start + b] = own
            att.add_chunk(self.peer_id, j, own)

    async def _attempt(self, call: Call, att: Attempt) -> dict[str, Reply]:
        """Send our input to every other member and collect their answers, all bounded in time."""
        loop, s = asyncio.get_running_loop(), self.settings
        others = [m for m in att.members if m != self.peer_id]
        sp = spans(call.numel, len(att.members), call.align) if call.op == peer_pb2.OP_REDUCE else []
        progress = [loop.time()]
        sent = [0]
        call.delivered = set()
        tasks = {
            o: asyncio.create_task(
                call_owner(
                    self, call, att, o, sp[att.members.index(o)] if sp else (0, 0), progress, sent, len(others)
                )
            )
            for o in others
        }
        expire = loop.call_later(s.peer_timeout, att.expire, s.peer_timeout)
        own = asyncio.create_task(att.done.wait())
        pending: set[asyncio.Task] = {*tasks.values(), own}
        own_done_at: float | None = None
        try:
            while pending:
                wait = call.deadline - loop.time()
                if own.done():
                    # Our own inputs are settled (all in, or expired), so every other owner's are
                    # too within one peer_timeout of skew; an owner silent past that (and past any
                    # transfer still making progress) is stalled or gone.
                    own_done_at = own_done_at or loop.time()
                    bound = max(own_done_at, progress[0]) + 2 * s.peer_timeout
                    wait = min(wait, bound - loop.time())
                if wait <= 0:
                    break
                done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if not done and own_done_at is not None:
                    break
                finished = [t.result() for t in tasks.values() if t.done()]
                if any(r.code == DONE for r in finished):
                    break  # someone completed the round: catch up from it, nothing else matters
                if len(finished) == len(tasks) and any(r.code != OK for r in finished):
                    local = all(
                        t.result().code == OK or (t.result().code == ERROR and o in call.delivered)
                        for o, t in tasks.items()
                    )
                    if own.done() or not local:
                        break  # doomed, and every other member has told us why
                    # Every owner has our whole input, and what failed was only our side of some
                    # answers (a result chunk lost or cut off): the others may still complete this
                    # attempt, and they need our span. Keep owning it until every input is in and
                    # reduced, or the attempt fails here (a member gone or silent is failed within
                    # peer_timeout); then retry without those owners and catch up from them.
        finally:
            expire.cancel()
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in tasks.values():  # retrieved, so an ending call does not log them as lost
                if t.done() and not t.cancelled():
                    t.exception()
        replies = {}
        for o, t in tasks.items():
            if t.cancelled() or not t.done():
                replies[o] = Reply(ERROR, reason=f"no answer within {s.peer_timeout:g}s (stalled or gone)")
            else:
                replies[o] = t.result()
        return replies

    def die(self, when: str) -> None:
        """The injected ``exit`` faults: die as a SIGKILL would (or as the injector's stand-in does)."""
        if self.faults.die is None:
            os.kill(os.getpid(), signal.SIGKILL)
        self.faults.die()
        raise ExchangeError(f"killed {when} (injected fault)")

    async def _complete(self, call: Call, att: Attempt, replies: dict[str, Reply]) -> dict[str, torch.Tensor]:
        if isinstance(att, ReduceAttempt):
            assert call.result is not None
            named = {"0": call.result}  # every chunk of every span landed: every owner answered OK
        else:
            assert isinstance(att, GatherAttempt)
            named = {}
            for m in att.members:
                raw = peer_pb2.Payload(tensors=[wire_to_proto(w) for w in att.inputs[m]]).SerializeToString()
                named[f"m/{m}"] = (
                    torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    if raw
                    else torch.zeros(0, dtype=torch.uint8)
                )
            named["weights"] = torch.tensor([att.weights[m] for m in att.members], dtype=torch.float64)
        await publish(self, call, named, list(att.members))
        self.timeline.mark("hashed")
        return named

    # -- plumbing ---------------------------------------------------------------------------------

    def channel(self, node_id: str, address: str) -> grpc.aio.Channel:
        cached = self._channels.get(node_id)
        if cached is not None and getattr(cached, "_murmur_address", None) == address:
            return cached
        tls.check_dial(node_id, self.server.ban_list)
        options = [
            *tls.channel_options(node_id, self.settings.max_message_bytes),
            (STREAM_WINDOW_OPTION, self.settings.stream_window_bytes),  # results stream back to us
        ]
        channel = grpc.aio.secure_channel(address, tls.channel_credentials(self.server.identity), options=options)
        channel._murmur_address = address  # type: ignore[attr-defined]
        self._channels[node_id] = channel
        return channel

    def _done_list(self) -> list[peer_pb2.RoundDone]:
        return [
            peer_pb2.RoundDone(round=r, key=k, result_hash=d.result_hash, members=d.members)
            for (r, k), d in self.book.done.items()
        ]

    def _drop_everywhere(self, peer_id: str, reason: str) -> None:
        """A peer refused at the door (banned, other version) is failed in every open attempt at once."""
        for atts in self.book.attempts.values():
            for att in atts.values():
                att.reject(peer_id, reason)


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]) if tensors else torch.zeros(0)


def _round_trip(codec: Codec, piece: torch.Tensor, key: str) -> torch.Tensor:
    return codec.decode(codec.encode_stateless(piece, f"{key}/span"))
