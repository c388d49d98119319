"""The node's peer-to-peer data plane, assembled from the protocol parts.

* the DHT (protocol/dht.py): this node's signed record (address, last round, state hash),
  re-announced before it expires and withdrawn on leave; the round rendezvous,
* the exchange peer (node/exchange/peer.py's `abuild_peer`): the mutual-TLS peer server (version
  and ban checks, state serving) and the gRPC exchange on it, with the run's codec and aggregator,
  its members found by DHT rendezvous,
* state transfer (node/net/state_transfer.py): the newest global state, fetched from several peers in
  parallel and checked against the hash their records announce.

With the coordinator's view of the run's live trainers (node/daemon/run_view.py), the rendezvous
is checked against it (dead incarnations left out, a round group a majority of the live
trainers), and a joiner that sees no peer record in the DHT (slow lookups, a DHT it has not
reached yet) takes the state from the trainers the coordinator lists instead of starting alone.

Everything runs on the daemon's one asyncio loop (the exchange gets a handle on it); the DHT's
blocking calls run in worker threads. The DHT process and its p2pd are children of this process:
`close()` stops them, and protocol/dht.py's reaper kills them should this process die first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from murmur.errors import MurmurError
from murmur.node.daemon.dataplane import MemberTracker
from murmur.node.daemon.run_view import RunView
from murmur.node.daemon.settings import NodeSettings
from murmur.node.daemon.shared_state import shared_state_hash
from murmur.node.daemon.state_dir import JoinRecord
from murmur.node.exchange.group import DHTGroup, RendezvousSettings, RoundGate
from murmur.node.exchange.groups import DEFAULT_GROUP_SIZE, Formation
from murmur.node.exchange.hierarchy import GroupedExchange
from murmur.node.exchange.peer import ExchangePeer, PeerSpec, abuild_peer
from murmur.node.exchange.settings import ExchangeSettings
from murmur.node.exchange.start_floor import StartFloor
from murmur.node.net.addresses import WILDCARDS, advertised
from murmur.node.net.faults import FaultInjector
from murmur.node.net.loop import RunningLoop
from murmur.node.net.server import PeerServerSettings, PublishedState
from murmur.node.net.state_transfer import StateError, StateFetchSettings, afetch, newest_state, state_name
from murmur.optim.factory import make_aggregator_for, make_codec_for
from murmur.protocol import identity
from murmur.protocol.dht import DHTError, DHTSettings, MurmurDHT, PeerRecord
from murmur.protocol.reachability import is_client
from murmur.protocol.runconfig import RunConfig
from murmur.protocol.state_vote import agreed_state
from murmur.protocol.wire import tensors_hash

# Peers of a round are trainers; the coordinator also announces itself under the run (role
# "coordinator") as a bootstrap peer, and must not be counted as a member or asked for state.
TRAINER = "trainer"

STATE_POLL_S = 0.5  # how often a joiner looks for peers' records
DHT_RETRY_S = 1.0  # pause between DHT start attempts
# After a coordinator restart: the first redial of its DHT peer, doubling up to DHT_REFRESH_S.
REDIAL_FIRST_S = 0.25
REDIAL_TRIES = 12
DHT_REFRESH_S = 5.0  # while the DHT cannot start, ask the coordinator for its bootstrap peers this often
DHT_GOODBYE_TIMEOUT_S = 5.0  # the "gone" record; past this, peers learn of the exit from the TTL


class PeerDataPlaneError(MurmurError):
    pass


@dataclass(slots=True)
class LivePeers:
    """The trainers the DHT lists, this one included: their count is what a round's rendezvous
    waits for, their ids let the view count those it never listed."""

    ids: frozenset[str] = frozenset()

    @property
    def count(self) -> int:
        return max(1, len(self.ids))


class PeerDataPlane:
    """A started data plane (``open_peer_dataplane`` starts its parts)."""

    def __init__(
        self,
        ident: identity.Identity,
        settings: NodeSettings,
        log: Callable[[str], None],
        *,
        dht: MurmurDHT,
        peer: ExchangePeer,
        live: LivePeers,
        view: RunView | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
        floor: StartFloor | None = None,
    ) -> None:
        self.ident, self.s, self.log = ident, settings, log
        self.dht, self.peer, self.live, self.view = dht, peer, live, view
        self.floor = floor  # the peers the start waited for, which the first round waits for too
        # Called with (round, state hash, address) whenever this node publishes a round's state:
        # the session reports them with its heartbeats.
        self.on_publish: Callable[[int, str, str], None] | None = None
        self.address = peer.address
        # More live trainers than sync.group_size: rounds in bounded groups with one result
        # (node/exchange/hierarchy.py); at most that many, the exchange's calls as they are.
        grouped = GroupedExchange(peer.exchange, run_id=peer.exchange.server.run_id, live=self._round_live,
                                  group_size=group_size, addresses=self._round_addresses)
        grouped.on_formation = self._log_formation
        self._formed: tuple[int, int] = (0, 0)  # (trainers, groups) of the last grouped round logged
        self.exchange = MemberTracker(grouped)
        self.record: PeerRecord | None = None  # what this node announces: None until it has a round
        self._announcer: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._rejoined_at = -DHT_REFRESH_S  # loop time of the last reconnect to the bootstrap peers
        self._apart_logged: frozenset[str] = frozenset()
        # Compute speeds (inner steps per second of compute; optim/budget.py): this node's, announced in
        # its record with each round's state, and the others' as their records last said.
        self.rate = 0.0
        self._rates: dict[str, float] = {}
        self._addresses: dict[str, str] = {}  # the DHT's trainers' addresses, as the last lookup found them

    # -- discovery -------------------------------------------------------------------------------

    async def _trainers(self) -> list[PeerRecord]:
        """The run's trainers in the DHT, this one included; also what rounds wait for."""
        peers = await self.dht.apeers(role=TRAINER)
        self.live.ids = frozenset(p.node_id for p in peers)
        self._rates = {p.node_id: p.throughput for p in peers}
        self._addresses = {p.node_id: p.address for p in peers}
        return peers

    def _round_live(self) -> list[str]:
        """The live trainers a round's groups are formed from: ``RunView.round_trainers``, the
        coordinator's view (the same list for every node, refreshed each heartbeat) and the
        trainers the DHT announces that it lists late; without a fresh view, the DHT's trainers."""
        listed = self.view.round_trainers(self.live.ids) if self.view is not None else set()
        return sorted(listed or self.live.ids)

    def _round_addresses(self) -> dict[str, str]:
        """Where the live trainers listen: the coordinator's view (fresher) over the DHT's records.
        A group's rendezvous dials those it still waits for and goes on without the dead."""
        listed = {m.node_id: m.address for m in self.view.trainers() if m.address} if self.view is not None else {}
        return {**self._addresses, **listed}

    def _log_formation(self, round_id: int, formation: Formation) -> None:
        shape = (sum(map(len, formation.groups)), len(formation.groups))
        if shape != self._formed:
            self._formed = shape
            self.log(f"round {round_id}: {shape[0]} live trainers all-reduce in {shape[1]} groups "
                     f"(sync.group_size {max(map(len, formation.groups))} or fewer each)")

    def member_rates(self) -> dict[str, float]:
        """The compute speed of each member of the last round (0: not known yet), this node's own
        included: what sync.round_budget = "speed" shares the next round by. Read after each
        announce, so a change of speed shows a round or two later."""
        me = self.ident.node_id
        return {m: self.rate if m == me else self._rates.get(m, 0.0) for m in self.exchange.members}

    async def _announce(self) -> None:
        if self.record is None:
            return
        try:
            stored = await self.dht.aannounce(self.record)
            peers = await self._trainers()
            if not stored and len(peers) > 1:
                self.log("DHT announce was not stored; retrying")
            await self._rejoin_if_apart(peers)
        except DHTError as err:
            self.log(f"DHT announce failed ({err}); retrying")

    async def _rejoin_if_apart(self, peers: list[PeerRecord]) -> None:
        """The coordinator lists live trainers whose records this node's DHT does not show: the
        DHT is split. A bootstrap peer that restarted (the coordinator's) was dropped from the
        routing tables of the nodes that saw it down, and a node restarted after it knows only
        it: each side met only itself at the rendezvous, and the others waited out the deadline
        for the restarted node every round (8 s a round in test_churn_catchup.py). Dial the
        bootstrap peers again (at most every DHT_REFRESH_S): through them both sides meet."""
        if self.view is None or not self.dht.initial_peers:
            return
        seen = {p.node_id for p in peers} | {self.ident.node_id}
        apart = frozenset(m.node_id for m in self.view.trainers() if m.node_id not in seen)
        now = asyncio.get_running_loop().time()
        if not apart or now - self._rejoined_at < DHT_REFRESH_S:
            return
        self._rejoined_at = now
        try:
            answered = await self.dht.areconnect(self.dht.initial_peers)
        except Exception as err:  # noqa: BLE001 - the announce loop goes on; tried again later
            answered = 0
            self.log(f"could not dial the DHT bootstrap peers again ({type(err).__name__}: {err})")
        if apart != self._apart_logged:
            self._apart_logged = apart
            self.log(f"the coordinator lists {len(apart)} trainer(s) this node's DHT does not show: "
                     f"dialed the bootstrap peers again ({answered} of {len(self.dht.initial_peers)} answered)")

    def coordinator_back(self) -> None:
        """The coordinator restarted (or is back after an outage): dial its DHT peer again now.
        Its new DHT process knows only the nodes that bootstrapped from it since, and this node
        dropped it from its routing table while it was down: a node started after the restart met
        nobody but the coordinator and waited its whole peers_wait_s (60 s) for peers it could not
        see (issue 50). Not on a timer: at the moment the coordinator answers again."""
        if not self.dht.initial_peers or self._stop.is_set():
            return
        with contextlib.suppress(RuntimeError):  # no running loop: the node is closing
            asyncio.get_running_loop().create_task(self._redial_coordinator())

    async def _redial_coordinator(self) -> None:
        """Dial the bootstrap peers until one answers: right after its restart the coordinator's
        DHT refused the first dials (p2pd still held the connection to its previous process: "0 of
        1 answered" at the first heartbeat, then the late node waited 60 s). Backs off to
        DHT_REFRESH_S, for REDIAL_TRIES tries at most."""
        n, answered, delay = len(self.dht.initial_peers), 0, REDIAL_FIRST_S
        for _ in range(REDIAL_TRIES):
            self._rejoined_at = asyncio.get_running_loop().time()
            try:
                answered = await self.dht.areconnect(self.dht.initial_peers)
            except Exception as err:  # noqa: BLE001 - tried again below, and by the announce loop's check
                self.log(f"could not dial the DHT bootstrap peers again ({type(err).__name__}: {err})")
            if answered or self._stop.is_set():
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
            delay = min(2 * delay, DHT_REFRESH_S)
        self.log(f"the coordinator is back: dialed its DHT peer again ({answered} of {n} answered)")
        if answered:
            await self._announce()  # our record, through the healed routing table

    async def _announce_loop(self) -> None:
        period = self.s.dht_record_ttl_s / 3  # re-announce well before the record expires
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), period)
            await self._announce()

    async def wait_for_peers(self, count: int, timeout_s: float, stop: Callable[[], bool]) -> int:
        """Wait until ``count`` peers (this one included) are in the DHT, the timeout, or a stop.
        Peers that are still starting have no record yet: they are found by rendezvous entries
        too, so this also counts nodes that registered for round 0. Once counted, the first
        round waits for as many at its rendezvous (node/exchange/start_floor.py)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Until the first round, announce round -1 so others can count this node.
        self.record = PeerRecord(node_id=self.ident.node_id, address=self.address, round=-1)
        while True:
            # Re-announce each time: a lone first node's store fails until someone joins its DHT.
            await self._announce()
            peers = self._may_be_live(await self._trainers())
            if len(peers) >= count and self.floor is not None:
                self.floor.hold({p.node_id for p in peers} | {self.ident.node_id}, count, timeout_s)
            if len(peers) >= count or loop.time() >= deadline or stop():
                return len(peers)
            await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))

    def _may_be_live(self, peers: list[PeerRecord]) -> list[PeerRecord]:
        """The records a wait for peers counts: with a fresh view of the coordinator's, those of the
        trainers it lists and of nodes still starting (round -1), not a trained node's record that
        outlives it by the DHT's TTL. A node started just after others left or were killed counted
        their records, took its --min-peers as met, and trained alone (under load, for rounds)
        before the peer it was told to wait for was back. Without a fresh view: every record."""
        if self.view is None or not self.view.fresh():
            return peers
        listed = set(self.view.members)
        me = self.ident.node_id
        return [p for p in peers if p.node_id == me or p.round < 0 or p.node_id in listed]

    # -- state -----------------------------------------------------------------------------------

    def publish(self, round_id: int, tensors: list[tuple[str, torch.Tensor]], digest: bytes | None = None) -> None:
        """Serve this round's global state to joiners and announce (round, hash) in the DHT."""
        if digest is None:
            digest = tensors_hash(tensors)
        members = list(self.exchange.members)
        self.peer.server.publish_state(PublishedState(state_name(round_id), tensors, digest, members))
        self.record = PeerRecord(
            node_id=self.ident.node_id, address=self.address, round=round_id, state_hash=digest.hex(),
            throughput=self.rate,
        )
        if self.on_publish is not None:
            self.on_publish(round_id, digest.hex(), self.address)
        if self._announcer is None:
            self._announcer = asyncio.create_task(self._announce_loop())
        asyncio.create_task(self._announce())

    async def _others(self, timeout_s: float | None = None) -> list[PeerRecord]:
        """Other trainers' records: the DHT's (a lookup slower than ``timeout_s`` finds nothing),
        and those of the live trainers the coordinator lists (fresher: they win)."""
        me = self.ident.node_id
        found: dict[str, PeerRecord] = {}
        try:
            found = {r.node_id: r for r in await asyncio.wait_for(self._dht_others(), timeout_s)}
        except TimeoutError:
            pass
        except DHTError as err:
            if self.view is None or not self.view.trainers():
                raise
            self.log(f"cannot list peers in the DHT ({err}); using the coordinator's list")
        for m in self.view.trainers() if self.view is not None else []:
            if m.node_id != me and m.state_hash:
                found[m.node_id] = PeerRecord(
                    node_id=m.node_id, address=m.address, round=m.round, state_hash=m.state_hash
                )
        return sorted(found.values(), key=lambda r: r.node_id)

    async def _dht_others(self) -> list[PeerRecord]:
        me = self.ident.node_id
        await self.peer.exchange.faults.delay("peer_lookup", me, -1)  # a slow or unreachable DHT
        return [r for r in await self.dht.apeers(role=TRAINER) if r.node_id != me]

    async def fetch_state(
        self, *, min_round: int, timeout_s: float, exclude: frozenset[str] = frozenset()
    ) -> dict[str, torch.Tensor] | None:
        """The newest global state some peers (not in ``exclude``) announce, if its round is at
        least ``min_round``."""
        # Right after joining the DHT a lookup may not see anyone yet: look again until some peer
        # shows up, the rendezvous deadline (or the caller's timeout) says this node is the first
        # one, or the coordinator says nobody can be ahead of it.
        loop = asyncio.get_running_loop()
        alone_after = loop.time() + min(self.s.rendezvous_deadline_s, timeout_s)
        while True:
            try:
                records = await self._others(max(STATE_POLL_S, alone_after - loop.time()))
            except DHTError as err:
                self.log(f"cannot list peers ({err}); starting from the local state")
                return None
            # A restarted node holding the run's newest round, the others restarting too, waited
            # out the deadline here for nobody (8 s of a 24 s stall in a chaos testnet, MTBF 5 s).
            nobody = self.view is not None and self.view.nobody_ahead(min_round)
            if records or loop.time() >= alone_after or nobody:
                break
            await asyncio.sleep(STATE_POLL_S)
        deadline = loop.time() + timeout_s
        asked = False
        while True:
            others = [
                r
                for r in records
                if r.round >= min_round and r.state_hash and r.node_id not in exclude and not is_client(r.address)
            ]
            if not others:
                return None
            # The newest round; within it, the hash most peers hold (a lone liar is outvoted).
            newest, digest = agreed_state((r.round, r.state_hash) for r in others)
            holders = {r.node_id: r.address for r in others if r.round == newest and r.state_hash == digest}
            if not asked:
                # A record is a heartbeat or an announce old: ask the holders what they serve now,
                # once, and take that if it is newer, so a node behind the run catches up in one
                # step. Following a record one round behind, a node whose round then failed (the
                # result it needed was dropped) re-synced to the same state and looped.
                asked = True
                try:  # a hung holder must not hold the fetch up: the fetch itself tries it anyway
                    served = await asyncio.wait_for(self._served_now(holders), self.s.peer_timeout_s)
                except TimeoutError:
                    served = []
                if any(r.round > newest for r in served):
                    records = served
                    continue
            try:
                tensors, _ = await asyncio.wait_for(
                    afetch(
                        self.ident,
                        holders,
                        state_name(newest),
                        bytes.fromhex(digest),
                        settings=StateFetchSettings(call_timeout=timeout_s),
                    ),
                    max(1.0, deadline - loop.time()),
                )
            except (TimeoutError, StateError) as err:
                # Peers move on and drop old states: look again while time is left, rather than
                # train alone from a stale state.
                self.log(f"could not fetch the state of round {newest} from {len(holders)} peers: {err}")
                if loop.time() >= deadline:
                    return None
                served = await self._served_now(holders)
                if any(r.round > newest for r in served):
                    records = served  # they moved on: vote and fetch again, from what they serve now
                    continue
                await asyncio.sleep(STATE_POLL_S)
                try:
                    records = await self._others(self.s.rendezvous_deadline_s)
                except DHTError:
                    return None
                continue
            # The state hash as every node's round log (rounds.jsonl) and round line record it: the
            # transfer's own digest covers the outer momentum too, so it never matched those.
            self.log(f"fetched the state of round {newest} from {len(holders)} peer(s), transfer verified: "
                     f"state hash {shared_state_hash(list(tensors.items()))[:12]}")
            return tensors

    async def _served_now(self, holders: dict[str, str]) -> list[PeerRecord]:
        """Records of the holders' newest states, asked of them directly (NEWEST_STATE): a DHT
        record is a second or more old, and a holder training alone (its peers restarting) runs
        several rounds a second and drops older states; a restart that followed the records
        chased one for 240 s. The caller votes and fetches from these as from the DHT's."""
        settings = StateFetchSettings(call_timeout=self.s.rendezvous_deadline_s)
        answers = await asyncio.gather(
            *[newest_state(self.ident, n, a, settings) for n, a in holders.items()], return_exceptions=True
        )
        return [
            PeerRecord(node_id=n, address=holders[n], round=x[0], state_hash=x[1].hex())
            for n, x in zip(holders, answers, strict=True)
            if isinstance(x, tuple)
        ]

    def last_round_members(self) -> list[str]:
        return self.exchange.members

    def take_rejections(self) -> list[tuple[int, str, str]]:
        return [(r.round, r.sender, r.reason) for r in self.peer.exchange.take_rejections()]

    # -- leaving ---------------------------------------------------------------------------------

    async def close(self) -> None:
        """Say goodbye in the DHT, stop serving, stop the DHT process (and p2pd)."""
        self._stop.set()
        if self._announcer is not None:
            self._announcer.cancel()
            await asyncio.gather(self._announcer, return_exceptions=True)
        if self.record is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(self.dht.withdraw), DHT_GOODBYE_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await self.peer.exchange.aclose()
        await self.peer.server.stop()
        await asyncio.to_thread(self.dht.shutdown)


async def _start_unless_cancelled(dht: MurmurDHT) -> None:
    """``dht.start()`` on a thread. Cancelled (the node was told to stop while starting,
    node/daemon/node.py), the start is called off: its thread stops the process it forked within
    a poll, and nothing it started outlives the cancellation."""
    starting = asyncio.ensure_future(asyncio.to_thread(dht.start))
    try:
        await asyncio.shield(starting)
    except asyncio.CancelledError:
        dht.abort_start()
        with contextlib.suppress(Exception):
            await starting
        await asyncio.to_thread(dht.shutdown)  # a start that had already finished
        raise


async def _start_dht(
    ident: identity.Identity,
    info: JoinRecord,
    host: str,
    dht_peers: list[str],
    settings: NodeSettings,
    log: Callable[[str], None],
    refresh_bootstrap: Callable[[], Awaitable[list[str] | None]] | None = None,
    client_mode: bool = False,
    on_forked: Callable[[], None] | None = None,
) -> MurmurDHT:
    initial = list(info.bootstrap_peers) + list(dht_peers)
    dht = MurmurDHT(
        info.run_id,
        ca_cert_pem=ident.ca_cert_pem,
        identity=ident,
        initial_peers=initial,
        settings=DHTSettings(
            host=host if host not in WILDCARDS else "0.0.0.0",
            record_ttl=settings.dht_record_ttl_s,
            start_timeout=settings.dht_start_timeout_s,
            client_mode=client_mode,
        ),
    )
    dht.on_forked = on_forked
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.dht_start_timeout_s
    asked_at = -DHT_REFRESH_S
    while True:
        try:
            await _start_unless_cancelled(dht)
            break
        except DHTError as err:
            # A bootstrap peer that is slow to answer (a loaded machine, a restarting peer)
            # fails p2pd's start: try again until the start timeout. The saved peers may be gone
            # for good (a coordinator restarted on another DHT port or peer id): ask the
            # coordinator which peers it hands out now, and use those.
            why = str(err) or type(err).__name__
            if loop.time() >= deadline:
                raise DHTError(
                    f"{why} (for {settings.dht_start_timeout_s:g}s, bootstrap peers "
                    f"{', '.join(dht.initial_peers) or 'none'})"
                ) from None
            if refresh_bootstrap is not None and loop.time() - asked_at >= DHT_REFRESH_S:
                asked_at = loop.time()
                tried = [p for p in dht.initial_peers if p not in dht_peers]
                fresh = await refresh_bootstrap()  # the session saves them in the join record
                if fresh and set(fresh) != set(tried):
                    log(
                        f"DHT start failed ({why}) with the bootstrap peers {', '.join(tried) or '(none)'}; "
                        f"the coordinator now hands out {', '.join(fresh)}: retrying with those"
                    )
                    dht.initial_peers = list(fresh) + list(dht_peers)
                    continue
            log(f"DHT start failed ({why}); retrying")
            await asyncio.sleep(DHT_RETRY_S)
    if not initial:
        log(
            "no DHT bootstrap peers (the coordinator runs with --no-dht and no --dht-peer was given): "
            "this node starts the run's DHT; start every other node of the run with "
            f"--dht-peer {dht.addresses[0] if dht.addresses else 'ADDRESS'}, or they will train alone"
        )
    return dht


async def _settle_client_mode(
    mode: str,
    address: str,
    dial_back: Callable[[str], Awaitable[tuple[bool, str] | None]] | None,
    log: Callable[[str], None],
) -> bool:
    """Whether this node takes part in client mode: ``mode`` "on", or "auto" and the coordinator
    could not dial ``address``. "off" with an address nobody can dial is a clear error, not a
    node that every round waits for."""
    if mode == "on":
        return True
    answer = await dial_back(address) if dial_back is not None else None
    if answer is None:  # nobody could tell (no coordinator answer): take the address at its word
        return False
    reachable, why = answer
    if reachable:
        return False
    if mode == "off":
        raise PeerDataPlaneError(
            f"peers cannot reach this node's peer server at {address}: {why}. Run with "
            "--client-mode auto (or on) to take part without accepting connections, or open the port"
        )
    log(f"the coordinator cannot dial {address} ({why}): taking part in client mode")
    return True


async def open_peer_dataplane(
    *,
    ident: identity.Identity,
    info: JoinRecord,
    cfg: RunConfig,
    settings: NodeSettings,
    listen: str,
    advertise_host: str,
    log: Callable[[str], None],
    dht_peers: list[str],
    state_dir: Path,
    faults: FaultInjector | None = None,
    refresh_bootstrap: Callable[[], Awaitable[list[str] | None]] | None = None,
    view: RunView | None = None,
    client_mode: str = "off",
    dial_back: Callable[[str], Awaitable[tuple[bool, str] | None]] | None = None,
    gate: RoundGate | None = None,
    on_forked: Callable[[], None] | None = None,
) -> PeerDataPlane:
    """Start the peer server, settle client mode (``dial_back``: the coordinator's check of the
    address peers would dial), then the DHT (in hivemind's client mode too, for a client) and the
    exchange on them; on any failure, stop what was started. ``on_forked`` is called (from a
    worker thread) once the DHT's process is forked, seconds before it is ready."""
    host, _, port = listen.rpartition(":")
    live = LivePeers()
    floor = StartFloor(dead=view.dead_ids if view is not None else frozenset, log=log)
    dht: MurmurDHT | None = None
    async with contextlib.AsyncExitStack() as undo:

        async def unreachable(address: str) -> bool:
            return await _settle_client_mode(client_mode, address, dial_back, log)

        async def group(address: str) -> DHTGroup:
            nonlocal dht
            client = is_client(address)
            if client and not (info.bootstrap_peers or dht_peers):
                raise DHTError(
                    "client mode needs a DHT bootstrap peer that others can dial: the coordinator runs "
                    "no DHT here, so pass --dht-peer MULTIADDR of a reachable node"
                )
            dht = await _start_dht(ident, info, host, dht_peers, settings, log, refresh_bootstrap, client, on_forked)
            undo.push_async_callback(asyncio.to_thread, dht.shutdown)
            return DHTGroup(
                dht,
                address,
                expected=lambda: live.count,
                announced_ids=lambda: live.ids,
                settings=RendezvousSettings(deadline=settings.rendezvous_deadline_s),
                view=view,
                floor=floor,
            )

        spec = PeerSpec(
            identity=ident,
            run_id=info.run_id,
            codec=make_codec_for(cfg.sync),
            group=group,
            aggregator=make_aggregator_for(cfg.sync),
            settings=ExchangeSettings(
                peer_timeout=settings.peer_timeout_s,
                round_deadline=settings.round_timeout_s,
                chunk_mb=cfg.sync.exchange_chunk_mb,
            ),
            server=PeerServerSettings(host=host or "127.0.0.1", port=int(port or 0)),
            advertise_host=advertised(host, advertise_host),
            faults=faults,
            client_mode=unreachable,
            gate=gate,
        )
        peer = await abuild_peer(spec, RunningLoop(asyncio.get_running_loop()))
        undo.push_async_callback(peer.aclose)
        assert dht is not None  # the group factory started it
        plane = PeerDataPlane(
            ident, settings, log, dht=dht, peer=peer, live=live, view=view, group_size=cfg.sync.group_size,
            floor=floor,
        )
        # Where others can bootstrap from and dial us (read by `murmur testnet` and by operators).
        (state_dir / "peer.json").write_text(
            json.dumps({"node_id": ident.node_id, "address": plane.address, "dht": dht.addresses}) + "\n"
        )
        where = f"peer server on {plane.address}"
        if peer.client_mode:
            where = "client mode (this node owns no span and serves no state)"
        log(f"{where}; DHT on {', '.join(dht.addresses[:1]) or '?'}")
        undo.pop_all()
    return plane
