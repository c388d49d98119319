"""`GrpcExchange`: optim's `Exchange` between nodes, over gRPC streams with mutual TLS.

All-reduce (dense codecs): the update is flattened; the sorted member list cuts it into one span
per member, and each span into pipeline chunks (node/exchange/settings.py). Each peer streams
span i, chunk by chunk, to member i (node/exchange/send.py); member i checks and decodes every
chunk as it arrives, and as soon as it holds every member's chunk j it aggregates it (the run's
rule: mean, trimmed mean, CenteredClip), re-encodes it once and streams it back to everyone while
later chunks are still arriving (node/exchange/attempt.py, node/exchange/collect.py). Codec work
runs in worker threads, off the event loop. Each peer sends about (N-1)/N of its payload and
(N-1)/N of the result: the butterfly's 2(N-1)/N.
Reduce-scatter (``areduce_scatter``, a grouped round's phase A, node/exchange/hierarchy.py): the
same streams with the spans cut on S column boundaries (each owner a contiguous block of columns);
the owner keeps its reduced span and answers OK with no chunk back, so a peer sends (N-1)/N. A
peer that did not complete it cannot catch it up (nobody holds its span): unless the completed
attempt is one whose span it reduced to the end itself, the call fails there.
Sparse codecs (top-k) and all-gather: every peer streams its payload to every other member;
a sparse all-reduce then aggregates every payload locally, in sorted order.

Rounds, attempts and failures. A call is one round (round_id, key). It runs in attempts: an
attempt has a fixed member list and succeeds only if every member's whole input reached every
owner and every owner answered OK after its last chunk. Anything else (a peer died, stalled, was
refused, disagreed on the member list) aborts the attempt everywhere; the callers learn who
failed and why from the owners' answers and retry without them, so a dead peer's span is
re-owned by the survivors and a result is never a partial average (chunks of an aborted attempt
are overwritten by the attempt that completes). With a ``gate`` (the run's arbiter: the
coordinator), a completed call's result is claimed for its group before anything is applied or
served: a group the run refuses (a split) ends the call with ExchangeError. A peer that completed a round answers later
attempts with ALREADY_DONE and publishes the result; a peer whose round did not complete catches
up from the peers that did (node/exchange/catchup.py). A round needs more than ``quorum`` of the
peers it started with, so a cut-off minority can never finish on its own. Every wait is bounded
by ``peer_timeout`` (per peer) and ``round_deadline`` (per call).

The parts, each with what it needs: node/exchange/rounds.py (the attempts of a call), own.py (this
peer's side as an owner), send.py and send_reduce.py (its streams to the owners), collect.py (the
owners' side), catchup.py (publish and fetch results), channels.py (its gRPC channels).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from google.protobuf.message import DecodeError

from murmur.node.exchange.attempt import Rejection, RoundBook
from murmur.node.exchange.calls import Call, GatherCall, ReduceCall
from murmur.node.exchange.catchup import CatchUp
from murmur.node.exchange.channels import Channels
from murmur.node.exchange.collect import ServeSettings, serve_exchange
from murmur.node.exchange.group import GroupProvider, RoundGate
from murmur.node.exchange.own import OwnAttempts
from murmur.node.exchange.rounds import Rounds
from murmur.node.exchange.send import Sender
from murmur.node.exchange.send_reduce import StreamEnv
from murmur.node.exchange.settings import ExchangeSettings, ExchangeSettingsError, alignment, spans
from murmur.node.exchange.snapshot import Snapshot
from murmur.node.exchange.stats import PhaseTimes, Timeline
from murmur.node.exchange.validate import InputRejected, validate_gather
from murmur.node.net.faults import CallFaults, FaultInjector
from murmur.node.net.server import PeerServer
from murmur.optim.aggregate import Aggregator
from murmur.optim.codecs import Codec
from murmur.optim.exchange import Exchange, ExchangeError, GatherResult, ReduceResult
from murmur.optim.reduce import reduce_payloads
from murmur.optim.wire import WireTensor
from murmur.protocol import peer_pb2
from murmur.protocol.wire import WireError, WireLimits, layout_hash, wire_to_proto

# The loop time by which the grouped round a call is a phase of must end (node/exchange/hierarchy.py
# sets it for its phases' tasks): each phase call's own deadline is cut to it. A grouped round is
# bounded by one ``round_deadline`` in all, as an ungrouped call is: the node waits that long for
# its round (round_timeout_s), and phases that each took a deadline of their own outlived that
# wait, still running (and answering ALREADY_DONE) when the node retried the round.
ROUND_END: ContextVar[float | None] = ContextVar("murmur_round_end", default=None)

__all__ = ["ExchangeSettings", "ExchangeSettingsError", "GrpcExchange", "LoopHandle", "Scattered", "spans"]

T = TypeVar("T")
MAX_REJECTIONS_KEPT = 1000  # untaken rejection records beyond this drop the oldest


@dataclass(frozen=True, slots=True)
class Scattered:
    """A reduce-scatter's outcome at one peer: the result (valid on ``span`` only), the owners
    of its completed attempt in span order, and this peer's span ((0, 0): it owns none)."""

    result: ReduceResult
    owners: tuple[str, ...]
    span: tuple[int, int]


class LoopHandle(Protocol):
    """What the exchange needs of the loop its networking runs on (node/net/loop.py's LoopThread,
    or the daemon's handle on its own loop): run a coroutine there from the training thread."""

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]: ...

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T: ...


class GrpcExchange(Exchange):
    def __init__(
        self,
        server: PeerServer,
        loop: LoopHandle,
        group: GroupProvider,
        codec: Codec,
        *,
        aggregator: Aggregator | None = None,
        settings: ExchangeSettings | None = None,
        faults: FaultInjector | None = None,
        gate: RoundGate | None = None,
    ) -> None:
        self.server = server
        self.loop = loop  # where the calls of the training thread run (submit, run)
        self.codec = codec  # the codec of calls that start from now on (a benchmark switches it)
        self.settings = settings or ExchangeSettings()
        self.faults = faults or FaultInjector()
        self.book = RoundBook()
        self.times = PhaseTimes()  # worker-thread CPU seconds by phase (node/exchange/stats.py)
        self.timeline = Timeline()  # wall-clock events by chunk, off unless enabled (diagnosis)
        self.caught_up: list[tuple[int, str]] = []  # calls whose result came from peers (observability)
        # Inputs this peer refused as an owner for what they hold, with who sent them, until the
        # daemon takes them (`take_rejections`) to report them to the coordinator.
        self.rejections: deque[Rejection] = deque(maxlen=MAX_REJECTIONS_KEPT)
        self.limits = WireLimits(max_numel=self.settings.max_payload_bytes)
        self.aggregator = aggregator or Aggregator(rule="mean", filter=False)
        self.channels = Channels(server.identity, server.ban_list, self.settings)
        env = StreamEnv(self.settings, self.limits, self.times, self.timeline)
        self.rounds = Rounds(
            server=server,
            group=group,
            settings=self.settings,
            book=self.book,
            own=OwnAttempts(
                peer_id=server.node_id,
                aggregator=self.aggregator,
                limits=self.limits,
                times=self.times,
                timeline=self.timeline,
                on_rejected=self._record_rejection,
            ),
            sender=Sender(peer_id=server.node_id, run_id=server.run_id, channels=self.channels, env=env),
            catchup=CatchUp(server, self.book, self.channels, self.settings, gate),
            timeline=self.timeline,
        )
        serve = ServeSettings(
            peer_timeout=self.settings.peer_timeout,
            round_deadline=self.settings.round_deadline,
            max_payload_bytes=self.settings.max_payload_bytes,
            run_id=server.run_id,
            node_id=server.node_id,
            times=self.times,
            timeline=self.timeline,
        )
        server.exchange_handler = lambda peer, ctx: serve_exchange(
            self.book, serve, peer, ctx, lambda: self.codec, self.limits
        )
        server.hello_rounds = self.done_list
        server.on_refusal = self._drop_everywhere

    # -- the Exchange interface (called from the training thread) ----------------------------------

    @property
    def peer_id(self) -> str:
        return self.server.node_id

    @property
    def group(self) -> GroupProvider:
        return self.rounds.group

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, round_id: int, key: str = "", weight: float = 1.0
    ) -> Future[ReduceResult]:
        return self.loop.submit(self.areduce(list(tensors), round_id=round_id, key=key, weight=weight))

    def all_gather(self, wire: Sequence[WireTensor], *, round_id: int, key: str = "") -> Future[GatherResult]:
        return self.loop.submit(self.agather(list(wire), round_id=round_id, key=key))

    def close(self) -> None:
        self.loop.run(self.aclose())

    async def aclose(self) -> None:
        await self.channels.aclose()

    # -- who sent what this peer refused ----------------------------------------------------------

    def _record_rejection(self, round_id: int, sender: str, reason: str) -> None:
        self.rejections.append(Rejection(round_id, sender, reason))

    def take_rejections(self) -> list[Rejection]:
        """The rejections recorded since the last call, oldest first (call it on the loop)."""
        out = list(self.rejections)
        self.rejections.clear()
        return out

    # -- the two collectives ----------------------------------------------------------------------

    async def areduce(
        self, tensors: list[torch.Tensor], *, round_id: int, key: str = "", weight: float = 1.0
    ) -> ReduceResult:
        res, _ = await self._reduce(tensors, round_id, key, weight)
        return res

    async def areduce_scatter(
        self, tensors: list[torch.Tensor], *, round_id: int, key: str, columns: int, weight: float = 1.0
    ) -> Scattered:
        """A reduce-scatter of a dense update cut into ``columns`` columns: each owner of the
        completed attempt reduces a contiguous block of them (settings.column_block) and keeps it;
        nothing comes back to the members. The flat result is valid on this peer's own span only
        (``Scattered.span``). A peer that did not complete the call fails it (ExchangeError):
        nobody else holds its span."""
        if not self.codec.dense or columns < 1:
            raise ExchangeError(f"round {round_id} {key!r}: a reduce-scatter needs a dense codec and columns >= 1")
        res, call = await self._reduce(tensors, round_id, key, weight, columns)
        owners = call.owners(res.members)
        span = call.span_of(owners, self.peer_id) if self.peer_id in owners else (0, 0)
        return Scattered(res, owners, span)

    async def _reduce(
        self, tensors: list[torch.Tensor], round_id: int, key: str, weight: float, columns: int = 0
    ) -> tuple[ReduceResult, ReduceCall | None]:
        self._check_weight(weight)
        self.timeline.mark("call", round=round_id)
        codec, faults = self.codec, self.faults.call_faults(self.peer_id, round_id)
        if not codec.dense:  # codec.encode adds (and keeps) the key's error feedback itself
            flat = await asyncio.to_thread(_flatten, tensors)  # one fp32 copy: the caller may go on
            return await self._sparse_reduce(tensors, flat, round_id, key, weight, codec, faults), None
        align = alignment(self.settings.span_align, codec)
        chunk = self.settings.chunk_elements(align)
        # One flat fp32 copy of the update (plus the key's error feedback), made chunk by chunk in a
        # worker thread from now on: the chunks that go first are copied first (snapshot.py).
        residual = codec.residuals.get(key) if codec.error_feedback else None
        if residual is not None and codec.ef_decay != 1.0:  # as Codec.encode does in the simulator
            residual = residual * codec.ef_decay
        snap = Snapshot(tensors, residual, chunk, faults)
        snap.start()
        try:
            scatter = f"|columns={columns}" if columns else ""  # a reduce-scatter meets no all-reduce
            layout = layout_hash(
                codec.name, [(t.shape, t.dtype) for t in tensors], f"reduce|align={align}|chunk={chunk}{scatter}"
            )
            x = snap.flat
            call = ReduceCall(
                **await self._call_basics(round_id, key, weight, layout, codec, faults),
                x=x,
                snapshot=snap,
                # Page-locked like the snapshot when the update is on a GPU: the caller's copy of
                # the result back to the device is then a DMA it need not wait for.
                result=torch.empty(x.numel(), pin_memory=x.is_pinned()),
                own=torch.empty(x.numel()) if codec.error_feedback else None,
                align=align,
                chunk=chunk,
                columns=columns,
            )
            named, members, fetched = await self._run(call)
            result = named.get("0")
            if result is None or result.dtype != torch.float32 or tuple(result.shape) != (call.numel,):
                raise ExchangeError(f"round {round_id} {key!r}: the fetched result does not fit this update")
            if call.own is not None and not fetched:
                await snap.wait()  # every chunk went out, so every piece is in; to be sure
                codec.residuals[key] = x.sub_(call.own)  # x is ours: the residual reuses its memory
        finally:
            snap.cancel()
        out = _unflatten(result, tensors)
        return ReduceResult(out, members, dict(call.dropped), call.sent, call.received, codec.name), call

    async def agather(
        self,
        wires: list[WireTensor],
        *,
        round_id: int,
        key: str = "",
        weight: float = 1.0,
        template: list[WireTensor] | None = None,
    ) -> GatherResult:
        """An all-gather of ``wires``. ``template``: the layout every member's input fits, each
        tensor of it or empty (a member's unused slot), instead of exactly ours."""
        res, _ = await self._gather(wires, round_id, key, weight, self.codec, None, template)
        return res

    async def _gather(
        self,
        wires: list[WireTensor],
        round_id: int,
        key: str,
        weight: float,
        codec: Codec,
        faults: CallFaults | None,
        template: list[WireTensor] | None = None,
    ) -> tuple[GatherResult, dict[str, float]]:
        self._check_weight(weight)
        faults = faults or self.faults.call_faults(self.peer_id, round_id)
        parts = [
            (w.codec, tuple(w.shape), w.dtype, sorted((n, str(t.dtype), tuple(t.shape)) for n, t in w.parts.items()))
            for w in (wires if template is None else template)
        ]
        layout = layout_hash("gather" if template is None else "gather|ragged", [], repr(parts))
        sent = faults.gather_wires(wires)
        payload = peer_pb2.Payload(tensors=[wire_to_proto(w) for w in sent]).SerializeToString()
        call = GatherCall(
            **await self._call_basics(round_id, key, weight, layout, codec, faults),
            wires=sent,
            payload=faults.gather_payload(payload),
            template=template,
        )
        named, members, _ = await self._run(call)
        updates = self._gathered_updates(call, call.expected if template is not None else wires, named, members)
        res = GatherResult(updates, dict(call.dropped), call.sent, call.received, codec.name)
        return res, {m: float(w) for m, w in zip(members, named["weights"].tolist(), strict=True)}

    def _gathered_updates(
        self, call: GatherCall, wires: list[WireTensor], named: dict[str, torch.Tensor], members: list[str]
    ) -> dict[str, list[WireTensor]]:
        """Each member's input from a gather's result (ours, or fetched: checked again)."""
        where = f"round {call.round_id} {call.key!r}"
        weights = named.get("weights")
        if weights is None or weights.numel() != len(members):
            raise ExchangeError(f"{where}: the gathered result has no weights")
        check = validate_gather(wires, call.codec, self.limits, ragged=call.template is not None)
        updates: dict[str, list[WireTensor]] = {}
        for m in members:
            raw = named.get(f"m/{m}")
            if raw is None:
                raise ExchangeError(f"{where}: the gathered result misses {m}")
            try:
                updates[m] = check(m, peer_pb2.Payload.FromString(raw.numpy().tobytes()))
            except (WireError, InputRejected, DecodeError) as err:
                raise ExchangeError(f"{where}: the gathered input of {m} is invalid: {err}") from None
        return updates

    async def _sparse_reduce(
        self, tensors, x, round_id: int, key: str, weight: float, codec: Codec, faults: CallFaults
    ) -> ReduceResult:
        # A poisoning fault strikes the gathered wire (its float parts), as for any gather.
        wire = await asyncio.to_thread(codec.encode, x, key)
        res, weights = await self._gather([wire], round_id, key, weight, codec, faults)
        agg, members, dropped, _ = await asyncio.to_thread(
            reduce_payloads, codec, self.aggregator, res.updates, weights, key
        )
        out = _unflatten(agg[0].reshape(-1), tensors)
        dropped = {**res.dropped, **dropped}
        return ReduceResult(out, members, dropped, res.bytes_sent, res.bytes_received, codec.name)

    @staticmethod
    def _check_weight(weight: float) -> None:
        if not math.isfinite(weight) or weight < 0:
            raise ExchangeError(f"weight must be a finite non-negative number, got {weight}")

    async def _call_basics(
        self, round_id: int, key: str, weight: float, layout: bytes, codec: Codec, faults: CallFaults
    ) -> dict:
        """The fields every call has: its members met at the rendezvous, its deadline, its faults."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.round_deadline
        end = ROUND_END.get()
        if end is not None:
            deadline = min(deadline, end)
        await faults.delay("rendezvous")
        try:
            peers = await self.rounds.members(round_id, key, max(deadline - loop.time(), 0.001))
        except Exception as err:  # noqa: BLE001 - rendezvous failures end the call with one line
            raise ExchangeError(f"round {round_id} {key!r}: rendezvous failed: {err}") from None
        if faults.stalls:  # a machine that hangs: it still sends, but never answers
            self.book.stalled.set()
        return dict(
            round_id=round_id,
            key=key,
            weight=weight,
            layout=layout,
            peers=peers,
            start_members=len(peers),
            deadline=deadline,
            codec=codec,
            faults=faults,
        )

    async def _run(self, call: Call) -> tuple[dict[str, torch.Tensor], list[str], bool]:
        named, members, fetched = await self.rounds.run(call)
        if fetched:
            self.caught_up.append((call.round_id, call.key))
        return named, members, fetched

    # -- what the peer server asks of the exchange -------------------------------------------------

    def done_list(self) -> list[peer_pb2.RoundDone]:
        """The calls this peer completed (``Hello`` lists them for peers catching up)."""
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
    """One flat fp32 CPU copy. From a GPU every transfer is queued first and waited for once: a
    wait per tensor would wait each time for the steps the training thread queued meanwhile."""
    flat = torch.empty(sum(t.numel() for t in tensors), pin_memory=any(t.is_cuda for t in tensors))
    pos = 0
    for t in tensors:  # from the CPU, non_blocking changes nothing: the copy is done on return
        flat[pos : pos + t.numel()].copy_(t.detach().reshape(-1), non_blocking=True)
        pos += t.numel()
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
    return flat


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, pos = [], 0
    for t in like:
        out.append(flat[pos : pos + t.numel()].reshape(t.shape))
        pos += t.numel()
    return out
