"""One result for the whole run from bounded groups: the hierarchical (2-D) all-reduce.

``GroupedExchange`` wraps a peer's ``GrpcExchange``. A round of at most G live trainers is one
call of the wrapped exchange under the round's own key, as before. A larger round, in the groups
of node/exchange/groups.py (M groups of at most G; the update cut into S = G columns), is three
phases, each an ordinary call of the wrapped exchange (its attempts, retries, deadlines and fault
points) among a bounded set of peers under a key of its own:

A. group reduce-scatter (``GrpcExchange.areduce_scatter``): each member sends each owner of the
   group's completed attempt its input to that owner's block of columns; the owner reduces it
   (weights as given) and keeps it, and nothing comes back. The attempt's owners are known to all
   its members alike, and so is who holds which column (``groups.holders``: contiguous blocks). A
   member that dies here costs its own input only: the wrapped exchange retries without it.
B. column all-reduce: column c of each group's mean is carried by its holder in that group to the
   column call ``<key>/c<c>of<M>``, M peers one from each group, weighted by the group's member
   count: they end with column c of the run's mean, bit-identical (each decodes the bytes the
   column's owners sent).
C. group all-gather: each holder encodes the columns it carried (``encode_stateless``: no error
   feedback, the same bytes in every group, for the codecs are deterministic) and the group
   gathers them (a ragged gather: owners of fewer columns send empty slots); everyone decodes
   every column from those bytes. Every group's holder of column c encoded the same values, so
   every trainer of the run ends with the same result, bit for bit.

A peer's connections: G-1 in A and C, M-1 per column it holds in B; never N. Its bytes: about
(G-1)/G of the update in A, 2(M-1)/M of its columns in B, (G-1)/G in C: in all the butterfly's
2(N-1)/N when N is a multiple of G (docs/protocol.md, "Groups", for the figures and the limits).

Failures stay in the group. A holder missing from its group's gather (dead after A, or too slow)
is replaced: its group-mates fetch its columns' results from the other groups' holders of them
(they hold the same bytes; ``_repair``). A peer whose phase fails (left out of its group's
reduce-scatter, which cannot be caught up since nobody holds its span; a column call that failed
here) catches the round up instead: every peer that completed a grouped round serves its result
under the round's own key, and the failed one fetches it, hash-checked, from its group-mates
(``_catch_up``), its input dropped; one result, never two. A group whose phase A cannot meet (the
rendezvous failed, no quorum) does not fall back to halves of itself: a half's quorum is a
quarter of the group's, and the halves of a minority's formation (peers whose view of the live
set was short, in another M) could complete a second result that way. Only
when nobody of its group completed does a peer raise ExchangeError (and re-sync, as after any
failed round).

One ``round_deadline`` bounds the whole round, its phases and its catch-up (``ROUND_END``), as it
bounds an ungrouped call: a node waits that long for its round. A round that failed here forgets
its phase calls (``_undo_phases``): the node's retry of the same round, from the same state under
the same keys, must not be answered ALREADY_DONE by a phase of the failed try.

The run's arbiter (a node's ``RoundGate``: the coordinator's ClaimRound) is asked once a round,
for the assembled result and the whole round's members (``round_members``), never for a phase:
each group is a minority of the run, and its claim would be refused as a split.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from murmur.node.exchange.groups import Formation, GroupFormationError, form_groups, holders
from murmur.node.exchange.grpc_exchange import ROUND_END, GrpcExchange, Scattered
from murmur.node.exchange.scope import ScopedGroup
from murmur.node.exchange.settings import alignment, spans
from murmur.node.net.state_transfer import result_name
from murmur.optim.exchange import Exchange, ExchangeError, GatherResult, ReduceResult
from murmur.optim.wire import WireTensor

__all__ = ["GroupedExchange", "ScopedGroup"]

log = logging.getLogger(__name__)


class GroupedExchange(Exchange):
    def __init__(
        self,
        inner: GrpcExchange,
        *,
        run_id: str,
        live: Callable[[], Collection[str]],
        group_size: int,
        addresses: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        self.inner = inner
        self.run_id = run_id
        self.live = live  # the run's live trainers, as every peer sees them (node ids)
        self.group_size = group_size
        # Where they listen (as far as this peer knows): a group's rendezvous dials the members
        # it still waits for, and stops waiting for those whose address refuses (scope.py).
        self.scoped = ScopedGroup(inner.rounds.group, addresses)
        inner.rounds.group = self.scoped
        # The run's arbiter (the coordinator's ClaimRound) judges the round, not its phases: a
        # group is a minority of the run by design, and its claim would be refused as a split.
        # The phase calls go ungated; the assembled result is claimed for the whole round.
        self.gate = inner.rounds.catchup.gate
        inner.rounds.catchup.gate = _PhaseGate(self.gate, self.scoped) if self.gate is not None else None
        self.last: Formation | None = None  # the last round's formation (observability, tests)
        self.last_group: list[str] = []  # the last grouped round's group survivors (phase A's members)
        self.repaired: list[tuple[int, int]] = []  # (round, column) taken from other groups (observability)
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
        self.last_group = []
        # One deadline for the whole round, its phases and its catch-up (ROUND_END: each phase
        # call's own deadline is cut to it), as for an ungrouped call.
        end = asyncio.get_running_loop().time() + self.inner.settings.round_deadline
        look = _Look(round_id, key, {}, end)
        catchup = self.inner.rounds.catchup
        token = ROUND_END.set(end)
        try:
            try:
                out, members, dropped, sent, received = await self._grouped(tensors, round_id, key, formation, weight)
            except ExchangeError as err:
                # Left out of its group's reduce-scatter, or a phase that failed here: the round may
                # have completed at its group-mates all the same. Their result is the run's (one
                # hash): take it (hash-checked), this peer's input dropped, rather than fail the round.
                named, members = await self._catch_up(look, formation, err, sum(t.numel() for t in tensors))
                out, dropped, sent, received = named["0"], {me: f"caught the round up: {err}"}, 0, 0
            else:
                # Claimed for the whole round (ExchangeError if the run refuses it: nothing is
                # applied), then served to group-mates that catch the round up.
                await catchup.publish(look, {"0": out}, members)
        except ExchangeError:
            await self._undo_phases(round_id)  # the round failed here: the node's retry starts clean
            raise
        finally:
            ROUND_END.reset(token)
        result, pos = [], 0
        for t in tensors:
            result.append(out[pos : pos + t.numel()].reshape(t.shape))
            pos += t.numel()
        return ReduceResult(result, members, dropped, sent, received, codec.name)

    async def _grouped(
        self, tensors: list[torch.Tensor], round_id: int, key: str, formation: Formation, weight: float
    ) -> tuple[torch.Tensor, list[str], dict[str, str], int, int]:
        """Phases A, B and C: (the flat result, the round's members, dropped, bytes sent, received)."""
        me, codec = self.peer_id, self.inner.codec
        s = formation.columns
        a, gkey = await self._group_phase(tensors, round_id, key, formation, weight)
        survivors = sorted(a.result.members)
        self.last_group = survivors
        mean = torch.cat([t.reshape(-1) for t in a.result.tensors])  # valid on our own span only
        ranges = spans(mean.numel(), s, alignment(self.inner.settings.span_align, codec))
        width = max(end - start for start, end in ranges)
        owners = list(a.owners)
        carried = holders(owners, s)
        mine = [c for c, h in carried.items() if h == me]
        cols = await asyncio.gather(*(
            self._column(round_id, formation, c, mean[ranges[c][0] : ranges[c][1]], len(survivors)) for c in mine
        ))
        # C: every member sends ceil(S / k) slots of one column's width, its block's columns in
        # order and empty slots after them (a ragged gather: owners hold blocks of different
        # sizes, members that own nothing send only empty slots), so nothing is padded.
        slots = -(-s // len(owners))
        template = [await asyncio.to_thread(_slot_wire, codec, torch.zeros(0), width)] * slots
        wires = [await asyncio.to_thread(_slot_wire, codec, r.tensors[0].reshape(-1), width) for r in cols]
        wires += [await asyncio.to_thread(codec.encode_stateless, torch.zeros(0))] * (slots - len(wires))
        self.scoped.scope(round_id, f"{gkey}/gather", survivors, watch=True)
        await self.inner.faults.delay("group_gather", me, round_id)
        gathered = await self.inner.agather(wires, round_id=round_id, key=f"{gkey}/gather", template=template)
        out = torch.empty_like(mean)
        repaired: list[int] = []
        first = {h: min(c for c, x in carried.items() if x == h) for h in set(carried.values())}
        for c, holder in carried.items():
            start, end = ranges[c]
            got = gathered.updates.get(holder)
            if got is None and holder == me:  # a gather this peer caught up lacks its own input
                got = wires
            wire = got[c - first[holder]] if got is not None else None
            if wire is None or tuple(wire.shape) != (width,):
                # Its holder died (or is too slow) after phase A: the column's result is the same
                # bytes at every other group's holder of it (phase B): fetch it from them.
                wire = await self._repair(round_id, formation, c, width)
                repaired.append(c)
            piece = await asyncio.to_thread(codec.decode, wire)
            out[start:end] = piece.reshape(-1)[: end - start]
        self.repaired.extend((round_id, c) for c in repaired)
        if repaired:
            log.info("round %d %r: columns %s of %s came from the other groups (their holder missed the gather)",
                     round_id, key, repaired, gkey)
        # Left out of the result: inputs dropped in A, and groups whose holder a column call
        # dropped in B. A holder missing from C is not: its columns were taken from elsewhere.
        dropped = {**a.result.dropped, **{k: v for r in cols for k, v in r.dropped.items()}}
        sent = a.result.bytes_sent + sum(r.bytes_sent for r in cols) + gathered.bytes_sent
        received = a.result.bytes_received + sum(r.bytes_received for r in cols) + gathered.bytes_received
        # The groups whose means made it in: those whose holders met ours in the column calls
        # (a peer that carried no column knows only the formation).
        # A holder met that this peer's view of the live set lacks (a trainer it has not heard of
        # yet: groups are met by rendezvous, not by view) is a member all the same: left out, a
        # claim from a view one trainer short named a minority and the run refused it.
        called = [r for c, r in zip(mine, cols, strict=True) if ranges[c][1] > ranges[c][0]]
        seen = {h for r in called for h in r.members}
        met = {_group_or_none(formation, h) for h in seen} - {None} if called else None
        unknown = {h for h in seen if _group_or_none(formation, h) is None}
        members = sorted({*round_members(formation, formation.group_of(me), survivors, met), *unknown})
        return out, members, dropped, sent, received

    async def _undo_phases(self, round_id: int) -> None:
        """The round failed here: the node re-syncs and may run the same round again, from the
        same state, under the same keys. The phase calls this peer completed must not answer that
        retry ALREADY_DONE (a reduce-scatter cannot be caught up, and a column's old result is
        the mean of the failed try's inputs), nor its rendezvous entries fill the retry's
        rendezvous before the others are back: forget them, serve them no more, leave them."""
        book, server = self.inner.book, self.inner.server
        keys = {k for r, k in self.scoped.scopes if r == round_id}
        for rk in [rk for rk in book.done if rk[0] == round_id and rk[1] in keys]:
            del book.done[rk]
            server.unpublish_state(result_name(*rk))
        leave = getattr(self.scoped.inner, "leave", None)
        if leave is None:
            return
        for k in sorted(keys):
            try:
                await asyncio.wait_for(leave(round_id, k), self.inner.settings.peer_timeout)
            except Exception as err:  # noqa: BLE001 - the entry then expires with its TTL
                log.debug("round %d %r: could not leave the rendezvous: %s", round_id, k, err)

    async def _catch_up(
        self, look: _Look, formation: Formation, err: ExchangeError, numel: int
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The round's result from group-mates that completed it (they serve it under the round's
        own key), looked for at the rendezvous of this peer's group until the round's deadline;
        ExchangeError with ``err``'s reason if none serves it."""
        g = formation.group_of(self.peer_id)
        keys = [formation.group_key(g)]
        loop, settings = asyncio.get_running_loop(), self.inner.settings
        catchup = self.inner.rounds.catchup
        while True:
            for k in keys:
                try:
                    found = await asyncio.wait_for(self.scoped.present(look.round_id, k), settings.peer_timeout)
                    look.peers.update(found)
                except Exception as e:  # noqa: BLE001 - a failed look: try again at the next poll
                    log.debug("round %d %r: could not look at %s: %s", look.round_id, look.key, k, e)
            hints = await catchup.ask_done(look) if look.peers else {}
            if hints:
                named, members = await catchup.fetch(look, hints, str(err))
                got = named.get("0")
                if got is None or got.dtype != torch.float32 or got.numel() != numel:
                    raise ExchangeError(f"round {look.round_id} {look.key!r}: the fetched result does not fit")
                log.info("round %d %r: caught up from its group after: %s", look.round_id, look.key, err)
                return named, members
            if loop.time() + settings.catch_up_poll >= look.deadline:
                raise err
            await asyncio.sleep(settings.catch_up_poll)

    async def _group_phase(
        self, tensors: list[torch.Tensor], round_id: int, key: str, formation: Formation, weight: float
    ) -> tuple[Scattered, str]:
        """A: the group's reduce-scatter; (its outcome, the key it ran under). A group that cannot
        meet does not fall back to halves of itself: a half's quorum is a quarter of the group,
        and halves of a minority's formation (a view of the live set short of peers) could then
        complete a round of their own, a second result. Its peers catch the round up instead."""
        g = formation.group_of(self.peer_id)
        sub, members = formation.group_key(g), formation.groups[g]
        return await self._phase_call(tensors, round_id, key, sub, members, weight, formation.columns), sub

    async def _phase_call(
        self,
        tensors: list[torch.Tensor],
        round_id: int,
        key: str,
        sub: str,
        members: Sequence[str],
        weight: float,
        columns: int,
    ) -> Scattered:
        """One group's reduce-scatter under ``sub``, with the error feedback of ``key`` (the round's
        own key: a group's key changes from round to round, the residual must not)."""
        codec = self.inner.codec
        self.scoped.scope(round_id, sub, members, watch=True)
        moved = codec.residuals.pop(key, None)
        if moved is not None:
            codec.residuals[sub] = moved
        try:
            return await self.inner.areduce_scatter(tensors, round_id=round_id, key=sub, columns=columns, weight=weight)
        finally:
            back = codec.residuals.pop(sub, None)
            if back is not None:
                codec.residuals[key] = back

    def _scope_column(self, round_id: int, formation: Formation, c: int) -> str:
        """Column c's call: one holder from each group, so M peers (the quorum's base, the DHT
        rendezvous' count: its key scopes it). A static group (tests, a fixed cluster) is filtered
        to the holders each group would have with every member alive, and this peer."""
        key = formation.column_key(c)
        s, g = formation.columns, formation.group_of(self.peer_id)
        expected = {holders(grp, s)[c] for h, grp in enumerate(formation.groups) if h != g}
        self.scoped.scope(round_id, key, {*expected, self.peer_id})
        return key

    async def _column(
        self, round_id: int, formation: Formation, c: int, values: torch.Tensor, weight: int
    ) -> ReduceResult:
        """B: column c of this group's mean, reduced with the other groups' holders of column c,
        weighted by this group's member count."""
        if values.numel() == 0:  # an update shorter than S spans: nothing to reduce, alike everywhere
            return ReduceResult([values.clone()], [self.peer_id])
        key = self._scope_column(round_id, formation, c)
        try:
            return await self.inner.areduce([values.clone()], round_id=round_id, key=key, weight=float(weight))
        finally:
            self.inner.codec.residuals.pop(key, None)  # the group's mean carries no error feedback of ours

    async def _repair(self, round_id: int, formation: Formation, c: int, width: int) -> WireTensor:
        """Column c's slot as its holder would have sent it in C, from column c's result (phase B)
        fetched from the other groups' holders of it: the same bytes everywhere, so the same
        decoded values (node/exchange/catchup.py checks the hash). ExchangeError when no holder
        serves it before the round deadline (the column call failed everywhere)."""
        key = self._scope_column(round_id, formation, c)
        loop = asyncio.get_running_loop()
        settings = self.inner.settings
        end = ROUND_END.get()
        look = _Look(round_id, key, {}, min(loop.time() + settings.round_deadline, end or float("inf")))
        catchup = self.inner.rounds.catchup
        while True:
            try:
                look.peers.update(await asyncio.wait_for(self.scoped.present(round_id, key), settings.peer_timeout))
            except Exception as err:  # noqa: BLE001 - a failed look: try again at the next poll
                log.debug("round %d %r: could not look up column %d's holders: %s", round_id, key, c, err)
            hints = await catchup.ask_done(look) if look.peers else {}
            if hints:
                named, _ = await catchup.fetch(look, hints, "")
                values = named.get("0")
                if values is None or values.dtype != torch.float32 or values.numel() > width:
                    raise ExchangeError(f"round {round_id} {key!r}: the fetched column does not fit this update")
                return await asyncio.to_thread(_slot_wire, self.inner.codec, values.reshape(-1), width)
            if loop.time() + settings.catch_up_poll >= look.deadline:
                raise ExchangeError(
                    f"round {round_id} {key!r}: column {c}'s holder in this group is gone and no other "
                    "group's holder serves its result"
                )
            await asyncio.sleep(settings.catch_up_poll)


@dataclass(slots=True)
class _Look:
    """What node/exchange/catchup.py needs of a call to publish or fetch its result: a column call
    this peer did not take part in, or a grouped round under its own key (no call of its own)."""

    round_id: int
    key: str
    peers: dict[str, str]
    deadline: float


def _group_or_none(formation: Formation, node_id: str) -> int | None:
    """A column call's member's group in this peer's formation (None: not in its view)."""
    try:
        return formation.group_of(node_id)
    except GroupFormationError:
        return None


def _slot_wire(codec, values: torch.Tensor, width: int) -> WireTensor:
    """A column's values as one slot of the group's gather: zero-padded to ``width``, encoded
    without error feedback (deterministic: every holder of a column sends the same bytes)."""
    piece = torch.zeros(width)
    piece[: values.numel()] = values
    return codec.encode_stateless(piece)


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

