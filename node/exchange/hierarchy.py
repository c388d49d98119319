"""One result for the whole run from bounded groups: the hierarchical (2-D) all-reduce.

``GroupedExchange`` wraps a peer's ``GrpcExchange``. A round of at most G live trainers is one
call of the wrapped exchange under the round's own key, as before. A larger round, in the groups
of node/exchange/groups.py (M groups, the smallest of S members), is three phases, each an
ordinary call of the wrapped exchange (its attempts, retries, deadlines, catch-up and fault
points) among a bounded set of peers under a key of its own:

A. group all-reduce: the group's members all-reduce their updates (weights as given); every
   survivor of the group holds the group's mean, and the group's members (those whose input made
   it in) are known to all of them alike. A member that dies here costs its own input only: the
   wrapped exchange retries without it.
B. column all-reduce: the update is cut into S columns (spans on the codec's alignment). Column c
   of each group's mean is carried by one survivor of that group (``groups.holders``) to the
   column call ``<key>/c<c>of<M>``, M peers one from each group, weighted by the group's member
   count: they end with column c of the run's mean, bit-identical (each decodes the bytes the
   column's owners sent).
C. group all-gather: each survivor encodes the columns it carried (``encode_stateless``: no error
   feedback, the same bytes in every group, for the codecs are deterministic) and the group
   gathers them; everyone decodes every column from those bytes. Every group's holder of column
   c encoded the same values, so every trainer of the run ends with the same result, bit for bit.

A peer's connections: G-1 in A and C, M-1 in B; never N. Its bytes: 2(G-1)/G of the update in A,
2(M-1)/M of one column (1/S of it) in B, (G-1)/G in C; see docs/protocol.md ("Groups") for the
figures and the limits. Failures: a phase that fails in one group (its key lost, too many of its
members dead, a holder that died after A) fails that group's round only: its peers raise
ExchangeError and re-sync as after any failed round; the other groups complete. A group whose
phase A cannot meet (the rendezvous failed, no quorum) falls back to halves of itself
(``groups.split``) once, under keys of their own, before giving up.

The run's arbiter (a node's ``RoundGate``: the coordinator's ClaimRound) is asked once a round,
for the assembled result and the whole round's members (``round_members``), never for a phase:
each group is a minority of the run, and its claim would be refused as a split.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future

import torch

from murmur.node.exchange.groups import Formation, form_groups, holders, split
from murmur.node.exchange.grpc_exchange import GrpcExchange
from murmur.node.exchange.settings import alignment, spans
from murmur.optim.exchange import Exchange, ExchangeError, GatherResult, ReduceResult
from murmur.optim.wire import WireTensor

__all__ = ["GroupedExchange", "ScopedGroup"]


class ScopedGroup:
    """The wrapped exchange's group provider, scoped per call: a phase call ``(round, key)`` meets
    only the peers its phase names. A DHT group meets them at that key's rendezvous and waits for
    that many; a static group (a fixed cluster, tests) is filtered to them. The quorum of a scoped
    call is a strict majority of its scope, not of the run's live trainers."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.scopes: dict[tuple[int, str], frozenset[str]] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def scope(self, round_id: int, key: str, members: Collection[str]) -> None:
        self.scopes[(round_id, key)] = frozenset(members)

    def forget(self, round_id: int) -> None:
        for k in [k for k in self.scopes if k[0] <= round_id]:
            del self.scopes[k]

    def scope_size(self, round_id: int, key: str) -> int | None:
        s = self.scopes.get((round_id, key))
        return len(s) if s is not None else None

    async def members(self, round_id: int, key: str, **kw) -> dict[str, str]:
        scope = self.scopes.get((round_id, key))
        if scope is None:
            return await self.inner.members(round_id, key, **kw)
        if getattr(self.inner, "dht", None) is not None:  # a DHTGroup: the key itself scopes it
            return await self.inner.members(round_id, key, expected=len(scope), **kw)
        found = await self.inner.members(round_id, key, **kw)
        return {n: a for n, a in found.items() if n in scope}

    async def current(self, round_id: int, key: str) -> dict[str, str]:
        look = getattr(self.inner, "current", None)
        static = (round_id, key) in self.scopes and getattr(self.inner, "dht", None) is None
        return await (self.members(round_id, key) if look is None or static else look(round_id, key))


class GroupedExchange(Exchange):
    def __init__(
        self,
        inner: GrpcExchange,
        *,
        run_id: str,
        live: Callable[[], Collection[str]],
        group_size: int,
    ) -> None:
        self.inner = inner
        self.run_id = run_id
        self.live = live  # the run's live trainers, as every peer sees them (node ids)
        self.group_size = group_size
        self.scoped = ScopedGroup(inner.rounds.group)
        inner.rounds.group = self.scoped
        # The run's arbiter (the coordinator's ClaimRound) judges the round, not its phases: a
        # group is a minority of the run by design, and its claim would be refused as a split.
        # The phase calls go ungated; the assembled result is claimed for the whole round.
        self.gate = inner.rounds.catchup.gate
        inner.rounds.catchup.gate = _PhaseGate(self.gate, self.scoped) if self.gate is not None else None
        self.last: Formation | None = None  # the last round's formation (observability, tests)
        self.last_group: list[str] = []  # the last grouped round's group survivors (phase A's members)
        self.on_formation: Callable[[int, Formation], None] | None = None  # each grouped round's

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, round_id: int, key: str = "", weight: float = 1.0
    ) -> Future[ReduceResult]:
        return self.inner.loop.submit(self.areduce(list(tensors), round_id=round_id, key=key, weight=weight))

    def all_gather(self, wire: Sequence[WireTensor], *, round_id: int, key: str = "") -> Future[GatherResult]:
        return self.inner.all_gather(wire, round_id=round_id, key=key)  # gathers are not grouped

    def close(self) -> None:
        self.inner.close()

    async def areduce(
        self, tensors: list[torch.Tensor], *, round_id: int, key: str = "", weight: float = 1.0
    ) -> ReduceResult:
        me, codec = self.peer_id, self.inner.codec
        formation = form_groups(self.run_id, round_id, key, {*self.live(), me}, self.group_size)
        self.last = formation
        if self.on_formation is not None and not formation.single:
            self.on_formation(round_id, formation)
        if formation.single or not codec.dense:  # sparse codecs gather from everyone: not grouped
            return await self.inner.areduce(tensors, round_id=round_id, key=key, weight=weight)
        self.scoped.forget(round_id - 2)
        a, gkey = await self._group_phase(tensors, round_id, key, formation, weight)
        survivors = sorted(a.members)
        self.last_group = survivors
        mean = torch.cat([t.reshape(-1) for t in a.tensors])
        s = formation.columns
        ranges = spans(mean.numel(), s, alignment(self.inner.settings.span_align, codec))
        width = max(end - start for start, end in ranges)
        carried = holders(survivors, s)
        mine = [c for c, h in carried.items() if h == me]
        cols = await asyncio.gather(*(
            self._column(round_id, formation, c, mean[ranges[c][0] : ranges[c][1]], len(survivors)) for c in mine
        ))
        # C: every survivor sends the same number of equal-width slots (zeros where it holds no
        # column), so the gather's layout is the same for all; k survivors carry S columns in
        # ceil(S / k) slots each.
        wires = []
        for i in range(-(-s // len(survivors))):
            piece = torch.zeros(width)
            if i < len(cols):
                values = cols[i].tensors[0].reshape(-1)
                piece[: values.numel()] = values
            wires.append(await asyncio.to_thread(codec.encode_stateless, piece))
        self.scoped.scope(round_id, f"{gkey}/gather", survivors)
        gathered = await self.inner.agather(wires, round_id=round_id, key=f"{gkey}/gather")
        out = torch.empty_like(mean)
        for c, holder in carried.items():
            got = gathered.updates.get(holder)
            if got is None:
                raise ExchangeError(
                    f"round {round_id} {key!r}: the gather of {gkey} lacks {holder}, holder of column {c}"
                )
            start, end = ranges[c]
            piece = await asyncio.to_thread(codec.decode, got[c // len(survivors)])
            out[start:end] = piece.reshape(-1)[: end - start]
        result, pos = [], 0
        for t in tensors:
            result.append(out[pos : pos + t.numel()].reshape(t.shape))
            pos += t.numel()
        dropped = {**a.dropped, **{k: v for r in cols for k, v in r.dropped.items()}, **gathered.dropped}
        sent = a.bytes_sent + sum(r.bytes_sent for r in cols) + gathered.bytes_sent
        received = a.bytes_received + sum(r.bytes_received for r in cols) + gathered.bytes_received
        # The groups whose means made it in: those whose holders met ours in the column calls
        # (a peer that carried no column knows only the formation).
        called = [r for c, r in zip(mine, cols, strict=True) if ranges[c][1] > ranges[c][0]]
        met = {formation.group_of(h) for r in called for h in r.members} if called else None
        members = round_members(formation, formation.group_of(me), survivors, met)
        if self.gate is not None:  # ExchangeError if the run refuses it: nothing is applied
            await self.gate.claim(round_id, key, members)
        return ReduceResult(result, members, dropped, sent, received, codec.name)

    async def _group_phase(
        self, tensors: list[torch.Tensor], round_id: int, key: str, formation: Formation, weight: float
    ) -> tuple[ReduceResult, str]:
        """A: the group's all-reduce; (its result, the key it ran under). A group that cannot meet
        (its rendezvous failed, or too few of it came for a quorum) splits once into halves."""
        g = formation.group_of(self.peer_id)
        sub, members = formation.group_key(g), formation.groups[g]
        try:
            return await self._phase_call(tensors, round_id, key, sub, members, weight), sub
        except ExchangeError as err:
            if len(members) < 4 or not any(w in str(err) for w in FALLBACK_ON):
                raise
        sub, members = next((k, m) for k, m in split(members, sub) if self.peer_id in m)
        return await self._phase_call(tensors, round_id, key, sub, members, weight), sub

    async def _phase_call(
        self, tensors: list[torch.Tensor], round_id: int, key: str, sub: str, members: Sequence[str], weight: float
    ) -> ReduceResult:
        """One group call under ``sub``, with the error feedback of ``key`` (the round's own key: a
        group's key changes from round to round, the residual must not)."""
        codec = self.inner.codec
        self.scoped.scope(round_id, sub, members)
        moved = codec.residuals.pop(key, None)
        if moved is not None:
            codec.residuals[sub] = moved
        try:
            return await self.inner.areduce(tensors, round_id=round_id, key=sub, weight=weight)
        finally:
            back = codec.residuals.pop(sub, None)
            if back is not None:
                codec.residuals[key] = back

    async def _column(
        self, round_id: int, formation: Formation, c: int, values: torch.Tensor, weight: int
    ) -> ReduceResult:
        """B: column c of this group's mean, reduced with the other groups' holders of column c,
        weighted by this group's member count."""
        if values.numel() == 0:  # an update shorter than S spans: nothing to reduce, alike everywhere
            return ReduceResult([values.clone()], [self.peer_id])
        key = formation.column_key(c)
        s, g = formation.columns, formation.group_of(self.peer_id)
        expected = {holders(grp, s)[c] for h, grp in enumerate(formation.groups) if h != g}
        self.scoped.scope(round_id, key, {*expected, self.peer_id})
        try:
            return await self.inner.areduce([values.clone()], round_id=round_id, key=key, weight=float(weight))
        finally:
            self.inner.codec.residuals.pop(key, None)  # the group's mean carries no error feedback of ours


def round_members(
    formation: Formation, g: int, survivors: Sequence[str], met: Collection[int] | None = None
) -> list[str]:
    """The whole round's members as one peer of group ``g`` knows them: its own group's survivors
    (phase A told it exactly) and the other groups (those in ``met`` when given: the groups its
    column calls met) as formed: their drops are theirs, this peer holds their means, weighted by
    their survivors, not their member lists. What the round is claimed for and committed with: a
    group alone is a minority of the run by design."""
    others = (m for h, grp in enumerate(formation.groups) if h != g and (met is None or h in met) for m in grp)
    return sorted({*survivors, *others})


class _PhaseGate:
    """The wrapped exchange's gate during grouped rounds: a phase call (a scoped key) completes
    without a claim, the round's own claim comes once its result is assembled; any other call (a
    round of one group, a gather) is claimed as before."""

    def __init__(self, gate, scoped: ScopedGroup) -> None:
        self.gate, self.scoped = gate, scoped

    async def claim(self, round_id: int, key: str, members: list[str]) -> None:
        if self.scoped.scope_size(round_id, key) is None:
            await self.gate.claim(round_id, key, members)


# Phase A failures that a smaller group may get past: the key's rendezvous failed (lost, overloaded
# DHT), or too few of the group met for its quorum. A dead member is not one: the call itself
# retries without it.
FALLBACK_ON = ("rendezvous failed", "no quorum")
