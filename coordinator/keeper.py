"""The coordinator keeps the run's newest verified state, so the run's model outlives its volunteers.

Data parallel: the global state the live trainers agree on (the newest round, the hash most of
them announce: protocol/state_vote.py), pulled over the peer protocol's GetState as a joiner
pulls it, as raw bytes (the coordinator holds no torch: protocol/state_client.py) and checked
against that hash. Pipelined: every stage's published state (``stage/<s>``) from a live peer
serving it, each checked against the hash it is served under; a version is kept only when every
stage came. Either is written beside the ledger (coordinator/kept_state.py), ``keep.versions``
versions at most.

The cost is bounded: a pull at most every ``keep.every_s`` per run, and only when the run moved
past the kept round; one more when the last holder of a state newer than the kept one leaves
(``keep.leave_pull_s``, before its leave is answered: its peer server is still up then); and one
when a node's lease ends (its shard finished, or released: a run's last shards end so), at most
once every ``keep.lease_pull_every_s``, off the call that ended it.

A pipelined run's version is its step as the ledger has it (the drivers commit every microbatch
with the run step it lands at, node/pipeline/schedule.py), not a stage peer's own count of
optimizer steps: that starts at 0 in every new process, so after the stage peers restarted, the
run would not have been kept again until they had counted past the old number.

A node that joins a run no live trainer serves restores from the kept state: the coordinator
serves it with the same GetState at its node address (coordinator/kept_server.py), named
``kept/<run id>/<state name>``, and heartbeat replies say which round it holds; a stage peer that
no live stage-mate serves restores its stage from the kept set, which GetStages names
(node/pipeline/kept_stage.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol import identity
from murmur.protocol.reachability import is_client
from murmur.protocol.runconfig import ConfigError, KeepSection, parse_config
from murmur.protocol.state_client import RawState, RawStateError, fetch_raw
from murmur.protocol.state_vote import agreed_state

from . import kept_state
from .kept_state import KeptVersion
from .membership import Membership
from .settings import TLS_SERVER_NAME
from .stage_board import StageBoard
from .store import Store

KEPT_PREFIX = "kept/"
LOOK_EVERY_S = 1.0  # how often the keeper looks whether a run is due (a pull is due every keep.every_s)


def kept_name(run_id: str, name: str) -> str:
    """The GetState name the coordinator serves a kept state under."""
    return f"{KEPT_PREFIX}{run_id}/{name}"


def stage_states(run_id: str, k: KeptVersion) -> list[pb.StageState]:
    """A kept stage set as GetStages names it: each stage's GetState name and its hash."""
    return [pb.StageState(stage=stage, name=kept_name(run_id, st.name), state_hash=st.state_hash.hex())
            for stage, st in zip(k.stages or [], k.states, strict=True)]


@dataclass(slots=True)
class KeepStats:
    pulls: int = 0
    failures: int = 0
    bytes_pulled: int = 0
    seconds: float = 0.0  # spent pulling and writing, in all
    last_error: str = ""
    by_run: dict[str, float] = field(default_factory=dict)  # run -> when its last pull ended


class StateKeeper:
    def __init__(
        self,
        db: Path,
        store: Store,
        membership: Membership,
        stages: StageBoard,
        log: Callable[[str], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db, self.store, self.membership, self.stages = db, store, membership, stages
        self.log, self.clock = log, clock
        key = identity.generate_key()
        # A reader's certificate of the run's CA: peers serve GetState to any unbanned one.
        cert = membership.ca.sign_csr(identity.make_csr(key))
        self.identity = identity.Identity(key=key, cert_pem=cert, ca_cert_pem=membership.ca.cert_pem)
        self.node_address = ""  # set by the server once bound: where nodes fetch kept states
        self.stats = KeepStats()
        self._kept: dict[str, KeptVersion | None] = {}
        self._settings: dict[str, KeepSection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._lease_pulls: set[asyncio.Task] = set()  # pulls at a lease's end, under way
        self._lease_pull_at: dict[str, float] = {}  # run -> when its last pull at a lease's end began
        self._lease_due: set[str] = set()  # runs with a pull at a lease's end waiting for its turn
        self._info: dict[str, tuple[KeptVersion, str, pb.KeptState]] = {}  # kept_info's, per kept version

    # --- what is kept ----------------------------------------------------------------------------

    def settings_of(self, run_id: str) -> KeepSection:
        if run_id not in self._settings:
            run = self.store.run(run_id)
            try:
                self._settings[run_id] = parse_config(run["config_toml"], run_id).keep if run else KeepSection()
            except ConfigError:
                self._settings[run_id] = KeepSection(every_s=0.0)
        return self._settings[run_id]

    def kept(self, run_id: str) -> KeptVersion | None:
        """The newest kept version of the run (read from disk, checked, at the first ask)."""
        if run_id not in self._kept:
            self._kept[run_id] = kept_state.newest(self.db, run_id, log=self.log)
        return self._kept[run_id]

    def kept_round(self, run_id: str) -> int:
        k = self.kept(run_id)
        return k.round if k is not None else -1

    def kept_info(self, run_id: str) -> pb.KeptState | None:
        """What heartbeat replies say of the run's kept state: built once per kept version (every
        reply carries it, 10,000 a second at 10,000 nodes), so the caller copies it, never changes it."""
        k = self.kept(run_id)
        if k is None or not self.node_address:
            return None
        cached = self._info.get(run_id)
        if cached is not None and cached[0] is k and cached[1] == self.node_address:
            return cached[2]
        digest = k.states[0].state_hash.hex() if k.kind == "global" and k.states else ""
        info = pb.KeptState(round=k.round, state_hash=digest, address=self.node_address,
                            server_name=TLS_SERVER_NAME, kept_at=k.kept_at)
        if k.kind == "stages":
            info.stages.extend(stage_states(run_id, k))
        self._info[run_id] = (k, self.node_address, info)
        return info

    def served(self, name: str) -> RawState | None:
        """A kept state by its GetState name (``kept/<run>/<name>``, ``.../state/newest`` included)."""
        if not name.startswith(KEPT_PREFIX):
            return None
        run_id, _, inner = name[len(KEPT_PREFIX):].partition("/")
        k = self.kept(run_id) if run_id else None
        if k is None:
            return None
        if inner == "state/newest" and k.kind == "global":
            return k.states[0]
        return k.state(inner)

    # --- pulling ---------------------------------------------------------------------------------

    async def run(self, stopped: asyncio.Event) -> None:
        """Pull each active run's newest state when it is due, until ``stopped``."""
        for run_id in list(self.membership.run_states):  # read (and check) what is kept, off the loop
            if run_id not in self._kept:
                self._kept[run_id] = await asyncio.to_thread(kept_state.newest, self.db, run_id, self.log)
        while not stopped.is_set():
            try:
                await asyncio.wait_for(stopped.wait(), LOOK_EVERY_S)
                return
            except TimeoutError:
                pass
            for run_id, state in list(self.membership.run_states.items()):
                every = self.settings_of(run_id).every_s
                if state != "active" or every <= 0:
                    continue
                if self.clock() - self.stats.by_run.get(run_id, 0.0) < every:
                    continue
                try:
                    await self.pull(run_id, "interval")
                except Exception as err:  # noqa: BLE001 - the keeper must not stop the coordinator
                    self.log(f"warning: keeping run {run_id}'s state failed: {err!r}")

    async def pull_at_leave(self, run_id: str, node_id: str) -> None:
        """A node is leaving: if it holds a state newer than the kept one, pull it first (bounded)."""
        keep = self.settings_of(run_id)
        if keep.every_s <= 0 or keep.leave_pull_s <= 0:
            return
        if self.stages.pipeline(run_id) is not None:
            if any(p.node_id == node_id for p in self.stages.stage_map(run_id).peers):
                await self._bounded(self.pull(run_id, "leave"), keep.leave_pull_s, run_id)
            return
        t = dict(self.membership.live_trainers(run_id)).get(node_id)
        if t is None or t.round <= self.kept_round(run_id) or not t.state_hash:
            return
        await self._bounded(self.pull(run_id, "leave", only=node_id), keep.leave_pull_s, run_id)

    def lease_ended(self, run_id: str) -> None:
        """A node's lease of the run ended (its shard finished, or it released it): pull the run's
        newest state if it is newer than the kept one, off the caller's call, but not within
        ``keep.lease_pull_every_s`` of the run's previous pull (a run of many small shards ends a
        lease every few seconds): then the pull waits until that much has passed, and one pending
        pull stands for every lease that ends meanwhile. Dropped instead, the pull of a run's last
        lease (its newest state) was lost whenever the run's end came right after a pull."""
        keep = self.settings_of(run_id)
        if keep.every_s <= 0 or keep.lease_pull_every_s <= 0 or run_id in self._lease_due:
            return
        last = max(self.stats.by_run.get(run_id, 0.0), self._lease_pull_at.get(run_id, 0.0))
        wait = max(0.0, last + keep.lease_pull_every_s - self.clock())
        self._lease_due.add(run_id)
        task = asyncio.get_running_loop().create_task(self._pull_at_lease_end(run_id, wait))
        self._lease_pulls.add(task)
        task.add_done_callback(self._lease_pulls.discard)

    async def _pull_at_lease_end(self, run_id: str, wait: float) -> None:
        try:
            await asyncio.sleep(wait)
        finally:
            self._lease_due.discard(run_id)  # a lease that ends from here on asks for another pull
        self._lease_pull_at[run_id] = self.clock()
        await self._pull_logged(run_id, "lease_end")

    async def _pull_logged(self, run_id: str, reason: str) -> None:
        try:
            await self.pull(run_id, reason)
        except Exception as err:  # noqa: BLE001 - the keeper must not stop the coordinator
            self.log(f"warning: keeping run {run_id}'s state ({reason}) failed: {err!r}")

    async def aclose(self) -> None:
        """Cancel the pulls at lease ends still under way (the coordinator stops)."""
        for task in list(self._lease_pulls):
            task.cancel()
        await asyncio.gather(*self._lease_pulls, return_exceptions=True)

    async def _bounded(self, coro, seconds: float, run_id: str) -> None:
        try:
            await asyncio.wait_for(coro, seconds)
        except TimeoutError:
            self.log(f"keeping run {run_id}'s state at a leave took more than {seconds:g}s; left it")

    async def pull(self, run_id: str, reason: str, only: str | None = None) -> KeptVersion | None:
        """Pull and keep the run's newest state if it is newer than the kept one; the new version, or None."""
        lock = self._locks.setdefault(run_id, asyncio.Lock())
        async with lock:
            started = self.clock()
            try:
                if self.stages.pipeline(run_id) is not None:
                    version = await self._pull_stages(run_id)
                else:
                    version = await self._pull_global(run_id, only)
            except (RawStateError, OSError) as err:
                self.stats.failures += 1
                self.stats.last_error = str(err)[:300]
                self.stats.by_run[run_id] = self.clock()  # tried: the next try is an interval later
                self.log(f"could not keep run {run_id}'s state ({reason}): {err}")
                return None
            if version is None:  # nothing newer than the kept round: looked at again in a second
                return None
            self.stats.by_run[run_id] = self.clock()
            keep = self.settings_of(run_id)
            path = await asyncio.to_thread(kept_state.write, self.db, version, keep.versions)
            seconds = self.clock() - started
            self._kept[run_id] = version
            self.stats.pulls += 1
            self.stats.bytes_pulled += version.nbytes
            self.stats.seconds += seconds
            with self.store.write():
                self.store.event(
                    "state_kept", run_id=run_id, round=version.round, reason=reason, bytes=version.nbytes,
                    seconds=round(seconds, 3), file=path.name,
                    state_hash=version.states[0].state_hash.hex() if version.kind == "global" else "",
                )
            return version

    async def _pull_global(self, run_id: str, only: str | None) -> KeptVersion | None:
        holders = [
            (n, t) for n, t in self.membership.live_trainers(run_id)
            if t.round > 0 and t.state_hash and t.peer_address and not is_client(t.peer_address)
        ]
        if not holders:
            return None
        newest, digest = agreed_state((t.round, t.state_hash) for _, t in holders)
        if newest <= self.kept_round(run_id):
            return None
        chosen = {n: t.peer_address for n, t in holders if t.round == newest and t.state_hash == digest}
        if only is not None:
            chosen = {n: a for n, a in chosen.items() if n == only} or chosen
        state = await fetch_raw(self.identity, chosen, f"state/{newest}", bytes.fromhex(digest))
        return KeptVersion(run_id=run_id, round=newest, states=[state], kept_at=self.clock())

    async def _pull_stages(self, run_id: str) -> KeptVersion | None:
        """Every stage's published state from a live peer serving it; None unless every stage came."""
        smap = self.stages.stage_map(run_id)
        if smap.stages <= 0:
            return None
        by_stage = []
        for s in range(smap.stages):
            serving = [p for p in smap.peers if p.report.stage == s and p.report.state_hash and p.report.state_address
                       and self.membership.is_live(p.node_id)]
            if not serving:
                return None
            by_stage.append(serving)
        # The version: the run's step as the ledger has it (the module's docstring says why not
        # the peers' optimizer steps); nothing to pull unless the pipeline moved past the kept one.
        version = self.run_step(run_id)
        if version <= 0 or version <= self.kept_round(run_id):
            return None
        states = [await self._stage_state(serving, s) for s, serving in enumerate(by_stage)]
        return KeptVersion(run_id=run_id, round=version, states=states, kind="stages",
                           stages=list(range(smap.stages)), kept_at=self.clock())

    def run_step(self, run_id: str) -> int:
        """A pipelined run's step: the newest one its drivers committed (the ledger's rounds)."""
        last = self.store.last_round(run_id)
        return int(last["outer_step"]) if last is not None else 0

    async def _stage_state(self, serving: list[pb.StagePeerInfo], stage: int) -> RawState:
        """Stage ``stage``'s state from the first peer that serves it whole: its published state
        changes after every optimizer step, so each peer's is checked against the hash it serves
        it under (read twice: the manifest, then the parts, which must carry the same hash)."""
        errors = []
        for p in serving:
            holder = {p.node_id: p.report.state_address}
            try:
                return await fetch_stage(self.identity, holder, f"stage/{stage}")
            except RawStateError as err:
                errors.append(str(err))
        raise RawStateError(f"no peer of stage {stage} served its state: {'; '.join(errors)}")


async def fetch_stage(ident: identity.Identity, holder: dict[str, str], name: str, attempts: int = 5) -> RawState:
    """A stage's published state, under the hash its holder serves now (it moves on after every
    optimizer step: a read that straddles one is read again)."""
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return await fetch_raw(ident, holder, name, None)
        except RawStateError as err:
            last = err
    raise RawStateError(str(last))
