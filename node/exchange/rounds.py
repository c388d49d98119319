"""The attempts of one call: who takes part, what each owner answered, retry, or catch up.

An attempt has a fixed member list and succeeds only if every member's whole input reached every
owner and every owner answered OK after its last chunk. Anything else (a peer died, stalled, was
refused, disagreed on the member list) aborts the attempt everywhere; this peer learns who failed
and why from the owners' answers and retries without them, so a dead peer's span is re-owned by
the survivors and a result is never a partial average. An owner that already completed the call
answers ALREADY_DONE: this peer then catches up from it (node/exchange/catchup.py), as it does
when its own input was refused (REFUSED: for what it holds). Left out of an owner's attempt (it
came late, or is not in that owner's list: ABORT naming it) it is not refused: it adopts a result
if one exists, else meets again. An owner naming a member this peer did not meet makes it look at
the rendezvous again, so member lists converge. A call that fails takes this peer's entry out of
the round's rendezvous, so the retry after a re-sync does not meet the failed try's entries.

Client mode (protocol/reachability.py): a member whose address is the client marker owns no span
and takes no gather inputs. It sends its input to the owners, reads the reduced spans back on its
own streams (a gather's result it fetches from an owner), and is never dialed. A round needs at
least one owner: with none, the call meets again until the deadline and fails saying so.

Quorum: a call needs more than ``quorum`` of the run's live trainers when the group knows them (the
coordinator's view: node/exchange/group.py), else of the peers it started with or of the trainers
the DHT lists, whichever is more, so a cut-off minority, a joiner that sees nobody, or the first
peer at a rendezvous before the view is whole can never finish on its own. A member whose address
refuses a connection is dead: the group is told, and it is not met again at a regroup.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch

from murmur.node.exchange.attempt import Attempt, GatherAttempt, ReduceAttempt, RoundBook
from murmur.node.exchange.calls import CONNECTION_REFUSED, ERROR, AttemptProgress, Call, ReduceCall, Reply, process_gone
from murmur.node.exchange.catchup import CatchUp
from murmur.node.exchange.collect import ABORT, DONE, OK, REFUSED
from murmur.node.exchange.group import PROBE_AFTER_S, PROBE_EVERY_S, GroupProvider
from murmur.node.exchange.own import OwnAttempts
from murmur.node.exchange.send import Sender
from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.exchange.stats import Timeline
from murmur.node.exchange.tasks import discard
from murmur.node.exchange.validate import decode_chunk
from murmur.node.net.server import PeerServer
from murmur.optim.exchange import ExchangeError
from murmur.protocol import peer_pb2
from murmur.protocol.reachability import arefuses_connections, dialable
from murmur.protocol.wire import wire_to_proto

log = logging.getLogger(__name__)

FIRST = "other peers completed this round first"


@dataclass(frozen=True, slots=True)
class Dropped:
    """Why a member failed an attempt; ``refused``: an owner refused its input for what it holds."""

    reason: str
    refused: bool = False


@dataclass(slots=True)
class Outcome:
    """How a call's attempts ended: with a result, or with hints and a reason to catch up."""

    named: dict[str, torch.Tensor] | None = None
    members: list[str] = field(default_factory=list)
    hints: dict[str, bytes] = field(default_factory=dict)  # peer -> hash of the result it completed
    why: str = "the round deadline passed"


class Rounds:
    def __init__(
        self,
        *,
        server: PeerServer,
        group: GroupProvider,
        settings: ExchangeSettings,
        book: RoundBook,
        own: OwnAttempts,
        sender: Sender,
        catchup: CatchUp,
        timeline: Timeline,
    ) -> None:
        self.server, self.group, self.settings, self.book = server, group, settings, book
        self.own, self.sender, self.catchup, self.timeline = own, sender, catchup, timeline

    @property
    def peer_id(self) -> str:
        return self.server.node_id

    async def members(self, round_id: int, key: str, timeout: float, regroup: bool = False) -> dict[str, str]:
        """The round's members as the group shows them now (banned peers left out, this one in);
        ``regroup``: a look mid-call, without waiting out the rendezvous (if the group can)."""
        look = getattr(self.group, "current", None) if regroup else None
        peers = await asyncio.wait_for((look or self.group.members)(round_id, key), timeout)
        peers = {n: a for n, a in peers.items() if not self.server.ban_list.is_banned(n)}
        peers[self.peer_id] = self.server.address
        return dict(sorted(peers.items()))

    async def run(self, call: Call) -> tuple[dict[str, torch.Tensor], list[str], bool]:
        """(named result tensors, members, fetched from a peer?) of a call, or ExchangeError."""
        try:
            out = await self._attempts(call)
            if out.named is not None:
                return out.named, out.members, False
            if isinstance(call, ReduceCall) and call.owned:
                # A reduce-scatter's spans stay with their owners: nobody holds this peer's span
                # to hand it over. But the attempt that completed elsewhere may be one this peer
                # owned its span in and reduced to the end, only missing an owner's OK (under
                # load, or a stream cut after its last chunk): then its span is whole here.
                members = await self._owned_span(call, out.hints) if out.hints else None
                if members is not None:
                    return {"0": call.result}, members, False
                raise ExchangeError(
                    f"round {call.round_id} {call.key!r} did not complete here: {out.why} "
                    "(a reduce-scatter cannot be caught up)"
                )
            named, members = await self.catchup.fetch(call, out.hints, out.why)
            return named, members, True
        except ExchangeError:
            await self._leave(call)
            raise
        finally:
            self.book.forget(call.round_id, call.key)

    async def _owned_span(self, call: ReduceCall, hints: dict[str, bytes]) -> list[str] | None:
        """A reduce-scatter completed by others: its members if this peer's own attempt with those
        members reduced its whole span (its result is then written back into ``call.result``),
        else None. The owners of a completed attempt all reduced theirs: nobody answers OK before."""
        members = await self.catchup.done_members(call, hints)
        if members is None:
            return None
        att = next((a for a in self.book.attempts.get((call.round_id, call.key), {}).values()
                    if list(a.members) == members), None)
        if not isinstance(att, ReduceAttempt) or not att.done.is_set() or att.failed:
            return None
        if self.peer_id in att.owners and len(att.results) != len(att.chunks):
            return None
        start = att.span[0]
        for (a, b), payload in zip(att.chunks, att.results, strict=False):
            value = await asyncio.to_thread(decode_chunk, call.codec, payload, b - a, self.own.limits)
            call.result[start + a : start + b] = value
        await self.catchup.publish_owned(call, members)
        log.debug("round %d %r: completed by others in attempt %d, whose span this peer reduced",
                  call.round_id, call.key, att.number)
        return members

    async def _leave(self, call: Call) -> None:
        """The call failed here: take this peer out of the round's rendezvous, so that the retry
        after its re-sync meets only peers that are really there (node/exchange/group.py)."""
        leave = getattr(self.group, "leave", None)
        if leave is None:
            return
        try:
            await asyncio.wait_for(leave(call.round_id, call.key), self.settings.peer_timeout)
        except Exception as err:  # noqa: BLE001 - the entry then expires with its TTL
            log.debug("round %d %r: could not leave the rendezvous: %s", call.round_id, call.key, err)

    async def _attempts(self, call: Call) -> Outcome:
        loop = asyncio.get_running_loop()
        members, excluded, number = sorted(call.peers), dict[str, str](), 0
        why = Outcome().why
        while loop.time() < call.deadline:
            if cannot := self._cannot_start(call, members):
                why = cannot
                if (out := await self._meet_again(call, why)) is not None:
                    return out
                members, excluded = await self._regroup(call, members), {}
                continue
            # A caller already came with a later attempt (it started this one before we did): join it.
            number = max(number, self.book.ahead.get((call.round_id, call.key), -1))
            att = self.own.make(call, number, tuple(members))
            self.timeline.mark("attempt", number=number, members=len(members))
            log.debug("round %d %r: attempt %d with %s", call.round_id, call.key, number, members)
            await self.book.register(att)
            out, failed, seen, at = await self._try(call, att)
            if out is not None:
                ended = "completed" if out.named else out.why
                log.debug("round %d %r: attempt %d: %s", call.round_id, call.key, number, ended)
                return out
            log.debug("round %d %r: attempt %d failed: %s", call.round_id, call.key, number, failed)
            mine = failed.pop(self.peer_id, None)
            if mine is not None and mine.refused:  # for what it holds: this round goes on without it
                call.dropped[self.peer_id] = mine.reason
                return Outcome(why=f"this peer's input was refused: {mine.reason}")
            if mine is not None:
                # Left out for coming late or being unknown to an owner's attempt: as with a lost
                # quorum, adopt a result if someone has one, else meet again. Waiting deaf for a
                # result instead deadlocks a round whose members started far apart: each owner
                # leaves the others out, each gives up, and nobody completes.
                log.debug("round %d %r: left out of attempt %d: %s", call.round_id, call.key, number, mine.reason)
                why = f"this peer was left out: {mine.reason}"
                if (out := await self._meet_again(call, why)) is not None:
                    return out
                members, excluded, number = await self._regroup(call, members), {}, max(number + 1, at)
                continue
            others = {m: f.reason for m, f in failed.items()}
            call.dropped.update(others)
            excluded.update(others)
            self._note_refusals(call, others)
            members = await self._merged(call, members, seen, excluded)
            number = max(number + 1, at)
        return Outcome(why=why)

    def _cannot_start(self, call: Call, members: list[str]) -> str:
        """Why an attempt among ``members`` cannot start (no quorum, or nobody to own the spans),
        or "": then meet again."""
        if not self._quorum(call, members):
            return f"only {len(members)} of {self._quorum_base(call)} live peers here (no quorum)"
        if len(members) < (fewest := self._fewest(call)):
            return f"only {len(members)} of the {fewest} peers this node's start waited for here"
        if not call.owners(members):
            return (
                f"none of the {len(members)} members of round {call.round_id} accepts connections "
                "(all are in client mode): a reachable peer must own the spans"
            )
        return ""

    async def _merged(self, call: Call, members: list[str], seen: set[str], excluded: dict[str, str]) -> list[str]:
        """The next attempt's members: ours and those the owners named, less the excluded. An owner
        may name a peer this one did not meet (it reached the rendezvous after our look): look
        again to learn its address. Leaving it out instead keeps the member lists apart, and every
        attempt ends in a disagreement until someone loses quorum."""
        if seen - set(call.peers) - set(excluded):
            await self._regroup(call, members)
        return sorted((set(members) | (seen & set(call.peers))) - set(excluded))

    async def _meet_again(self, call: Call, why: str) -> Outcome | None:
        """Before a regroup: the outcome that ends the call (someone completed it; the deadline is
        near; ExchangeError when the run is rounds ahead), or None to meet again."""
        hints = await self._wait_for_quorum(call)
        if hints:
            return Outcome(hints=hints, why=FIRST)
        self._give_up_if_behind(call)
        if hints is not None:
            return Outcome(why=why)
        return None

    def _quorum_base(self, call: Call) -> int:
        scoped = getattr(self.group, "scope_size", None)  # a group's call: a majority of the group
        size = scoped(call.round_id, call.key) if scoped is not None else None
        if size:
            return size
        base = getattr(self.group, "quorum_base", None)
        live = base() if base is not None else None
        if live:
            return live
        # No fresh view of the live trainers: the peers this call started with, or the trainers
        # the DHT lists if more. The rendezvous alone is not enough: early in a run, before the
        # coordinator's view is whole, a peer that reached it first saw only itself, completed a
        # round alone, and the others adopted that one-member result (test_poisoning under load).
        announced = getattr(self.group, "announced", None)
        return max(call.start_members, (announced() if announced is not None else None) or 0)

    def _fewest(self, call: Call) -> int:
        """The fewest members the whole run's call may start with: the peers this node's start
        waited for, until they met once (node/exchange/start_floor.py); a group's call: any."""
        scoped = getattr(self.group, "scope_size", None)
        if scoped is not None and scoped(call.round_id, call.key):
            return 1
        fewest = getattr(self.group, "fewest", None)
        return fewest() if fewest is not None else 1

    def _quorum(self, call: Call, members: list[str]) -> bool:
        return len(members) > self._quorum_base(call) * self.settings.quorum

    def _give_up_if_behind(self, call: Call) -> None:
        """Live trainers completed this round and nobody here can hand us its result: waiting
        for quorum until the deadline is hopeless (they are in later rounds' groups)."""
        behind = getattr(self.group, "behind", None)
        at = behind(call.round_id) if behind is not None else None
        if at is not None:
            raise ExchangeError(
                f"round {call.round_id} {call.key!r}: the run's live trainers are at round {at} already "
                "and none of this round's peers has its result; re-sync from them"
            )

    def _note_refusals(self, call: Call, failed: dict[str, str]) -> None:
        saw = getattr(self.group, "saw_refusal", None)
        if saw is not None:
            for member, why in failed.items():
                if member in call.peers:
                    saw(member, call.peers[member], why)

    async def _wait_for_quorum(self, call: Call) -> dict[str, bytes] | None:
        """Without quorum, do not just sit in catch-up until the deadline: that waits for someone
        else to complete, and when every peer lost quorum (e.g. a peer killed mid-round left a
        rendezvous entry at its old address, then came back under the same node id at a new one)
        nobody ever does: each waits, deaf to the others' new attempts, until the round deadline,
        and the retried round meets the same stale attempts again. So: adopt a result if someone
        has one (the hints), give up ({}) if the deadline is near, else (None) meet again after a
        poll (fresh rendezvous, fresh addresses, nobody excluded) and retry."""
        hints = await self.catchup.ask_done(call)
        if hints:
            return hints
        if asyncio.get_running_loop().time() + self.settings.catch_up_poll >= call.deadline:
            return {}
        await asyncio.sleep(self.settings.catch_up_poll)
        return None

    async def _regroup(self, call: Call, members: list[str]) -> list[str]:
        """The round's members as the group shows them now (``members`` if it cannot tell).

        A peer that was killed and restarted under the same node id is back at a new address:
        ``call.peers`` takes the new one, so the next attempt dials the live incarnation."""
        try:
            peers = await self.members(
                call.round_id, call.key, max(call.deadline - asyncio.get_running_loop().time(), 0.001), regroup=True
            )
        except Exception:  # noqa: BLE001 - a failed rendezvous read: keep what we have, retry later
            return members
        call.peers.update(peers)
        return sorted(peers)

    async def _try(
        self, call: Call, att: Attempt
    ) -> tuple[Outcome | None, dict[str, Dropped], set[str], int]:
        """One attempt: (its outcome if it ended the call, else who failed, the members the
        owners know of, the attempt number they are at)."""
        replies = await self._attempt(call, att)
        hints = {o: r.result_hash for o, r in replies.items() if r.code == DONE}
        if hints:
            return Outcome(hints=hints, why=FIRST), {}, set(), att.number
        call.received += att.bytes_received  # the inputs this peer took in as an owner
        if att.done.is_set() and not att.failed and all(r.code == OK for r in replies.values()):
            if isinstance(att, ReduceAttempt):  # as an owner it sent its span to every other member
                call.sent += att.result_bytes * (len(att.members) - 1)
            if isinstance(att, GatherAttempt) and self.peer_id not in att.owners:
                # A client-mode peer took no inputs: every owner has them all, so it fetches the
                # gathered payloads from one (node/exchange/catchup.py) once one has completed.
                return Outcome(why="a client-mode peer takes a gather's result from its owners"), {}, set(), att.number
            self.timeline.mark("complete")
            named = await self._complete(call, att)
            return Outcome(named=named, members=list(att.members)), {}, set(), att.number
        failed, seen, at = self._failures(call, att, replies)
        att.close()
        return None, failed, seen, at

    def _failures(
        self, call: Call, att: Attempt, replies: dict[str, Reply]
    ) -> tuple[dict[str, Dropped], set[str], int]:
        """(member -> why it failed this attempt, the members the owners know of, the attempt
        number they are at). This peer's own entry is ``refused`` only when an owner refused its
        input for what it holds (REFUSED); an owner's ABORT naming it means it came late, stalled
        or is not in that owner's list: it may still take part in a later attempt."""
        me, failed, seen, at = self.peer_id, dict[str, Dropped](), set(), att.number
        for o, r in replies.items():
            if r.code == ERROR:
                failed[o] = Dropped(r.reason)
            elif r.code == REFUSED:
                failed[me] = Dropped(f"{o} refused it: {r.reason}", refused=True)
            elif r.code == ABORT:
                for k, v in r.failed.items():
                    if k in call.peers and not (k == me and me in failed):
                        failed[k] = Dropped(f"{o} left it out: {v}" if k == me else v)
                seen |= set(r.members)
                at = max(at, r.attempt)
        seen |= att.heard  # callers that named peers this attempt lacks
        at = max(at, self.book.ahead.get((call.round_id, call.key), -1))  # callers already past it
        if att.done.is_set():
            failed.update({k: Dropped(v) for k, v in att.failed.items() if k in call.peers and k not in failed})
        else:
            # We leave before our own inputs settled: say so to whoever still sends to us, without
            # blaming members that may simply not have reached us yet.
            att.disagree("the owner left this attempt early")
        return {k: v for k, v in failed.items() if k in call.peers}, seen, at

    async def _attempt(self, call: Call, att: Attempt) -> dict[str, Reply]:
        """Send our input to every other owner and collect their answers, all bounded in time."""
        loop, s = asyncio.get_running_loop(), self.settings
        call.faults.before_input()
        others = [m for m in att.owners if m != self.peer_id]
        progress = AttemptProgress(len(others))
        tasks = {o: loop.create_task(self.sender.call_owner(call, att, o, progress)) for o in others}
        probes: list[asyncio.Task] = []
        for o, t in tasks.items():
            t.add_done_callback(lambda t, o=o: self._probe_if_failed(call, att, o, t, probes))
        expire = loop.call_later(s.peer_timeout, att.expire, s.peer_timeout)
        own = loop.create_task(att.done.wait())
        watch = loop.create_task(_watch_missing(att, call.peers, self.peer_id)) if self.peer_id in att.owners else None
        try:
            await self._collect(call, tasks, own, progress)
        finally:
            expire.cancel()
            for p in (*probes, watch):
                discard(p)
            for t in (own, *tasks.values()):
                t.cancel()
            await asyncio.gather(own, *tasks.values(), return_exceptions=True)  # retrieved: none is lost
        none = Reply(ERROR, reason=f"no answer within {s.peer_timeout:g}s (stalled or gone)")
        return {o: none if t.cancelled() else t.result() for o, t in tasks.items()}

    @staticmethod
    def _probe_if_failed(call: Call, att: Attempt, owner: str, task: asyncio.Task, probes: list) -> None:
        """Our call to ``owner`` failed before its input was all in here: if its process is gone,
        that input never comes. Survivors of a member killed after the rendezvous used to wait
        for it until ``peer_timeout`` (8 s a round in the testnet's chaos runs)."""
        if task.cancelled() or task.exception() is not None or att.done.is_set():
            return
        reply = task.result()
        if reply.code == ERROR and not att.complete(owner):
            probes.append(asyncio.ensure_future(
                _fail_if_gone(att, owner, call.peers.get(owner, ""), f"its call: {reply.reason}")))

    async def _collect(
        self, call: Call, tasks: dict[str, asyncio.Task], own: asyncio.Task, progress: AttemptProgress
    ) -> None:
        """Wait for the owners' answers until every one is in, the attempt is settled, or the
        owners are silent too long."""
        loop, s = asyncio.get_running_loop(), self.settings
        pending: set[asyncio.Future] = {*tasks.values(), own}
        own_done_at: float | None = None
        while pending:
            wait = call.deadline - loop.time()
            if own.done():
                # Our own inputs are settled (all in, or expired), so every other owner's are too
                # within one peer_timeout of skew; an owner silent past that (and past any transfer
                # still making progress) is stalled or gone.
                own_done_at = own_done_at or loop.time()
                wait = min(wait, max(own_done_at, progress.last) + 2 * s.peer_timeout - loop.time())
            if wait <= 0:
                return
            done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if (not done and own_done_at is not None) or self._settled(tasks, own, progress):
                return

    @staticmethod
    def _settled(tasks: dict[str, asyncio.Task], own: asyncio.Task, progress: AttemptProgress) -> bool:
        finished = [t.result() for t in tasks.values() if t.done()]
        if any(r.code == DONE for r in finished):
            return True  # someone completed the round: catch up from it, nothing else matters
        if len(finished) < len(tasks) or all(r.code == OK for r in finished):
            return False
        # Every owner has our whole input, and what failed was only our side of some answers (a
        # result chunk lost or cut off): the others may still complete this attempt, and they need
        # our span. Keep owning it until every input is in and reduced, or the attempt fails here
        # (a member gone or silent is failed within peer_timeout); then retry without those
        # owners and catch up from them.
        local = all(
            t.result().code == OK or (t.result().code == ERROR and o in progress.delivered)
            for o, t in tasks.items()
        )
        return own.done() or not local  # doomed, and every other member has told us why

    async def _complete(self, call: Call, att: Attempt) -> dict[str, torch.Tensor]:
        named = {"0": call.result} if isinstance(call, ReduceCall) else self._gathered(att)
        if isinstance(call, ReduceCall) and call.owned:  # each member holds its own span only
            await self.catchup.publish_owned(call, list(att.members))
            return named
        await self.catchup.publish(call, named, list(att.members))
        self.timeline.mark("hashed")
        return named

    @staticmethod
    def _gathered(att: Attempt) -> dict[str, torch.Tensor]:
        """A completed gather as named tensors: each member's payload as bytes, and the weights."""
        assert isinstance(att, GatherAttempt)
        named = {}
        for m in att.members:
            raw = peer_pb2.Payload(tensors=[wire_to_proto(w) for w in att.inputs[m]]).SerializeToString()
            named[f"m/{m}"] = (
                torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
            )
        named["weights"] = torch.tensor([att.weights[m] for m in att.members], dtype=torch.float64)
        return named


async def _fail_if_gone(att: Attempt, member: str, address: str, reason: str) -> None:
    """Fail ``member`` in this owner's attempt when its process is known dead: the failed call
    said its address refused us, or a fresh TCP connect to it is refused now (a connection that
    broke mid-stream, reset by a killed process, says neither by itself)."""
    if process_gone(reason) or (address and await arefuses_connections(address)):
        att.reject(member, f"{CONNECTION_REFUSED} at its address, the process is gone ({reason})")


async def _watch_missing(att: Attempt, peers: dict[str, str], me: str) -> None:
    """While this owner waits for inputs: dial each member whose input is not all in, past
    PROBE_AFTER_S and then every PROBE_EVERY_S, and fail those whose address refuses. A member
    can die with no call of ours to it failing and no stream of it breaking here: it answered our
    call for its span, then died before its stream to us opened (its header waited behind a busy
    thread pool, say). Owners used to wait for that input until ``peer_timeout`` (8 s in the
    testnet). A live member, hung or not, accepts the connect and is left to the timeout."""
    await asyncio.sleep(PROBE_AFTER_S)
    while not att.done.is_set():
        missing = {m: a for m, a in dialable(peers).items()
                   if m != me and m in att.members and m not in att.failed and not att.complete(m)}
        await asyncio.gather(*(_fail_if_gone(att, m, a, f"its input was not in after {PROBE_AFTER_S:g}s")
                               for m, a in missing.items()))
        await asyncio.sleep(PROBE_EVERY_S)
