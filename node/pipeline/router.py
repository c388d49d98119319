"""Stochastic wiring: for each hop, which peer of the next stage, and how long to wait for it.

Choice by estimated load, after SWARM: every peer carries a virtual busy time; a hop takes the
peer of the stage with the smallest one and adds ``samples / throughput`` to it, the throughput
being a bias-corrected EMA (alpha 0.1) of the samples per second the peer delivered, measured by
the caller over the whole call (wire included). A peer with no measurement yet is charged
``initial_throughput`` and enters at the stage's current minimum, ahead of measured peers on a
tie, so new peers are tried at once.
(SWARM keeps a heap; a stage has a handful of peers, so a linear minimum is the same rule.)

Failures: a peer whose call fails or times out is benched for ``bench_s``, doubling with each
failure in a row up to ``max_bench_s`` (Petals bans 15 s with doubling), and its next success
clears the count. When every peer of a stage is benched the one whose bench ends first is
still offered: a stage is never declared empty by the router alone.

Deadlines adapt to measured latency, as TCP's retransmission timer does (RFC 6298): per peer and
kind of call, a smoothed latency and its mean deviation give ``srtt + 4 * rttvar``, times 2 for
slack, clamped to [min_hop_timeout_s, hop_timeout_s]; a timeout doubles the peer's estimate
(Karn's rule). A peer never measured gets ``hop_timeout_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from murmur.node.pipeline.client import StageEndpoint
from murmur.protocol.runconfig import PipelineSection

EMA_ALPHA = 0.1  # SWARM's throughput EMA
RTT_ALPHA, RTT_BETA = 0.125, 0.25  # RFC 6298's gains
DEADLINE_SLACK = 2.0  # multiplies srtt + 4 rttvar: a loaded machine's latency has a long tail
BACKWARD_COST = 2.5  # a backward (recompute + backward) costs ~2.5 forwards, as SWARM counts


@dataclass(slots=True)
class PeerState:
    peer: StageEndpoint
    busy: float = 0.0  # virtual busy time, seconds of estimated work
    ema_raw: float = 0.0
    ema_n: int = 0
    srtt: dict[str, float] = field(default_factory=dict)  # kind -> smoothed latency
    rttvar: dict[str, float] = field(default_factory=dict)
    failures: int = 0  # in a row
    benched_until: float = 0.0
    hops: int = 0  # calls that succeeded
    failed_total: int = 0

    def throughput(self, initial: float) -> float:
        if not self.ema_n:
            return initial
        return self.ema_raw / (1 - (1 - EMA_ALPHA) ** self.ema_n)


class Router:
    def __init__(
        self, cfg: PipelineSection, *, initial_throughput: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cfg, self.initial_throughput, self.clock = cfg, initial_throughput, clock
        self.stages: dict[int, dict[str, PeerState]] = {s: {} for s in range(cfg.stages)}
        self.arrivals = 0  # peers that entered a stage so far: a driver pausing after a failure stops waiting

    # -- membership ------------------------------------------------------------------------------

    def set_peers(self, stage: int, peers: Iterable[StageEndpoint]) -> None:
        """The stage's current peers (from the DHT or the coordinator); keeps what it knew of those
        that stay, forgets those that left, and lets newcomers in at the current minimum. A peer
        that comes back under its node id at another address (restarted) is no longer benched."""
        known = self.stages.setdefault(stage, {})
        fresh = {p.node_id: p for p in peers}
        for node_id in list(known):
            if node_id not in fresh:
                del known[node_id]
        floor = min((s.busy for s in known.values()), default=0.0)
        for node_id, peer in fresh.items():
            if node_id in known:
                st = known[node_id]
                if st.peer.address != peer.address:
                    # The same node restarted (its identity kept in its state folder): a new
                    # process, not the one that failed; what was measured of the dead one is moot.
                    st.failures, st.benched_until = 0, 0.0
                    st.srtt.clear()
                    st.rttvar.clear()
                    self.arrivals += 1
                st.peer = peer
            else:
                known[node_id] = PeerState(peer, busy=floor)
                self.arrivals += 1

    def peers(self, stage: int) -> list[PeerState]:
        return list(self.stages.get(stage, {}).values())

    # -- choice ----------------------------------------------------------------------------------

    def choose(self, stage: int, samples: int, *, kind: str = "forward", exclude: Iterable[str] = ()) -> StageEndpoint:
        """The least-busy peer of ``stage`` not in ``exclude``, charged with the hop's work."""
        excluded = set(exclude)
        candidates = [s for s in self.stages.get(stage, {}).values() if s.peer.node_id not in excluded]
        if not candidates:
            raise LookupError(f"no peer of stage {stage} left to try")
        now = self.clock()
        ready = [s for s in candidates if s.benched_until <= now]
        if ready:
            best = min(ready, key=lambda s: (s.busy, s.ema_n > 0, s.peer.node_id))  # ties: unmeasured first
        else:
            best = min(candidates, key=lambda s: s.benched_until)
        cost = BACKWARD_COST if kind == "backward" else 1.0
        best.busy += cost * samples / best.throughput(self.initial_throughput)
        return best.peer

    def state(self, peer: StageEndpoint) -> PeerState | None:
        return self.stages.get(peer.stage, {}).get(peer.node_id)

    # -- deadlines -------------------------------------------------------------------------------

    def deadline(self, peer: StageEndpoint, kind: str) -> float:
        st = self.state(peer)
        if st is None or kind not in st.srtt:
            return self.cfg.hop_timeout_s
        estimate = DEADLINE_SLACK * (st.srtt[kind] + 4 * st.rttvar[kind])
        return min(self.cfg.hop_timeout_s, max(self.cfg.min_hop_timeout_s, estimate))

    def forward_deadline(self, peer: StageEndpoint) -> float:
        """A training forward's deadline. A stage peer holds a forward that belongs to its next
        optimizer step until the backwards of this step come back (node/pipeline/step_gate.py):
        at most the rest of one microbatch's trip, from this stage down and back. So the deadline
        is the forward's own plus that trip as measured (each hop at its slowest peer, with the
        slack of `deadline`), within ``hop_timeout_s``: a held forward is not taken for a dead peer."""
        own = self.deadline(peer, "forward")
        trip = 0.0
        last = self.cfg.stages - 1
        hops = [(t, "forward") for t in range(peer.stage + 1, last)]
        hops += [(t, "backward") for t in range(peer.stage, last + 1)]
        for t, kind in hops:
            measured = [st.srtt[kind] + 4 * st.rttvar[kind]
                        for st in self.stages.get(t, {}).values() if kind in st.srtt]
            if not measured:
                return self.cfg.hop_timeout_s
            trip += DEADLINE_SLACK * max(measured)
        return min(self.cfg.hop_timeout_s, own + trip)

    # -- outcomes --------------------------------------------------------------------------------

    def succeeded(self, peer: StageEndpoint, kind: str, samples: int, seconds: float) -> None:
        st = self.state(peer)
        if st is None:
            return
        cost = BACKWARD_COST if kind == "backward" else 1.0
        rate = cost * samples / max(seconds, 1e-6)  # forward-equivalent samples per second
        st.ema_n += 1
        st.ema_raw = EMA_ALPHA * rate + (1 - EMA_ALPHA) * st.ema_raw
        if kind not in st.srtt:
            st.srtt[kind], st.rttvar[kind] = seconds, seconds / 2
        else:
            st.rttvar[kind] = (1 - RTT_BETA) * st.rttvar[kind] + RTT_BETA * abs(st.srtt[kind] - seconds)
            st.srtt[kind] = (1 - RTT_ALPHA) * st.srtt[kind] + RTT_ALPHA * seconds
        st.failures = 0
        st.hops += 1

    def failed(self, peer: StageEndpoint, kind: str, *, timed_out: bool) -> None:
        st = self.state(peer)
        if st is None:
            return
        if timed_out and kind in st.srtt:  # Karn: the estimate was too low; back it off
            st.srtt[kind] *= 2
        st.failures += 1
        st.failed_total += 1
        bench = min(self.cfg.max_bench_s, self.cfg.bench_s * 2 ** (st.failures - 1))
        st.benched_until = self.clock() + bench
