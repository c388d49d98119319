"""A grouped round's phase calls meet only the peers their phase names: ``ScopedGroup``.

node/exchange/hierarchy.py wraps the exchange's group provider in one: a phase call ``(round,
key)`` meets only the peers its phase names. A DHT group meets them at that key's rendezvous and
waits for that many; a static group (a fixed cluster, tests) is filtered to them. The quorum of a
scoped call is a strict majority of its scope, not of the run's live trainers.

A scope's rendezvous never waits for a member known dead. A member killed after the round's live
set was read and before it reached its group's rendezvous (or its gather's) leaves no entry there,
and the rendezvous used to wait its whole deadline for it: 60 s a phase in benchmarks/scale.py,
so each round with a kill took 60-80 s where one without took 8. While it waits, a watched
scope dials its missing members (past PROBE_AFTER_S, each at most every PROBE_EVERY_S, as the
run's view does for the run's live trainers: node/exchange/group.py) and stops counting those
whose address refuses a connection (a dead process: the kernel closed its socket). A live member,
hung or slow, accepts the connect and is waited for as before. Only scopes whose members are
known by name are watched (a group as formed, its gather's survivors): a column call's holders
are who each group's reduce-scatter left, which no other group knows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping

from murmur.node.exchange.calls import CONNECTION_REFUSED, process_gone
from murmur.node.exchange.group import PROBE_AFTER_S, PROBE_EVERY_S, PROBES_PER_POLL, REGROUP_WAIT_S
from murmur.protocol.reachability import refuses_connections

__all__ = ["ScopedGroup"]


class ScopedGroup:
    """The wrapped exchange's group provider, scoped per call (see the module's docstring).
    ``addresses``: where the run's live trainers listen, as far as the caller knows (the DHT's
    records, the coordinator's view); the rendezvous of each call adds those it met."""

    def __init__(self, inner, addresses: Callable[[], Mapping[str, str]] | None = None) -> None:
        self.inner = inner
        self.addresses = addresses or dict
        self.scopes: dict[tuple[int, str], frozenset[str]] = {}
        self.sizes: dict[tuple[int, str], int] = {}
        self.watched: set[tuple[int, str]] = set()
        self.met: dict[str, str] = {}  # node id -> the address its last rendezvous entry named
        # (node id, address) whose connect was refused: that process is dead. Read and written
        # from the rendezvous' worker threads and from the loop (the exchange's own refusals).
        self.dead: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def scope(
        self, round_id: int, key: str, members: Collection[str], size: int | None = None, *, watch: bool = False
    ) -> None:
        """Call ``(round, key)`` meets ``members`` only; ``size`` (default: all of them) peers
        are expected there, and its quorum is a strict majority of that. ``watch``: ``members``
        are the very peers expected (not a guess at them), so those known dead are not waited for."""
        self.scopes[(round_id, key)] = frozenset(members)
        self.sizes[(round_id, key)] = len(members) if size is None else size
        if watch:
            self.watched.add((round_id, key))

    def forget(self, round_id: int) -> None:
        for k in [k for k in self.scopes if k[0] <= round_id]:
            del self.scopes[k]
            del self.sizes[k]
            self.watched.discard(k)

    def scope_size(self, round_id: int, key: str) -> int | None:
        return self.sizes.get((round_id, key))

    def saw_refusal(self, node_id: str, address: str, reason: str) -> bool:
        """A member's address refused a connection (the exchange tells its group): not waited for
        at this peer's next scoped rendezvous; and the run's view is told, as before."""
        if process_gone(reason) and address:
            with self._lock:
                self.dead.add((node_id, address))
        saw = getattr(self.inner, "saw_refusal", None)
        return bool(saw(node_id, address, reason)) if saw is not None else False

    async def members(self, round_id: int, key: str, **kw) -> dict[str, str]:
        scope = self.scopes.get((round_id, key))
        if scope is None:
            return await self.inner.members(round_id, key, **kw)
        if getattr(self.inner, "dht", None) is not None:  # a DHTGroup: the key itself scopes it
            size = self.sizes[(round_id, key)]
            if (round_id, key) in self.watched:
                watch = _Watch(self, scope, size)
                kw.update(expected=watch.expected, waiting=watch.waiting)
            else:
                kw.update(expected=size)
            found = await self.inner.members(round_id, key, **kw)
            self.met.update(found)
            return found
        found = await self.inner.members(round_id, key, **kw)
        return {n: a for n, a in found.items() if n in scope}

    async def present(self, round_id: int, key: str) -> dict[str, str]:
        """Who is at ``key``'s rendezvous now, without joining it (a static group: its members)."""
        look = getattr(self.inner, "present", None)
        return await (look(round_id, key) if look is not None else self.members(round_id, key))

    async def current(self, round_id: int, key: str) -> dict[str, str]:
        """A look mid-call (a regroup). A scoped DHT call looks as its rendezvous does, for its
        own scope's count: the run's count, which the inner group's look waits for, is more than
        any group holds, and every regroup waited out its REGROUP_WAIT_S."""
        scoped = (round_id, key) in self.scopes
        if scoped and getattr(self.inner, "dht", None) is not None:
            return await self.members(round_id, key, wait_s=REGROUP_WAIT_S)
        look = getattr(self.inner, "current", None)
        return await (self.members(round_id, key) if look is None or scoped else look(round_id, key))

    def is_dead(self, node_id: str, address: str) -> bool:
        with self._lock:
            return (node_id, address) in self.dead


class _Watch:
    """One scoped rendezvous' count: its size less the missing members known dead (``expected``,
    asked at every poll), and the dials that find them (``waiting``, called at each poll that
    found fewer): both from the rendezvous' worker thread."""

    def __init__(self, scoped: ScopedGroup, scope: frozenset[str], size: int) -> None:
        self.scoped, self.scope, self.size = scoped, scope, size
        # Taken on the loop, once: the worker thread asks nothing of the caller's live view.
        known = {**scoped.addresses(), **scoped.met}
        self.where = {n: known.get(n, "") for n in scope}
        self.since = time.monotonic()
        self.present: frozenset[str] = frozenset()
        self.probed: dict[str, float] = {}

    def _missing(self) -> list[tuple[str, str]]:
        return [(n, self.where[n]) for n in sorted(self.scope - self.present)]

    def expected(self) -> int:
        gone = sum(1 for n, a in self._missing() if a and self.scoped.is_dead(n, a))
        return max(1, self.size - gone)

    def waiting(self, present: dict[str, str]) -> None:
        self.present = frozenset(present)
        now = time.monotonic()
        if now - self.since < PROBE_AFTER_S:
            return  # the live ones mostly arrive within it, and every dial is a connection
        due = [(n, a) for n, a in self._missing()
               if a and not self.scoped.is_dead(n, a) and now - self.probed.get(n, -PROBE_EVERY_S) >= PROBE_EVERY_S]
        for node_id, address in due[:PROBES_PER_POLL]:
            self.probed[node_id] = now
            if refuses_connections(address):
                self.scoped.saw_refusal(node_id, address, f"{CONNECTION_REFUSED} while its group's rendezvous waited")
