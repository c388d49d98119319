"""`GrpcExchange`: optim's `Exchange` between nodes, over gRPC streams with mutual TLS.

All-reduce (dense codecs): the update is flattened; the sorted member list cuts it into one span
per member (aligned to ``span_align``); each peer encodes span i and streams it to member i;
member i checks and decodes every input, aggregates (the run's rule: mean, trimmed mean,
CenteredClip), re-encodes once and streams the same bytes back to everyone. Each peer thus sends
about (N-1)/N of its payload and (N-1)/N of the result: the butterfly's 2(N-1)/N.
Sparse codecs (top-k) and all-gather: every peer streams its payload to every other member;
a sparse all-reduce then aggregates every payload locally, in sorted order.

Rounds, attempts and failures. A call is one round (round_id, key). It runs in attempts: an
attempt has a fixed member list and succeeds only if every member's input reached every owner
and every owner answered. Anything else (a peer died, stalled, was refused, disagreed on the
member list) aborts the attempt everywhere; the callers learn who failed and why from the
owners' answers and retry without them, so a dead peer's span is re-owned by the survivors and
a result is never a partial average. A peer that completed a round answers later attempts with
ALREADY_DONE and publishes the result (``result/<round>/<key>``): a peer whose round did not
complete (it lost a reply, was refused, came late) fetches it from the peers that completed and
checks it against their published hash, instead of drifting away. A round needs more than
``quorum`` of the peers it started with, so a cut-off minority can never finish on its own.
Every wait is bounded by ``peer_timeout`` (per peer) and ``round_deadline`` (per call).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch
from google.protobuf.message import DecodeError
from murmur.node.exchange_collect import (
    ABORT,
    DONE,
    OK,
    REFUSED,
    Attempt,
    DoneRecord,
    InputRejected,
    RoundBook,
    ServeSettings,
    decode_checked,
    reduce_finalizer,
    serve_exchange,
    validate_gather,
    validate_span,
)
from murmur.node.exchange_group import GroupProvider
from murmur.node.peer_faults import FaultInjector
from murmur.node.peer_loop import LoopThread
from murmur.node.peer_server import PeerServer, PublishedState
from murmur.node.peer_state import StateError, StateFetchSettings, afetch, result_name
from murmur.optim.aggregate import Aggregator
from murmur.optim.codecs import Codec
from murmur.optim.exchange import Exchange, ExchangeError, GatherResult, ReduceResult
from murmur.optim.reduce import reduce_payloads
from murmur.optim.wire import WireTensor
from murmur.protocol import peer_pb2, peer_pb2_grpc, tls
from murmur.protocol.identity import BannedError
from murmur.protocol.version import PROTOCOL_VERSION, VERSION_METADATA_KEY
from murmur.protocol.wire import (
    WireError,
    WireLimits,
    layout_hash,
    split,
    tensors_hash,
    wire_from_proto,
    wire_to_proto,
)

from murmur.errors import MurmurError

ERROR = -1  # a call that produced no status at all (unreachable, refused at the door, stalled)


class ExchangeSettingsError(MurmurError):
    pass


@dataclass(kw_only=True, slots=True)
class ExchangeSettings:
    peer_timeout: float = 30.0  # a member silent this long (no input, no reply) is dropped
    round_deadline: float = 300.0  # one call, every attempt and the catch-up included
    max_payload_bytes: int = 1 << 30  # one member's payload for one call; more is refused unread
    chunk_bytes: int = 1 << 20  # frame size of a streamed payload
    max_message_bytes: int = tls.DEFAULT_MAX_MESSAGE_BYTES  # gRPC's own cap on one frame
    span_align: int = 4096  # span boundaries fall on multiples of this many elements
    quorum: float = 0.5  # a round needs more than this fraction of its starting group
    catch_up_poll: float = 0.2  # how often a lagging peer asks whether someone completed
    keep_results: int = 2  # results kept (and served) per key for peers catching up

    def __post_init__(self) -> None:
        for name in ("peer_timeout", "round_deadline", "catch_up_poll"):
            if getattr(self, name) <= 0:
                raise ExchangeSettingsError(f"exchange setting {name} must be positive")
        if self.chunk_bytes + 4096 > self.max_message_bytes:
            raise ExchangeSettingsError("chunk_bytes must leave room under max_message_bytes")
        if not 0 <= self.quorum < 1:
            raise ExchangeSettingsError("quorum is a fraction in [0, 1)")


@dataclass(slots=True)
class _Reply:
    code: int
    reason: str = ""
    failed: dict[str, str] = field(default_factory=dict)
    members: list[str] = field(default_factory=list)
    attempt: int = 0
    result_hash: bytes = b""
    value: object = None


@dataclass(slots=True)
class _Call:
    """What one call needs across its attempts."""

    op: int
    round_id: int
    key: str
    weight: float
    layout: bytes
    peers: dict[str, str]
    start_members: int
    deadline: float
    numel: int = 0  # reduce: elements of the flat update
    x: torch.Tensor | None = None  # reduce: the flat update (error feedback added)
    gather_payload: bytes = b""  # gather: our payload, the same for everyone
    gather_wires: list[WireTensor] = field(default_factory=list)
    sent: int = 0
    received: int = 0
    dropped: dict[str, str] = field(default_factory=dict)
    decoded_own: dict[int, torch.Tensor] = field(default_factory=dict)  # span start -> what we sent
    faults: set[str] = field(default_factory=set)  # injected faults that strike this call


def spans(numel: int, members: int, align: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, one per member, boundaries on multiples of ``align``."""
    per = math.ceil(numel / members / align) * align if numel else 0
    return [(min(i * per, numel), min((i + 1) * per, numel)) for i in range(members)]


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
        self.caught_up: list[tuple[int, str]] = []  # calls whose result came from peers (observability)
        self.limits = WireLimits(max_numel=self.settings.max_payload_bytes)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._serve = ServeSettings(
            peer_timeout=self.settings.peer_timeout,
            round_deadline=self.settings.round_deadline,
            max_payload_bytes=self.settings.max_payload_bytes,
            chunk_bytes=self.settings.chunk_bytes,
            run_id=server.run_id,
            node_id=server.node_id,
        )
        server.exchange_handler = lambda peer, ctx: serve_exchange(self.book, self._serve, peer, ctx)
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
        flat = (
            torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]) if tensors else torch.zeros(0)
        )
        x = flat
        residual = self.codec.residuals.get(key) if self.codec.error_feedback else None
        if residual is not None and residual.shape == flat.shape:
            x = flat + residual
        if not self.codec.dense:
            return await self._sparse_reduce(tensors, x, round_id, key, weight)
        layout = layout_hash(self.codec.name, [(t.shape, t.dtype) for t in tensors], "reduce")
        call = await self._new_call(peer_pb2.OP_REDUCE, round_id, key, weight, layout)
        call.x, call.numel = x, x.numel()
        named, members, fetched = await self._run(call)
        result = named.get("0")
        if result is None or result.dtype != torch.float32 or tuple(result.shape) != (call.numel,):
            raise ExchangeError(f"round {round_id} {key!r}: the fetched result does not fit this update")
        if self.codec.error_feedback and not fetched:
            own = torch.cat([call.decoded_own[s] for s in sorted(call.decoded_own)]) if call.numel else x
            self.codec.residuals[key] = x - own
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

    async def _new_call(self, op: int, round_id: int, key: str, weight: float, layout: bytes) -> _Call:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.round_deadline
        try:
            peers = await asyncio.wait_for(self.group.members(round_id, key), self.settings.round_deadline)
        except Exception as err:  # noqa: BLE001 - rendezvous failures end the call with one line
            raise ExchangeError(f"round {round_id} {key!r}: rendezvous failed: {err}") from None
        peers = {n: a for n, a in peers.items() if not self.server.ban_list.is_banned(n)}
        peers[self.peer_id] = self.server.address
        call = _Call(op, round_id, key, weight, layout, dict(sorted(peers.items())), len(peers), deadline)
        call.faults = {
            f
            for f in (
                "nan",
                "wrong_shape",
                "corrupt",
                "oversize",
                "wrong_version",
                "stall",
                "lose_result",
                "exit",
            )
            if self.faults.take(f, self.peer_id, round_id)
        }
        if "stall" in call.faults:  # a machine that hangs: it still sends, but never answers
            self.book.stalled.set()
        return call

    # -- attempts ---------------------------------------------------------------------------------

    async def _run(self, call: _Call) -> tuple[dict[str, torch.Tensor], list[str], bool]:
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
                    hints = await self._ask_done(call)
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
                await self.book.register(att)
                replies = await self._attempt(call, att)
                hints = {o: r.result_hash for o, r in replies.items() if r.code == DONE}
                if hints:
                    why = "other peers completed this round first"
                    break
                call.received += att.bytes_received  # the inputs this peer took in as an owner
                if att.done.is_set() and not att.failed and all(r.code == OK for r in replies.values()):
                    # As an owner it sends its re-encoded span to every other member.
                    call.sent += len(att.result_payload) * (len(att.members) - 1)
                    return self._complete(call, att, replies), list(att.members), False
                failed, seen, at = self._failures(call, att, replies)
                if me in failed:
                    why = f"this peer's input was refused: {failed[me]}"
                    call.dropped[me] = failed[me]
                    break
                call.dropped.update(failed)
                excluded.update(failed)
                members = sorted((set(members) | (seen & set(call.peers))) - set(excluded))
                number = max(number + 1, at)
            named, members_done = await self._catch_up(call, hints, why)
            self.caught_up.append((call.round_id, call.key))
            return named, members_done, True
        finally:
            self.book.forget(call.round_id, call.key)

    async def _regroup(self, call: _Call, members: list[str]) -> list[str]:
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
        self, call: _Call, att: Attempt, replies: dict[str, _Reply]
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

    async def _make_attempt(self, call: _Call, number: int, members: tuple[str, ...]) -> Attempt:
        me = self.peer_id
        if call.op == peer_pb2.OP_REDUCE:
            start, end = spans(call.numel, len(members), self.settings.span_align)[members.index(me)]
            att = Attempt(
                peer_pb2.OP_REDUCE,
                call.round_id,
                call.key,
                number,
                members,
                call.layout,
                (start, end),
                validate_span(self.codec, end - start, self.limits),
                reduce_finalizer(self.codec, self.aggregator),
            )
            assert call.x is not None
            wire = await asyncio.to_thread(self.codec.encode_stateless, call.x[start:end], f"{call.key}/span")
            own = await asyncio.to_thread(self.codec.decode, wire)
            call.decoded_own[start] = own
            att.add(me, own, call.weight)
        else:
            att = Attempt(
                peer_pb2.OP_GATHER,
                call.round_id,
                call.key,
                number,
                members,
                call.layout,
                (0, 0),
                validate_gather(call.gather_wires, self.codec, self.limits),
                lambda a: None,
            )
            att.add(me, call.gather_wires, call.weight)
        return att

    async def _attempt(self, call: _Call, att: Attempt) -> dict[str, _Reply]:
        """Send our input to every other member and collect their answers, all bounded in time."""
        loop, s = asyncio.get_running_loop(), self.settings
        others = [m for m in att.members if m != self.peer_id]
        sp = spans(call.numel, len(att.members), s.span_align) if call.op == peer_pb2.OP_REDUCE else []
        progress = [loop.time()]
        sent = [0]
        tasks = {
            o: asyncio.create_task(
                self._call_owner(
                    call, att, o, sp[att.members.index(o)] if sp else (0, 0), progress, sent, len(others)
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
                    break  # doomed, and every other member has told us why
        finally:
            expire.cancel()
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        replies = {}
        for o, t in tasks.items():
            if t.cancelled() or not t.done():
                replies[o] = _Reply(ERROR, reason=f"no answer within {s.peer_timeout:g}s (stalled or gone)")
            else:
                replies[o] = t.result()
        return replies

    async def _call_owner(
        self,
        call: _Call,
        att: Attempt,
        owner: str,
        span: tuple[int, int],
        progress: list[float],
        sent: list[int],
        n_others: int,
    ) -> _Reply:
        s, loop, faults = self.settings, asyncio.get_running_loop(), call.faults
        payload = await self._payload_for(call, span)
        declared = s.max_payload_bytes + 1 if "oversize" in faults else len(payload)
        version = PROTOCOL_VERSION + 1 if "wrong_version" in faults else PROTOCOL_VERSION
        header = peer_pb2.ExchangeHeader(
            protocol_version=version,
            run_id=self.server.run_id,
            op=call.op,
            round=call.round_id,
            key=call.key,
            attempt=att.number,
            members=list(att.members),
            sender=self.peer_id,
            weight=call.weight,
            layout_hash=call.layout,
            span_start=span[0],
            span_end=span[1],
            payload_bytes=declared,
        )
        rpc = None
        try:
            tls.check_dial(owner, self.server.ban_list)
            stub = peer_pb2_grpc.PeerStub(self._channel(owner, call.peers[owner]))
            rpc = stub.Exchange(
                metadata=((VERSION_METADATA_KEY, str(version)),),
                timeout=max(call.deadline - loop.time(), 0.001),
            )
            await asyncio.wait_for(rpc.write(peer_pb2.ExchangeFrame(header=header)), s.peer_timeout)
            if "oversize" not in faults:
                for piece in split(payload, s.chunk_bytes):
                    await asyncio.wait_for(rpc.write(peer_pb2.ExchangeFrame(data=piece)), s.peer_timeout)
                    progress[0] = loop.time()
                call.sent += len(payload)
            await rpc.done_writing()
            sent[0] += 1
            if sent[0] == n_others:
                self._after_send(call)
            return await self._read_reply(call, owner, span, rpc, progress)
        except grpc.aio.AioRpcError as err:
            return _Reply(ERROR, reason=f"{err.code().name}: {err.details()}")
        except asyncio.InvalidStateError:  # the callee ended the call while we were still writing
            code, details = await rpc.code(), await rpc.details()  # type: ignore[union-attr]
            return _Reply(ERROR, reason=f"{code.name}: {details}")
        except asyncio.TimeoutError:
            return _Reply(ERROR, reason=f"stalled: a write took more than {s.peer_timeout:g}s")
        except BannedError as err:
            return _Reply(ERROR, reason=str(err))
        finally:
            if rpc is not None and not rpc.done():
                rpc.cancel()

    async def _read_reply(self, call: _Call, owner: str, span: tuple[int, int], rpc, progress) -> _Reply:
        loop = asyncio.get_running_loop()
        reply = await rpc.read()
        if reply is grpc.aio.EOF or reply.WhichOneof("kind") != "status":
            return _Reply(ERROR, reason="closed the stream without a status")
        st = reply.status
        progress[0] = loop.time()
        if st.protocol_version != PROTOCOL_VERSION:
            return _Reply(
                ERROR,
                reason=f"answers in protocol v{st.protocol_version}, this node speaks v{PROTOCOL_VERSION}",
            )
        if st.code != OK or call.op != peer_pb2.OP_REDUCE:
            return _Reply(st.code, st.reason, dict(st.failed), list(st.members), st.attempt, st.result_hash)
        if st.payload_bytes > self.settings.max_payload_bytes:
            return _Reply(ERROR, reason=f"its result of {st.payload_bytes} bytes is over the limit")
        buf = bytearray()
        while len(buf) < st.payload_bytes:
            frame = await rpc.read()
            if frame is grpc.aio.EOF or frame.WhichOneof("kind") != "data":
                return _Reply(ERROR, reason=f"its result ended after {len(buf)} of {st.payload_bytes} bytes")
            buf += frame.data
            progress[0] = loop.time()
        if len(buf) != st.payload_bytes:
            return _Reply(ERROR, reason="its result is longer than it declared")
        if "lose_result" in call.faults:
            call.faults.discard("lose_result")
            return _Reply(ERROR, reason="its result was lost (injected fault)")
        call.received += len(buf)
        try:
            payload = peer_pb2.Payload.FromString(bytes(buf))
            if len(payload.tensors) != 1:
                raise InputRejected("the result must hold exactly one tensor")
            wire = wire_from_proto(payload.tensors[0], self.limits)
            value = await asyncio.to_thread(decode_checked, self.codec, wire, (span[1] - span[0],))
        except (WireError, InputRejected, DecodeError) as err:
            return _Reply(ERROR, reason=f"its result was refused: {err}")
        return _Reply(OK, members=list(st.contributors), value=value)

    async def _payload_for(self, call: _Call, span: tuple[int, int]) -> bytes:
        faults = call.faults
        if call.op == peer_pb2.OP_REDUCE:
            assert call.x is not None
            piece = call.x[span[0] : span[1]]
            if "nan" in faults and piece.numel():
                piece = piece.clone()
                piece[0] = float("nan")
            wire = await asyncio.to_thread(self.codec.encode_stateless, piece, f"{call.key}/span")
            if self.codec.error_feedback and "nan" not in faults:
                call.decoded_own[span[0]] = await asyncio.to_thread(self.codec.decode, wire)
            if "wrong_shape" in faults:
                wire.shape = (piece.numel() + 1,)
            payload = peer_pb2.Payload(tensors=[wire_to_proto(wire)]).SerializeToString()
        else:
            payload = call.gather_payload
            if "nan" in faults or "wrong_shape" in faults:
                msg = peer_pb2.Payload.FromString(payload)
                for t in msg.tensors:
                    if "wrong_shape" in faults:
                        t.shape.append(1)
                    for part in t.parts:
                        if part.dtype in ("float32", "float16", "bfloat16") and len(part.data) >= 4:
                            nan = {
                                "float32": b"\x00\x00\xc0\x7f",
                                "float16": b"\x00\x7e",
                                "bfloat16": b"\xc0\x7f",
                            }
                            part.data = nan[part.dtype] + part.data[len(nan[part.dtype]) :]
                payload = msg.SerializeToString()
        if "corrupt" in faults:
            payload = b"\xff" * max(len(payload), 1)  # field 31 with wire type 7: never a valid message
        return payload

    def _after_send(self, call: _Call) -> None:
        """The fault that strikes once our input is out: die, as a SIGKILL would."""
        if "exit" in call.faults:
            os.kill(os.getpid(), signal.SIGKILL)

    def _complete(self, call: _Call, att: Attempt, replies: dict[str, _Reply]) -> dict[str, torch.Tensor]:
        me = self.peer_id
        if call.op == peer_pb2.OP_REDUCE:
            sp = spans(call.numel, len(att.members), self.settings.span_align)
            pieces = [att.result if m == me else replies[m].value for m in att.members]
            flat = torch.cat([p.reshape(-1) for p in pieces]) if call.numel else torch.zeros(0)  # type: ignore[union-attr]
            assert flat.numel() == call.numel and len(sp) == len(pieces)
            named = {"0": flat}
        else:
            named = {}
            for m in att.members:
                raw = peer_pb2.Payload(tensors=[wire_to_proto(w) for w in att.inputs[m]]).SerializeToString()  # type: ignore[union-attr]
                named[f"m/{m}"] = (
                    torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    if raw
                    else torch.zeros(0, dtype=torch.uint8)
                )
            named["weights"] = torch.tensor([att.weights[m] for m in att.members], dtype=torch.float64)
        self._publish(call, named, list(att.members))
        return named

    def _publish(self, call: _Call, named: dict[str, torch.Tensor], members: list[str]) -> None:
        digest = tensors_hash(named.items())
        self.book.mark_done(call.round_id, call.key, DoneRecord(digest, members))
        self.server.publish_state(
            PublishedState(result_name(call.round_id, call.key), list(named.items()), digest, members)
        )
        self.server.unpublish_state(result_name(call.round_id - self.settings.keep_results, call.key))

    # -- catching up ------------------------------------------------------------------------------

    async def _catch_up(
        self, call: _Call, hints: dict[str, bytes], why: str
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Fetch the result of this round from peers that completed it, or raise ExchangeError."""
        loop = asyncio.get_running_loop()
        fetch_settings = StateFetchSettings(
            call_timeout=max(self.settings.peer_timeout, 1.0),
            max_message_bytes=self.settings.max_message_bytes,
        )
        while True:
            if not hints:
                hints = await self._ask_done(call)
            if hints:
                counts: dict[bytes, int] = {}
                for h in hints.values():
                    counts[h] = counts.get(h, 0) + 1
                digest = max(counts, key=lambda h: (counts[h], h))
                sources = {o: call.peers[o] for o, h in hints.items() if h == digest}
                try:
                    named, members = await afetch(
                        self.server.identity,
                        sources,
                        result_name(call.round_id, call.key),
                        digest,
                        settings=fetch_settings,
                        ban_list=self.server.ban_list,
                    )
                except StateError as err:
                    why = f"catching up failed: {err}"
                else:
                    self._publish(call, named, members)
                    return named, members
                hints = {}
            if loop.time() + self.settings.catch_up_poll >= call.deadline:
                raise ExchangeError(f"round {call.round_id} {call.key!r} did not complete: {why}")
            await asyncio.sleep(self.settings.catch_up_poll)

    async def _ask_done(self, call: _Call) -> dict[str, bytes]:
        """peer -> result hash, for the peers that say they completed this call."""

        async def hello(node_id: str, address: str) -> tuple[str, bytes]:
            stub = peer_pb2_grpc.PeerStub(self._channel(node_id, address))
            reply = await stub.Hello(
                peer_pb2.HelloRequest(protocol_version=PROTOCOL_VERSION, run_id=self.server.run_id),
                metadata=((VERSION_METADATA_KEY, str(PROTOCOL_VERSION)),),
                timeout=self.settings.peer_timeout,
            )
            for d in reply.done:
                if d.round == call.round_id and d.key == call.key:
                    return node_id, d.result_hash
            return node_id, b""

        others = [
            (n, a)
            for n, a in call.peers.items()
            if n != self.peer_id and not self.server.ban_list.is_banned(n)
        ]
        results = await asyncio.gather(*[hello(n, a) for n, a in others], return_exceptions=True)
        return {r[0]: r[1] for r in results if isinstance(r, tuple) and r[1]}

    # -- plumbing ---------------------------------------------------------------------------------

    def _channel(self, node_id: str, address: str) -> grpc.aio.Channel:
        cached = self._channels.get(node_id)
        if cached is not None and getattr(cached, "_murmur_address", None) == address:
            return cached
        channel = tls.secure_channel(
            self.server.identity,
            address,
            node_id,
            ban_list=self.server.ban_list,
            max_message_bytes=self.settings.max_message_bytes,
        )
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
