"""Load on one coordinator: many simulated nodes heartbeating (and committing) over mutual TLS.

    python benchmarks/coordinator_load.py                      # the committed table
    python benchmarks/coordinator_load.py --nodes 1000 --hz 1  # one row

The coordinator is a real subprocess (`murmur coordinator serve`) on a fresh ledger. The simulated
nodes really join (token, CSR, certificate), each holds a lease and its own mutual-TLS channel, and
they run in ``--workers`` load processes (asyncio clients) so the client side does not saturate one
core. Each node heartbeats ``hz`` times a second (start times spread evenly over the period) and
commits ``--commit-every`` seconds. Reported per row: heartbeat latency p50/p99 (client side, so it
includes the client's own loop delay: an upper bound), commits/s accepted, and the coordinator's
CPU use (psutil, % of one core) over the measured window, and per heartbeat (``cpu_us_per_call``:
the coordinator's CPU over every call it served, commits included).

``--trainers``: every node heartbeats as a trainer of the run (incarnation, peer address, round,
state hash), so each reply carries the live-trainer view (coordinator/trainer_view.py): the whole
list when it changed since the node's last reply, else ``view_unchanged``. ``--round-every S``:
each trainer also reports a new round every S seconds (spread), so the view changes all the time,
as in a run whose rounds end at different times: the cost of resending it.

``--heartbeat stream`` (the default): heartbeats go on each node's own long-lived stream
(HeartbeatStream), as the node daemon's did before datagrams; ``--heartbeat unary`` (or
``--unary``) uses the unary Heartbeat call of older nodes instead, to compare like with like. Both
run the coordinator with ``--heartbeat-udp off``. ``--heartbeat udp``: the nodes join and lease
over gRPC as always, then heartbeat as signed UDP datagrams (protocol/heartbeat_datagram.py) with
the key their join reply carried: each node has its own datagram socket (connected to the
coordinator's UDP port), its own key and counter, and HMACs every beat and its reply; a beat not
answered in time, or answered "use gRPC", goes over gRPC (counted: ``udp_fallbacks``). By default
(``--udp-client lean``) the beats come from LeanBeats: the same bytes and rules per node as the
node's MemberClient, one beat in flight per node, but one scheduler per load process instead of
a task, a transport, a future and a timer per node and beat (``--udp-client member``: through
MemberClient as before). LeanBeats beats from the moment every node is in; with ``--trainers`` the
window starts one TTL after the coordinator started (its view is whole from then) plus
``--warmup`` seconds, in which each node fetches the whole view once over gRPC. Beside the
clients' p50/p99, a udp row has the coordinator's own (``server_p50_ms``/``server_p99_ms``: from its
``murmur_heartbeat_datagram_seconds`` histogram over the window, arrival at its socket to reply
sent, each the upper bound of its bucket), how late the load processes sent beats against their
schedule (``send_lag_p99_ms``), beats a node skipped because its last was still in flight
(``beats_skipped``), and how long joining, leasing and opening took (``join_s``, ``lease_s``,
``open_s``, the slowest load process's).
``--section NAME`` writes the table under that key of the results file (``--results FILE``, default
benchmarks/results/coordinator_load.json) and keeps the rest of it; ``--append`` adds to its rows.

``--fronts N``: the coordinator runs N heartbeat front processes (``--heartbeat-fronts``,
coordinator/fronts.py) and each node's stream goes to the one its replies name, as a node's does;
the coordinator's CPU is then its own process's and its fronts' together (both reported).

The 10,000-node rows on a 16-core host (the coordinator pinned to 2 cores, the load to the other
14; nodes heartbeating as they do by default, in datagrams, committing every 10 s; the results
where --results says; PYTHONSAFEPATH keeps the repository's own murmur/ folder off the path of
the coordinator's ``-m murmur.cli``). Needs grpcio, protobuf, cryptography, prometheus_client,
psutil and pydantic; each row is cut short and still written at --budget:

    source benchmarks/gpu_env.sh; export PYTHONSAFEPATH=1
    python3 benchmarks/coordinator_load.py --nodes 10000 --hz 1 --seconds 30 --workers 8 \
        --coordinator-cpus 0-1 --load-cpus 2-15 --heartbeat udp --commit-every 10 \
        --budget 300 --results "$OUT/coordinator_load.json" --section issue_49_coord10k_16core --append
    # the same as trainers: the view is whole 100 s after the start, then 240 s for every node to
    # fetch it whole once (1.6 MB each, over gRPC), then the window
    python3 benchmarks/coordinator_load.py --nodes 10000 --hz 1 --seconds 30 --workers 8 \
        --coordinator-cpus 0-1 --load-cpus 2-15 --heartbeat udp --trainers --commit-every 10 \
        --warmup 240 --budget 470 --results "$OUT/coordinator_load.json" --section issue_49_coord10k_16core --append

``--budget S``: past S seconds in all (or on SIGTERM, e.g. from ``timeout``) the run is cut short
and its row is still written, with what was measured until then and the phase it reached
(``cut_short``). Every row records the commit, the machine's load before and after, the CPU
pinning, the niceness and the fronts.

Targets: issue 6, 1,000 nodes at 1 Hz with p99 under 50 ms on 2 cores; issue 49, 10,000.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "coordinator_load.json"
DEFAULT_ROWS = [(100, 1.0), (500, 1.0), (1000, 1.0), (1000, 2.0), (10000, 1.0)]
START_TIMEOUT_S = 60.0
JOIN_CONCURRENCY = 64  # calls in flight per load process while joining and opening streams
SETUP_TRIES = 5  # a join or lease call that fails before the window is tried this often
CALL_TIMEOUT_S = 120  # a call in the join storm of 10,000 nodes waits behind thousands of others


# --- heartbeat datagrams, many nodes on one loop -----------------------------------------------------


class _LeanNode:
    __slots__ = ("index", "client", "sock", "key", "node_id", "counter", "waiting", "sent_at", "sent_wall",
                 "misses", "paused_until", "slow_until", "round", "busy")

    def __init__(self, index: int, client: object, sock: object, counter: int) -> None:
        self.index, self.client, self.sock = index, client, sock
        self.key, self.node_id = client.datagrams.key, client.datagrams.node_id  # type: ignore[attr-defined]
        self.counter = counter
        self.waiting = 0  # the counter of the beat awaiting its answer (0: none)
        self.sent_at = self.sent_wall = 0.0
        self.misses = 0
        self.paused_until = 0.0
        self.slow_until = 0.0  # a late answer came: this node's beats wait SLOW_WAIT_S until then
        self.round = 0
        self.busy = False  # a beat of this node is in flight (its datagram or its gRPC fallback)


class LeanBeats:
    """The simulated nodes' heartbeat datagrams, with one Python layer per beat instead of four.

    What each node does on the wire is what a node's MemberClient does (protocol/heartbeat_udp_client.py):
    its own UDP socket connected to the coordinator's address, its own key and strictly increasing
    counter (the clock in ns), a HeartbeatRequest built for each beat and signed with
    heartbeat_datagram.encode_beat, the answer taken only if decode_reply verifies it under the
    node's key and it echoes the beat's counter, then parsed; a beat unanswered within WAIT_S (or
    SLOW_WAIT_S, for SLOW_FOR_S after an answer came late), or answered "use gRPC", is made over gRPC
    at once (the node's own channel), and MISSES_BEFORE_PAUSE unanswered in a row pause datagrams
    for PAUSE_S. What is left out is the per-beat machinery
    of asyncio around it (a datagram transport and a task per node, a future and a wait_for timer
    per beat): here one scheduler sends every beat that is due in a turn of the loop, each node's
    own datagram from its own socket, and one reader per socket takes its answers. At 10,000 nodes
    that machinery was most of the load processes' 143 us a beat, and the clients' loop delay was
    in the latency the row reported.
    """

    def __init__(self, clients: list, udp_address: str, trainer, hz: float, start: float,
                 round_every: float, seed: int, latencies: list[float], counts: dict[str, int],
                 lags: list[float]) -> None:
        import socket

        from murmur.protocol import heartbeat_datagram as hd
        from murmur.protocol.coordinator_client import CALL_TIMEOUT_S as NODE_CALL_TIMEOUT_S
        from murmur.protocol.heartbeat_udp_client import MISSES_BEFORE_PAUSE, PAUSE_S, SLOW_FOR_S, SLOW_WAIT_S, WAIT_S

        self.hd, self.wait_s, self.misses_before_pause, self.pause_s = hd, WAIT_S, MISSES_BEFORE_PAUSE, PAUSE_S
        self.slow_wait_s, self.slow_for_s = max(WAIT_S, SLOW_WAIT_S), SLOW_FOR_S
        self.trainer, self.period, self.start = trainer, 1.0 / hz, start
        # Beats go from ``start`` on; only those sent in [window_start, end) are counted (window()).
        self.window_start = self.end = float("inf")
        self.round_every = round_every
        self.rng = random.Random(seed)
        self.latencies, self.counts, self.lags = latencies, counts, lags
        self.fallbacks: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()
        host, port = hd.split_host_port(udp_address)
        self.nodes: list[_LeanNode] = []
        for i, c in enumerate(clients):
            # From now on each node's gRPC calls wait as long as a node's do (the join storm's
            # CALL_TIMEOUT_S is longer): a fallback stuck behind others fails after 10 s, and the
            # node's next beat (a datagram first, which keeps it alive) tries again.
            c.timeout_s = NODE_CALL_TIMEOUT_S
            c.datagrams.close()  # the client's own transport: this node's datagrams go from its socket below
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.connect((host, port))
            node = _LeanNode(i, c, sock, c.datagrams._counter)
            self.nodes.append(node)
            loop.add_reader(sock.fileno(), self._readable, node)

    def window(self, start: float, end: float) -> None:
        """Count the beats sent from ``start`` on; send none from ``end`` on."""
        self.window_start, self.end = start, end

    def _counted(self, sent_wall: float) -> bool:
        return self.window_start <= sent_wall < self.end

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for node in self.nodes:
            loop.remove_reader(node.sock.fileno())
            node.sock.close()

    def _request(self, node: _LeanNode):
        from murmur.protocol import coordinator_pb2 as pb

        client = node.client
        request = pb.HeartbeatRequest(tokens_per_s=100.0, ban_list_version=client.ban_list_version)
        peer = self.trainer(node.index, node.round)
        if peer is not None:
            request.MergeFrom(peer)
            request.view_version = client.view_version
        return request

    async def run(self) -> None:
        import heapq

        heap = [(self.start + self.rng.random() * self.period, i) for i in range(len(self.nodes))]
        heapq.heapify(heap)
        next_round = [self.start + self.rng.random() * self.round_every if self.round_every > 0 else float("inf")
                      for _ in self.nodes]
        # (when, sequence, node, counter): a beat's wait is WAIT_S, or SLOW_WAIT_S after a late answer
        deadlines: list = []
        sequence = 0
        while heap or deadlines:
            now = time.time()
            while deadlines and deadlines[0][0] <= now:
                _, _, node, counter = heapq.heappop(deadlines)
                if node.waiting == counter:  # unanswered within WAIT_S: a miss, and gRPC answers it
                    self._missed(node, now)
                    self._over_grpc(node, self._request(node), node.sent_at)
            while heap and heap[0][0] <= now:
                due, i = heapq.heappop(heap)
                if due >= self.end:  # past the window: this node is done
                    continue
                node = self.nodes[i]
                if due >= next_round[i]:
                    node.round, next_round[i] = node.round + 1, next_round[i] + self.round_every
                heapq.heappush(heap, (due + self.period, i))
                if node.busy:  # a node heartbeats one at a time: its last beat is not answered yet
                    self.counts["beats_skipped"] += self._counted(now)
                    continue
                if self._counted(now):
                    self.lags.append(now - due)
                self._send(node, now)
                if node.waiting:
                    sequence += 1
                    wait = self.slow_wait_s if now < node.slow_until else self.wait_s
                    heapq.heappush(deadlines, (now + wait, sequence, node, node.waiting))
            wake = min(heap[0][0] if heap else float("inf"), deadlines[0][0] if deadlines else float("inf"))
            if wake < float("inf"):
                await asyncio.sleep(max(0.0, wake - time.time()))
        if self.fallbacks:
            await asyncio.gather(*self.fallbacks, return_exceptions=True)

    def _send(self, node: _LeanNode, now: float) -> None:
        request = self._request(node)
        node.sent_wall, node.busy = now, True
        if now < node.paused_until:  # datagrams paused after misses: this beat goes over gRPC
            self._over_grpc(node, request, time.perf_counter())
            return
        node.counter = max(node.counter + 1, time.time_ns())
        data = self.hd.encode_beat(node.key, node.node_id, node.counter, request.SerializeToString())
        node.waiting, node.sent_at = node.counter, time.perf_counter()
        try:
            node.sock.send(data)
        except OSError:  # nobody listens (ICMP), or a full buffer: a miss, as the client's
            self._missed(node, now)
            self._over_grpc(node, request, node.sent_at)

    def _readable(self, node: _LeanNode) -> None:
        from murmur.protocol import coordinator_pb2 as pb

        while True:
            try:
                data = node.sock.recv(2048)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # an ICMP error for an earlier datagram: its beat's deadline handles it
                continue
            try:
                answer = self.hd.decode_reply(node.key, data)
            except self.hd.BadDatagram:  # not signed under this node's key: not its answer
                continue
            if not node.waiting or answer.counter != node.waiting:
                if answer.counter <= node.counter:  # an earlier beat's, after its wait: a slow coordinator
                    node.misses, node.slow_until = 0, time.time() + self.slow_for_s
                    self.counts["udp_late"] += 1
                continue
            node.waiting, node.misses = 0, 0
            counted = self._counted(node.sent_wall)
            if answer.reply is None:  # "use gRPC": this beat is made there now
                self.counts["udp_fallbacks"] += counted
                self._over_grpc(node, self._request(node), node.sent_at, counted=True)
                continue
            self._took(node, pb.HeartbeatReply.FromString(answer.reply), counted)
            node.busy = False
            if counted:
                self.latencies.append(time.perf_counter() - node.sent_at)
                self.counts["udp_answered"] += 1

    def _missed(self, node: _LeanNode, now: float) -> None:
        node.waiting = 0
        node.misses += 1
        if node.misses >= self.misses_before_pause:
            node.misses, node.paused_until = 0, now + self.pause_s

    def _took(self, node: _LeanNode, reply, counted: bool) -> None:
        client = node.client
        if reply.ban_list_changed:
            client.ban_list_version = reply.ban_list.version
        client.take_view(reply)
        client.view_members.clear()  # a simulated node keeps the view's version, not its members (run_node)
        self.counts["views"] += counted and bool(reply.members)

    def _over_grpc(self, node: _LeanNode, request, t0: float, counted: bool = False) -> None:
        """This beat over gRPC (``counted``: its fallback is counted already)."""
        in_window = self._counted(node.sent_wall)
        if not counted:
            self.counts["udp_fallbacks"] += in_window

        async def beat() -> None:
            try:
                self._took(node, await node.client._grpc_beat(request), in_window)
                if in_window:
                    self.latencies.append(time.perf_counter() - t0)
            except Exception:  # noqa: BLE001 - counted and reported; the node's next beat tries again
                self.counts["errors" if in_window else "warmup_errors"] += 1
            finally:
                node.busy = False

        task = asyncio.ensure_future(beat())
        self.fallbacks.add(task)
        task.add_done_callback(self.fallbacks.discard)


# --- the load worker (a subprocess) ----------------------------------------------------------------


async def _worker(args: argparse.Namespace) -> None:
    import grpc

    from murmur.protocol import coordinator_pb2 as pb
    from murmur.protocol import coordinator_pb2_grpc as pb_grpc
    from murmur.protocol import identity
    from murmur.protocol.coordinator_client import CoordinatorError, MemberClient
    from murmur.protocol.jointoken import JoinToken, fetch_pinned_ca
    from murmur.protocol.version import PROTOCOL_VERSION, version_metadata

    token = JoinToken.parse(args.token)
    ca_pem = fetch_pinned_ca(args.address, token.ca_fingerprint)
    opts = [("grpc.ssl_target_name_override", "murmur-coordinator")]
    clients: list[MemberClient] = []
    gate = asyncio.Semaphore(args.join_concurrency)
    setup_errors: list[str] = []  # calls that failed before the window (retried), by method and status
    latencies: list[float] = []
    commit_latencies: list[float] = []
    trace: list[tuple[float, float, float]] = []  # (scheduled at, start delay, latency): for diagnosis
    lags: list[float] = []  # LeanBeats: how late each beat left against its schedule (the generator's own lag)
    counts = {"commits": 0, "errors": 0, "views": 0, "joined": 0, "open": 0, "udp_answered": 0, "udp_fallbacks": 0,
              "udp_late": 0, "warmup_errors": 0, "beats_skipped": 0}
    phases: dict[str, float] = {}  # seconds each setup phase took in this worker: join, lease, open
    began = time.perf_counter()

    def dump() -> None:
        Path(args.out).write_text(json.dumps({"latencies": latencies, "commit_latencies": commit_latencies,
                                              **counts, "setup_errors": setup_errors, "trace": trace,
                                              "phases": phases, "lags": lags}))

    def cut_short() -> None:  # the driver was told to stop: what was measured so far, then out
        dump()
        os._exit(0)

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, cut_short)
    async with grpc.aio.secure_channel(args.address, grpc.ssl_channel_credentials(ca_pem), options=opts) as ch:
        stub = pb_grpc.CoordinatorStub(ch)

        async def join_one() -> None:
            key = identity.generate_key()
            request = pb.JoinRequest(protocol_version=PROTOCOL_VERSION, token=args.token,
                                     csr_pem=identity.make_csr(key))
            for attempt in range(SETUP_TRIES):  # a failed join is counted and tried again, as a node's would be
                try:
                    async with gate:
                        reply = await stub.Join(request, metadata=version_metadata(), timeout=60)
                    break
                except grpc.aio.AioRpcError as err:
                    setup_errors.append(f"Join {err.code()}")
                    if attempt == SETUP_TRIES - 1:
                        raise
            ident = identity.Identity(key=key, cert_pem=reply.certificate_pem, ca_cert_pem=ca_pem)
            udp = ("", b"")
            if args.heartbeat == "udp":
                udp = (reply.heartbeat_udp_address, bytes(reply.heartbeat_udp_key))
            client = MemberClient(reply.node_address, ident, timeout_s=CALL_TIMEOUT_S,
                                  heartbeat_address=reply.heartbeat_address,  # a front: its first stream there
                                  heartbeat_udp=udp)  # --heartbeat udp: datagrams from the first beat
            client.heartbeat_stream = args.heartbeat != "unary"  # unary: the Heartbeat call of older nodes
            clients.append(client)
            counts["joined"] += 1

        await asyncio.gather(*(join_one() for _ in range(args.nodes)))
    phases["join_s"] = time.perf_counter() - began

    async def acquire(c: MemberClient):
        for attempt in range(SETUP_TRIES):
            try:
                async with gate:
                    return await c.acquire()
            except CoordinatorError as err:
                setup_errors.append(f"AcquireLease {err.code}")
                if attempt == SETUP_TRIES - 1:
                    raise
        return None

    leases = await asyncio.gather(*(acquire(c) for c in clients))
    phases["lease_s"] = time.perf_counter() - began - phases["join_s"]

    def as_trainer(i: int, round_id: int) -> pb.HeartbeatRequest | None:
        if not args.trainers:
            return None
        return pb.HeartbeatRequest(incarnation=f"inc{args.index}-{i}", peer_address=f"10.{args.index}.0.1:{i + 1}",
                                   round=round_id, state_hash=f"{round_id:064x}")

    # Datagram beats through LeanBeats (the default), or through each node's MemberClient as before.
    lean = args.heartbeat == "udp" and args.udp_client == "lean" and bool(clients[0].datagrams.address)
    # A coordinator lists trainers only once it has heard from every live one (one heartbeat TTL
    # after it started serving): wait for that, so the window measures replies with the view.
    # LeanBeats beats all along instead (the warm-up: every node fetches the whole view once, over
    # gRPC, when its datagram's answer says it would not fit), so no node goes silent meanwhile.
    while args.trainers and not lean and not (await clients[0].heartbeat(peer=as_trainer(0, 0))).view_whole:
        await asyncio.sleep(1.0)
    async def beat(i: int, c: MemberClient) -> None:
        # LeanBeats: the first beat is a plain node's (alive, its lease renewed); it comes in as a
        # trainer with LeanBeats' first beat, so the opening does not hand out growing whole views.
        peer = None if lean else as_trainer(i, 0)
        async with gate:
            try:
                await c.heartbeat(peer=peer)
                if c.heartbeat_address and c._front is None:  # a reply moved the stream to a front:
                    await c.heartbeat(peer=peer)  # opened now, not in the window
            except CoordinatorError as err:  # counted and reported; the node's next heartbeat tries again
                setup_errors.append(f"Heartbeat {err.code}")
        counts["open"] += 1
        getattr(c, "view_members", {}).clear()  # see run_node

    # Open every channel before the clock starts (a trainer's first heartbeat changes the view).
    # How far the opening got is on stderr every 10 s: at 10,000 nodes it takes minutes.
    opening = [asyncio.ensure_future(beat(i, c)) for i, c in enumerate(clients)]
    while not all(f.done() for f in opening):
        await asyncio.wait(opening, timeout=10.0)
        print(f"worker {args.index}: {sum(f.done() for f in opening)} of {len(opening)} streams open, "
              f"{len(setup_errors)} setup errors", file=sys.stderr, flush=True)
    phases["open_s"] = time.perf_counter() - began - phases["join_s"] - phases["lease_s"]
    # Tell the driver we are ready; it answers with the common start time once every worker is.
    print("ready", flush=True)
    beats = beating = None
    if lean:  # nodes heartbeat from now on, as they would; the window is what the driver says
        beats = LeanBeats(clients, clients[0].datagrams.address, as_trainer, args.hz, time.time(), args.round_every,
                          args.index * 100_000 + 99_999, latencies, counts, lags)
        beating = asyncio.ensure_future(beats.run())
    args.start_at = float(await asyncio.to_thread(sys.stdin.readline))
    if args.trainers and not lean:  # every worker's trainers are in: one more beat, and each holds the whole view
        await asyncio.gather(*(beat(i, c) for i, c in enumerate(clients)))
    period = 1.0 / args.hz
    start, end = args.start_at, args.start_at + args.seconds
    if beats is not None:
        beats.window(start, end)

    async def run_node(i: int, client: MemberClient, lease: object) -> None:
        rng = random.Random(args.index * 100_000 + i)
        round_id, next_round = 0, start + rng.random() * args.round_every if args.round_every > 0 else float("inf")
        lease = lease.lease  # type: ignore[attr-defined]
        offset = lease.start_offset
        next_beat = start + rng.random() * period if not lean else float("inf")  # lean: LeanBeats sends them
        next_commit = start + rng.random() * args.commit_every if args.commit_every > 0 else float("inf")
        while True:
            t = min(next_beat, next_commit)
            if t >= end:
                return
            await asyncio.sleep(max(0.0, t - time.time()))
            t0 = time.perf_counter()
            try:
                if next_commit <= next_beat:
                    next_commit += args.commit_every
                    await client.commit(lease.lease_id, lease.shard_id, offset, offset + 100, outer_step=1,
                                        loss=1.0, bytes_sent=1000, seconds=1.0)
                    offset += 100
                    counts["commits"] += 1
                    commit_latencies.append(time.perf_counter() - t0)
                else:
                    next_beat += period
                    if t >= next_round:
                        round_id, next_round = round_id + 1, next_round + args.round_every
                    reply = await client.heartbeat(tokens_per_s=100.0, peer=as_trainer(i, round_id))
                    latencies.append(time.perf_counter() - t0)
                    counts["views"] += bool(reply.members)  # replies that listed the view
                    # A simulated node keeps the view's version, not its members: 10,000 copies of a
                    # 10,000-trainer view do not fit this machine (a real node holds one).
                    getattr(client, "view_members", {}).clear()
                    trace.append((round(t - start, 3), round(time.time() - t, 4), latencies[-1]))
            except Exception:  # noqa: BLE001 - counted and reported; the benchmark keeps going
                counts["errors"] += 1

    before = [(c.datagrams.answered, c.datagrams.use_grpc + c.datagrams.missed) for c in clients]
    await asyncio.gather(*(run_node(i, c, lz) for i, (c, lz) in enumerate(zip(clients, leases, strict=True))),
                         *([beating] if beating is not None else []))
    if beats is not None:
        beats.close()
    else:
        for c, (answered, fallbacks) in zip(clients, before, strict=True):  # in the window only
            counts["udp_answered"] += c.datagrams.answered - answered
            counts["udp_fallbacks"] += c.datagrams.use_grpc + c.datagrams.missed - fallbacks
    dump()
    await asyncio.gather(*(c.close() for c in clients))


# --- the driver -------------------------------------------------------------------------------------


def _renice(nice: int, cpus: set[int] | None = None):
    # On a shared build machine other jobs compete for the 2 cores; --nice -10 (root) keeps the
    # measured processes ahead of them. On a bigger machine --coordinator-cpus/--load-cpus pin the
    # coordinator to 2 cores and the load generators to others, so the clients do not steal the
    # coordinator's CPU. Both are recorded in the results' notes.
    if not nice and not cpus:
        return None

    def setup() -> None:
        if nice:
            os.nice(nice)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def _cpu_set(spec: str | None) -> set[int] | None:
    """'0-1' or '0,1,4-7' -> {0, 1, ...}; None stays None."""
    if not spec:
        return None
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _renice_session(nice: int) -> None:
    # With autogroup scheduling (Linux default), niceness only ranks processes within one session;
    # the session's own weight is set here (root), so it applies against other users' jobs too.
    if nice:
        try:
            Path("/proc/self/autogroup").write_text(str(nice))
        except OSError as err:
            print(f"note: could not set the session's priority ({err}); measuring without it", file=sys.stderr)


SHARED = ("what simulated nodes share: a load process runs many of them on one asyncio loop (its CPU, its "
          "gRPC library); each has its own key, certificate, mutual-TLS channel (its own TCP connection) and "
          "lease, and heartbeats on its own schedule over its own stream (or its own unary calls with --unary, "
          "or with --heartbeat udp its own datagram socket, heartbeat key and counter)")


def _commit() -> str:
    """HEAD's short hash, with "+changes" when the tracked files differ from it."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, cwd=here).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class CutShort(Exception):
    """SIGTERM or the --budget ran out: the row is written with what was measured so far."""


def _cut_short(*_: object) -> None:
    raise CutShort()


def _cpu(procs: list) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001 - a process that ended meanwhile counts what it had
            pass
    return total


def measure(nodes: int, hz: float, seconds: float, workers: int, commit_every: float,
            nice: int = 0, coord_cpus: set[int] | None = None,
            load_cpus: set[int] | None = None, trainers: bool = False, round_every: float = 0.0,
            heartbeat: str = "stream", fronts: int = 0, join_concurrency: int = JOIN_CONCURRENCY,
            udp_client: str = "lean", ttl: int = 0, warmup: float = -1.0,
            load_nice: int | None = None) -> dict[str, object]:
    import psutil

    from murmur.protocol import coordinator_pb2 as pb
    from murmur.protocol.admin_client import AdminClient, resolve

    began = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="murmur-load-"))
    # The join grace is longer than joining and leasing every node takes (a node heartbeats only
    # once all of its worker's have joined): a node lost meanwhile loses its lease (at a grace of
    # 500 s, when 10,000 joins took 12-14 minutes, every commit of the two load processes that
    # joined first was refused). Joins are batched now (1-2 minutes for 10,000 here), so the TTL
    # is shorter: with --trainers the view is whole only one TTL after the coordinator started.
    ttl = ttl or max(60, nodes // 100)
    db = tmp / "coord.db"
    coord_log = (tmp / "coordinator.log").open("w")  # its warnings, for a row that fails
    coord = subprocess.Popen(
        [sys.executable, *os.environ.get("LOAD_COORD_PY", "").split(), "-m", "murmur.cli", "coordinator", "serve",
         "--db", str(db), "--listen", "127.0.0.1:0",
         "--node-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--no-dht",
         "--heartbeat-interval", str(1 / hz),
         "--heartbeat-ttl", str(ttl), "--lease-ttl", str(2 * ttl), "--join-grace", str(2 * ttl),
         *(["--heartbeat-fronts", str(fronts)] if fronts else []),
         *([] if heartbeat == "udp" else ["--heartbeat-udp", "off"]),
         *os.environ.get("LOAD_COORD_ARGS", "").split()],
        stdout=subprocess.PIPE, stderr=coord_log, text=True, preexec_fn=_renice(nice, coord_cpus),
    )  # its fronts are its children: they inherit its CPUs and niceness
    procs: list[subprocess.Popen[str]] = []
    outs: list[Path] = []
    phase = "starting"
    kernel_drops: int | None = None
    served_before = served_after = None
    window = 0.0
    busy = main_busy = client_busy = 0.0
    load_before = os.getloadavg()[0]
    try:
        info = json.loads(coord.stdout.readline())  # type: ignore[union-attr]
        serving_at = time.time()  # trainers: its replies list the view one TTL from now
        manifest = json.dumps({"shards": [{"id": i, "tokens": 10**9} for i in range(nodes)]})
        config = 'name = "load"\n[model]\npreset = "tiny"\n'
        with AdminClient(resolve(info["address"], info["admin_key_file"], None)) as admin:
            admin.call("CreateRun", pb.CreateRunRequest(config_toml=config, manifest_json=manifest))
            # Uses for retries too: a join whose reply was lost used one up.
            token = admin.call("CreateToken", pb.CreateTokenRequest(ttl_s=3600, uses=SETUP_TRIES * nodes)).token
        phase = "joining and opening streams"
        for w in range(workers):
            share = nodes // workers + (1 if w < nodes % workers else 0)
            out = tmp / f"worker{w}.json"
            outs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, *os.environ.get("LOAD_WORKER_PY", "").split(), __file__, "--worker",
                 "--address", info["address"], "--token", token,
                 "--nodes", str(share), "--hz", str(hz), "--seconds", str(seconds),
                 "--commit-every", str(commit_every), "--index", str(w), "--out", str(out),
                 "--round-every", str(round_every), "--join-concurrency", str(join_concurrency),
                 "--heartbeat", heartbeat, "--udp-client", udp_client, *(["--trainers"] if trainers else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                preexec_fn=_renice(nice if load_nice is None else load_nice, load_cpus)))
        for p in procs:  # every node joined, leased and connected
            if p.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError("a load worker failed while joining its nodes")
        setup_s = time.time() - began
        if heartbeat == "udp" and udp_client == "lean":
            # LeanBeats beats from "ready" on. Trainers: the window starts once the view is whole and
            # every node had time to fetch it whole (over gRPC, once): the warm-up.
            warm = (warmup if warmup >= 0 else nodes / 250) if trainers else 0.0
            start_at = max(time.time() + 1.0, (serving_at + ttl if trainers else 0.0) + warm)
        else:
            start_at = time.time() + 1.0 + (nodes / 500 if trainers else 0.0)  # trainers beat once more first
        print(f"every node joined and leased in {time.time() - began:.0f} s; the window starts in "
              f"{start_at - time.time():.0f} s", file=sys.stderr, flush=True)
        for p in procs:
            p.stdin.write(f"{start_at}\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        proc = psutil.Process(coord.pid)
        load_before = os.getloadavg()[0]
        # The coordinator's own latency histogram, read just before the window (a scrape of 10,000
        # nodes' metrics holds its loop a while: not inside the window) and right after it.
        time.sleep(max(0.0, start_at - SCRAPE_AHEAD_S - time.time()))
        served_before = _served_histogram(str(info.get("metrics", "")))
        time.sleep(max(0.0, start_at - time.time()))
        phase = "measuring"
        kids = proc.children(recursive=True)  # the heartbeat fronts
        cpu0, main0 = _cpu([proc, *kids]), _cpu([proc])
        wprocs = [psutil.Process(p.pid) for p in procs]
        wcpu0 = _cpu(wprocs)
        t0 = time.time()
        try:
            time.sleep(seconds)
        finally:  # cut short in the window: the CPU over what it measured
            window = min(time.time() - t0, seconds)
            client_busy = _cpu(wprocs) - wcpu0
            busy, main_busy = _cpu([proc, *kids]) - cpu0, _cpu([proc]) - main0
            kernel_drops = _udp_drops(str(info.get("heartbeat_udp", "")))
        for p in procs:  # their last beats are answered by now (or went over gRPC)
            p.wait(timeout=START_TIMEOUT_S + nodes * 0.05)
        served_after = _served_histogram(str(info.get("metrics", "")))
        phase = "done"
        print(f"worker outputs in {tmp}", file=sys.stderr)
    except (CutShort, KeyboardInterrupt, RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"cut short while {phase}: {err!r}; writing what was measured", file=sys.stderr)
        setup_s = time.time() - began if phase != "measuring" else setup_s
    finally:
        signal.alarm(0)
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup itself is not cut short
        for p in procs:  # a worker told to stop writes what it measured (its SIGTERM handler)
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        coord.terminate()
        try:
            coord.wait(timeout=30)
        except subprocess.TimeoutExpired:
            coord.kill()
            coord.wait()
        signal.signal(signal.SIGTERM, previous)
    results = [json.loads(o.read_text()) for o in outs if o.exists() and o.stat().st_size]
    lat = [x for r in results for x in r["latencies"]]
    clat = [x for r in results for x in r["commit_latencies"]]
    commits = sum(r["commits"] for r in results)
    measured = window or seconds
    row: dict[str, object] = {
        "nodes": nodes, "heartbeat_hz": hz, "heartbeat": heartbeat,
        # --heartbeat udp: beats in the window answered by datagram, and those that went over gRPC
        "udp_answered": sum(r.get("udp_answered", 0) for r in results),
        "udp_fallbacks": sum(r.get("udp_fallbacks", 0) for r in results),
        "udp_late": sum(r.get("udp_late", 0) for r in results),  # answers after their beat's wait, all run
        "beats_over_grpc": len(lat) - sum(r.get("udp_answered", 0) for r in results),  # udp: fallbacks, pauses
        "udp_kernel_drops": kernel_drops,  # at the coordinator's socket, since it started (full buffer)
        "heartbeat_fronts": fronts,
        "trainers": trainers, "round_every_s": round_every or None,
        "views_per_s": round(sum(r.get("views", 0) for r in results) / measured, 1),
        "cpu_us_per_call": round(1e6 * busy / max(1, len(lat) + commits), 1),
        "load_processes": workers,
        "commits_per_s": round(commits / measured, 1),
        "p50_ms": round(1000 * _pct(lat, 0.50), 2), "p99_ms": round(1000 * _pct(lat, 0.99), 2),
        # the coordinator's own share (udp): arrival at its socket to reply sent, from its histogram
        # (murmur_heartbeat_datagram_seconds) from SCRAPE_AHEAD_S before the window to its end; a
        # percentile is its bucket's upper bound
        **_served_figures(served_before, served_after),
        # how late the load processes sent beats against their schedule (LeanBeats): their own lag
        "send_lag_p99_ms": round(1000 * _pct(lags, 0.99), 2) if (lags := [x for r in results
                                                                           for x in r.get("lags", [])]) else None,
        "udp_client": udp_client if heartbeat == "udp" else None,
        "cpu_pct": round(100 * busy / measured, 1),  # the coordinator's process and its fronts
        "coordinator_main_cpu_pct": round(100 * main_busy / measured, 1),
        "client_cpu_pct": round(100 * client_busy / measured, 1),
        "heartbeats_per_s": round(len(lat) / measured, 1),
        "commit_p99_ms": round(1000 * _pct(clat, 0.99), 2), "errors": sum(r["errors"] for r in results),
        # heartbeats that failed while every node opened its stream, before the window (by status)
        "setup_errors": dict(Counter(code for r in results for code in r["setup_errors"])),
        "setup_s": round(setup_s, 1),  # from the coordinator's start until every stream was open
        "ttl_s": ttl, "warmup_errors": sum(r.get("warmup_errors", 0) for r in results),
        # LeanBeats: beats not sent because the node's previous one was still in flight (a node
        # heartbeats one at a time), in the window
        "beats_skipped": sum(r.get("beats_skipped", 0) for r in results),
        # each setup phase, the slowest load process's: every node joined, leased, its channel open
        **{k: round(max((r.get("phases", {}).get(k, 0.0) for r in results), default=0.0), 1)
           for k in ("join_s", "lease_s", "open_s")},
        "total_s": round(time.time() - began, 1),
        "load_avg_1m": round(load_before, 2), "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "coordinator_cpus": _spec(coord_cpus), "load_cpus": _spec(load_cpus), "nice": nice,
        "load_nice": nice if load_nice is None else load_nice,
        "commit": _commit(),
    }
    if phase != "done":
        row["cut_short"] = (f"while {phase}: {sum(r.get('joined', 0) for r in results)} joined, "
                            f"{sum(r.get('open', 0) for r in results)} streams open, {window:.1f} s of the window")
    return row


SCRAPE_AHEAD_S = 0.8  # the window's first histogram reading, this long before it starts


def _served_histogram(metrics: str) -> list[tuple[float, int]] | None:
    """The coordinator's murmur_heartbeat_datagram_seconds buckets (cumulative), or None."""
    import math
    import re
    import urllib.request

    if not metrics:
        return None
    try:
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=60) as reply:
            text = reply.read().decode()
    except OSError as err:
        print(f"note: could not read the coordinator's metrics ({err})", file=sys.stderr)
        return None
    found = re.findall(r'^murmur_heartbeat_datagram_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)
    return [(math.inf if le == "+Inf" else float(le), int(float(n))) for le, n in found] or None


def _served_figures(before, after) -> dict[str, object]:
    from murmur.coordinator.latency import quantile, since

    if not before or not after:
        return {"server_beats": None, "server_p50_ms": None, "server_p99_ms": None}
    window = since(after, before)
    return {"server_beats": window[-1][1], "server_p50_ms": round(1000 * quantile(window, 0.50), 3),
            "server_p99_ms": round(1000 * quantile(window, 0.99), 3)}


def _udp_drops(address: str) -> int | None:
    """Datagrams the kernel dropped at the coordinator's UDP port (its receive buffer was full):
    /proc/net/udp's last column (Linux); None where it cannot be read."""
    if not address:
        return None
    port = int(address.rpartition(":")[2])
    total, found = 0, False
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rpartition(":")[2], 16) == port:
                total, found = total + int(fields[-1]), True
    return total if found else None


def _spec(cpus: set[int] | None) -> str:
    return ",".join(str(c) for c in sorted(cpus)) if cpus else "any"


def main() -> int:
    # Stopped with SIGTERM (e.g. by `timeout`) or past --budget, the driver still ends its
    # coordinator and load processes and writes the row it has (measure's CutShort).
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=0, help="one row with this many nodes (default: the table)")
    parser.add_argument("--hz", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per row")
    parser.add_argument("--workers", type=int, default=2, help="load-generator processes")
    parser.add_argument("--commit-every", type=float, default=10.0, help="seconds between a node's commits")
    parser.add_argument("--trainers", action="store_true", help="nodes heartbeat as trainers (the view in replies)")
    parser.add_argument("--round-every", type=float, default=0.0, help="with --trainers: a new round this often")
    parser.add_argument("--heartbeat", choices=("stream", "unary", "udp"), default="stream",
                        help="how nodes heartbeat: their gRPC stream, the unary call, or signed UDP datagrams")
    parser.add_argument("--unary", action="store_true", help="the same as --heartbeat unary")
    parser.add_argument("--udp-client", choices=("lean", "member"), default="lean",
                        help="with --heartbeat udp: beats from LeanBeats (one layer, the same bytes) or each "
                             "node's MemberClient as the node daemon sends them")
    parser.add_argument("--ttl", type=int, default=0,
                        help="the coordinator's heartbeat TTL (join grace and lease TTL twice it); "
                             "default max(60, nodes / 100)")
    parser.add_argument("--warmup", type=float, default=-1.0,
                        help="--trainers with datagrams: seconds of beating after the view is whole, before the "
                             "window (each node fetches the whole view once); default nodes / 250")
    parser.add_argument("--nice", type=int, default=0, help="niceness of the coordinator and load processes")
    parser.add_argument("--load-nice", type=int, default=None,
                        help="niceness of the load processes alone (default --nice): with 19 on a machine too "
                        "small to pin them apart, the coordinator gets the CPU it wants and they what is left")
    parser.add_argument("--coordinator-cpus", help="pin the coordinator to these CPUs, e.g. 0-1")
    parser.add_argument("--load-cpus", help="pin the load generators to these CPUs, e.g. 2-15")
    parser.add_argument("--fronts", type=int, default=0,
                        help="the coordinator's heartbeat front processes (--heartbeat-fronts)")
    parser.add_argument("--join-concurrency", type=int, default=JOIN_CONCURRENCY,
                        help="joins (and stream openings) in flight per load process")
    parser.add_argument("--budget", type=float, default=0.0,
                        help="seconds for the whole run; past them it is cut short and its row written")
    parser.add_argument("--append", action="store_true", help="with --section: add the rows to the section's")
    parser.add_argument("--results", default=str(RESULTS), help="results file")
    parser.add_argument("--no-write", action="store_true", help="print, do not write the results file")
    parser.add_argument("--section", help="write the table under this key of the results file, keeping the rest")
    # worker mode (internal)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--address", "--token", "--out"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(_worker(args))
        return 0
    _renice_session(args.nice)
    signal.signal(signal.SIGTERM, _cut_short)
    signal.signal(signal.SIGALRM, _cut_short)
    if args.budget:
        signal.alarm(max(1, round(args.budget)))
    rows_spec = [(args.nodes, args.hz)] if args.nodes else DEFAULT_ROWS
    rows = []
    for nodes, hz in rows_spec:
        row = measure(nodes, hz, args.seconds, args.workers, args.commit_every, args.nice,
                      _cpu_set(args.coordinator_cpus), _cpu_set(args.load_cpus), args.trainers, args.round_every,
                      "unary" if args.unary else args.heartbeat, args.fronts, args.join_concurrency, args.udp_client,
                      args.ttl, args.warmup, args.load_nice)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if "cut_short" in row:
            break
    if not args.no_write:
        out = Path(args.results)
        out.parent.mkdir(parents=True, exist_ok=True)
        if args.coordinator_cpus:
            where = (f"the coordinator pinned to CPUs {args.coordinator_cpus}, the load generators to "
                     f"{args.load_cpus or 'the rest'}: latency is client-side, an upper bound")
        else:
            where = ("latency is client-side (includes the load generator's own loop delay, on the same 2 cores "
                     "as the coordinator: an upper bound); load_avg_1m is the machine's load before the window "
                     "(other jobs share these 2 cores)")
        table = {
            "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (CPU only)",
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": _commit(),
            "command": "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "notes": f"{where}; {args.workers} load processes; each node commits every {args.commit_every:g} s; "
                     f"cpu_pct is the coordinator process, % of one core; "
                     f"the ledger on disk before each reply (WAL fsynced per group commit); "
                     f"niceness {args.nice}"
                     f"{'' if args.load_nice is None else f' (load processes {args.load_nice})'}; "
                     f"{args.fronts} heartbeat fronts; {SHARED}",
            "rows": rows,
        }
        if args.section:  # beside the file's other tables, which stay as they are
            whole = json.loads(out.read_text()) if out.exists() else {}
            if args.append and args.section in whole:
                table["rows"] = [*whole[args.section].get("rows", []), *rows]
            whole[args.section] = table
            table = whole
        out.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
