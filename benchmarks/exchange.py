"""Benchmark: the gRPC all-reduce over shaped links, and the CPU cost of encode/decode.

    sudo .venv/bin/python benchmarks/exchange.py [--peers 2,4,8] [--numel 100000000] [--rates 100,1000] \
        [--codecs int8,fp32] [--chunk-mb 4] [--threads 1] [--congestion cubic,bbr] [--clients 0,1]

Each peer is its own process in its own network namespace (veth into a bridge), with mutual TLS,
and its upload shaped by ``tc tbf`` to the link rate (tbf works on these machines; their kernel has no netem).
The namespaces use TCP CUBIC, Linux's default, unless ``--congestion`` says otherwise: this host
defaults to BBR, and BBR (v1) behind a deep upload queue that also carries the ACKs of the other
direction stalls single flows for seconds (measured: 82-87% against CUBIC's 92%, same code).
For each group size the peers start once; the driver then sets the rate, starts a round on every
peer at once (stdin), and collects each peer's start/end stamps and payload bytes. A round's
time runs from the last peer's start to the last peer's end (the round cannot finish before the
last member joined). Rows:

  peers, codec, tensor_mb (the update, fp32), link_mbps, seconds,
  sent_mb (payload bytes one peer sends, mean), goodput_mbps (sent bits / seconds),
  link_utilization (goodput / link), expected_mb (the butterfly's 2(N-1)/N of the encoded update),
  cpu_s (CPU seconds of all peers together during the round), cpu_busy (cpu_s / (cores x seconds):
  near 1 means the machine's cores, not the link, bound the round), phase_cpu_s (per peer, mean:
  worker-thread CPU seconds by phase, node/exchange/stats.py; the rest of a peer's CPU time is
  TLS, HTTP/2, protobuf and copies), peak_rss_mb (largest peer's peak resident memory)

and cpu rows: encode/decode seconds of the update by codec on this machine (one thread).

``--clients 0,1`` runs every group size once per count: the last K peers are in client mode (their
namespaces drop inbound SYNs, as a NAT does; docs/protocol.md, "Client mode"). Those rows add
clients, owner_sent_mb / client_sent_mb (payload one peer of each kind sends, mean) with their
expected values, and owner_link_utilization / client_link_utilization. With K clients among N an
owner sends its input to the other owners and its reduced span to every other member,
(N-K-1)/(N-K) + (N-1)/(N-K) of the update; a client sends its whole update once.

Diagnosis: ``--trace DIR`` writes every peer's per-chunk timeline (node/exchange/stats.py Timeline)
and the bytes each peer's upload carried, sampled every 20 ms, per round (``--trace-tcp`` adds
``ss -tinm`` of every peer's connections each 0.5 s); ``benchmarks/exchange_trace.py DIR`` reads
them. ``--ceiling MIB`` first measures plain TCP through the same namespaces and shaping, one way
and both ways at once (``--peers ''``: only that).
Writes benchmarks/results/exchange.json. Needs root (namespaces); cleans up after itself.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PORT = 50051
BRIDGE = "mxb0"
NS = "mx-bench-{}"
SUBNET = "10.77.0.{}"


def sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def set_congestion(ns: str, cc: str) -> None:
    """Choose the namespace's TCP congestion control. Root may pick any algorithm the kernel has,
    but a namespace may only pick one on the host's allowed list: add it there if it is missing."""
    if not cc:
        return
    key = "net.ipv4.tcp_congestion_control"
    if subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={cc}"], capture_output=True).returncode:
        allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
        available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
        if cc not in available:
            raise SystemExit(f"error: TCP congestion control {cc!r} is not available here ({' '.join(available)})")
        sh("sysctl", "-qw", f"net.ipv4.tcp_allowed_congestion_control={' '.join([*allowed, cc])}")
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={cc}")


def congestion_of(ns: str) -> str:
    """The TCP congestion control a namespace's connections use (what a row records)."""
    return subprocess.run(
        ["ip", "netns", "exec", ns, "cat", "/proc/sys/net/ipv4/tcp_congestion_control"],
        capture_output=True,
        text=True,
    ).stdout.strip()


def net_up(n: int, cc: str) -> None:
    """n namespaces on one bridge, each with TCP congestion control ``cc`` ('': the host's)."""
    net_down(n)
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "link", "set", BRIDGE, "up")
    # Hosts with Docker filter bridged traffic (br_netfilter, FORWARD policy DROP): without this
    # every SYN between two namespaces is dropped and the peers wait forever.
    sh(*forward_rule("-I"), check=False)
    for i in range(n):
        ns = NS.format(i)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", f"mxh{i}", "type", "veth", "peer", "name", f"mxp{i}")
        sh("ip", "link", "set", f"mxp{i}", "netns", ns)
        sh("ip", "link", "set", f"mxh{i}", "master", BRIDGE)
        sh("ip", "link", "set", f"mxh{i}", "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{SUBNET.format(i + 1)}/24", "dev", f"mxp{i}")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", f"mxp{i}", "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        set_congestion(ns, cc)


TBF_LATENCY = "200ms"  # the most a packet may wait in a peer's upload queue (--tbf-latency)


def set_rate(n: int, mbps: int) -> None:
    """Shape each peer's upload (egress of its namespace end) with a token bucket."""
    burst = max(32_000, mbps * 1_000_000 // 8 // 250)  # ~4 ms of traffic
    for i in range(n):
        sh(
            "ip",
            "netns",
            "exec",
            NS.format(i),
            "tc",
            "qdisc",
            "replace",
            "dev",
            f"mxp{i}",
            "root",
            "tbf",
            "rate",
            f"{mbps}mbit",
            "burst",
            str(burst),
            "latency",
            TBF_LATENCY,
        )


def forward_rule(op: str) -> list[str]:
    """The iptables rule (``op``: -I inserts, -D deletes) that lets the bridge's own traffic through."""
    return ["iptables", op, "FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]


def net_down(n: int) -> None:
    while shutil.which("iptables") and subprocess.run(forward_rule("-D"), capture_output=True).returncode == 0:
        pass  # every copy a crashed run left behind
    for i in range(max(n, 8)):
        sh("ip", "netns", "del", NS.format(i), check=False)
        sh("ip", "link", "del", f"mxh{i}", check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


# --- one peer (runs inside its namespace) ---------------------------------------------------------


def load() -> str:
    """The machine's load averages over 1, 5 and 15 minutes (other jobs share these cores)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def peer_main(args: argparse.Namespace) -> int:
    import resource

    import torch

    torch.set_num_threads(args.threads)
    from murmur.node.exchange.group import StaticGroup
    from murmur.node.exchange.peer import PeerSpec, build_peer
    from murmur.node.exchange.settings import ExchangeSettings
    from murmur.node.net.loop import LoopThread
    from murmur.node.net.server import PeerServerSettings
    from murmur.optim.codecs import make_codec
    from murmur.protocol.identity import Identity
    from murmur.protocol.reachability import CLIENT_ADDRESS

    root = Path(args.dir)
    ident = Identity.load(root / str(args.peer))
    ids = [Identity.load(root / str(i)).node_id for i in range(args.n)]
    loop = LoopThread()
    first_client = args.n - int(args.clients)  # the last peers are in client mode
    client = args.peer >= first_client

    def address(i: int) -> str:
        return CLIENT_ADDRESS if i >= first_client else f"{SUBNET.format(i + 1)}:{PORT}"

    spec = PeerSpec(
        identity=ident,
        run_id="bench",
        codec=make_codec("fp32"),
        group=StaticGroup({nid: address(i) for i, nid in enumerate(ids)}),
        client_mode=client,
        settings=ExchangeSettings(
            peer_timeout=120,
            round_deadline=1200,
            max_payload_bytes=2 << 30,
            chunk_mb=args.chunk_mb,
            keep_results=1,  # publish only the newest result: each is a copy of the update's size
        ),
        server=PeerServerSettings(host=SUBNET.format(args.peer + 1), port=PORT),
    )
    peer = build_peer(spec, loop)
    ex, server = peer.exchange, peer.server
    ex.timeline.enabled = bool(args.trace)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.peer))
    print(json.dumps({"event": "ready"}), flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "exit":
                break
            round_id, codec, numel = int(cmd[1]), cmd[2], int(cmd[3])
            ex.codec = make_codec(codec)  # rounds run one after another: every peer switches first
            phases0, cpu0 = ex.times.snapshot(), time.process_time()
            start = time.time()
            res = ex.all_reduce([x[:numel]], round_id=round_id, key="bench").result()
            end = time.time()
            cpu = time.process_time() - cpu0
            phases = {k: round(v - phases0.get(k, 0.0), 3) for k, v in ex.times.snapshot().items()}
            if args.trace:
                events = ex.timeline.take()
                names = {nid: i for i, nid in enumerate(ids)}
                for _, _, f in events:
                    if "peer" in f:
                        f["peer"] = names.get(f["peer"], f["peer"])
                Path(args.trace, f"peer{args.peer}_round{round_id}.json").write_text(
                    json.dumps({"start": start, "end": end, "events": events})
                )
            del res.tensors[:]  # every peer completed: the result (and its published copy for peers
            server.states.clear()  # catching up) need not live into the next round
            print(
                json.dumps(
                    {
                        "event": "round",
                        "start": start,
                        "end": end,
                        "sent": res.bytes_sent,
                        "received": res.bytes_received,
                        "members": len(res.members),
                        "cpu": cpu,
                        "phases": phases,
                        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    }
                ),
                flush=True,
            )
    finally:
        loop.run(peer.aclose())
        loop.stop()
    return 0


class LinkSampler:
    """(time, [bytes each peer's upload carried so far]) every ``period`` s (--trace): the host end
    of each veth receives exactly what the peer's shaped upload sent, headers included."""

    def __init__(self, n: int, period: float = 0.02, tcp_info: bool = False) -> None:
        import threading

        self.paths = [Path(f"/sys/class/net/mxh{i}/statistics/rx_bytes") for i in range(n)]
        self.samples: list[tuple[float, list[int]]] = []
        self.ss: list = []  # (time, peer, `ss -tinm` of its connections) every 0.5 s if tcp_info
        self.tcp_info = tcp_info
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        k = 0
        while not self._stop.is_set():
            self.samples.append((time.time(), [int(p.read_text()) for p in self.paths]))
            if self.tcp_info and k % 25 == 0:
                for i in range(len(self.paths)):
                    out = subprocess.run(["ip", "netns", "exec", NS.format(i), "ss", "-tinm", "state", "established"],
                                         capture_output=True, text=True).stdout
                    self.ss.append((time.time(), i, out))
            k += 1
            self._stop.wait(period)

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.samples


# --- the link's own ceiling: plain TCP through the same namespaces and shaping ---------------------

_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
print(n, time.time(), flush=True)
"""
_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])): c.sendall(buf)
c.close()
"""


def tcp_ceiling(rate: int, mb: int, cc: str) -> list[dict]:
    """Payload goodput of one plain TCP connection through a shaped upload, one way and in both
    directions at once (as the butterfly's traffic is): the most any exchange can show here."""
    net_up(2, cc)
    rows = []
    try:
        set_rate(2, rate)
        cc = congestion_of(NS.format(0))
        for senders in ([0], [0, 1]):
            sinks = {
                i: subprocess.Popen(
                    ["ip", "netns", "exec", NS.format(1 - i), sys.executable, "-c", _SINK]
                    + [SUBNET.format(2 - i), "6001"],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for i in senders
            }
            time.sleep(1.0)  # the sinks listen
            t0 = time.time()
            sources = [
                subprocess.Popen(
                    ["ip", "netns", "exec", NS.format(i), sys.executable, "-c", _SOURCE]
                    + [SUBNET.format(2 - i), "6001", str(mb)]
                )
                for i in senders
            ]
            for p in sources:
                p.wait(600)
            ends = [float(p.communicate(timeout=600)[0].split()[1]) for p in sinks.values()]
            seconds = max(ends) - t0
            rows.append(
                {
                    "kind": "tcp_ceiling",
                    "direction": "one way" if len(senders) == 1 else "both ways at once",
                    "link_mbps": rate,
                    "payload_mb": round(mb * 1.048576, 1),
                    "seconds": round(seconds, 2),
                    "link_utilization": round(mb * (1 << 20) * 8 / seconds / 1e6 / rate, 3),
                    "congestion_control": cc,
                    "load": load(),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        net_down(2)
    return rows


# --- the driver ------------------------------------------------------------------------------------


def cpu_rows(numel: int, codecs: list[str]) -> list[dict]:
    import torch

    from murmur.optim.codecs import make_codec

    torch.set_num_threads(1)
    x = torch.randn(numel)
    rows = []
    for name in codecs:
        c = make_codec(name)
        t0 = time.perf_counter()
        w = c.encode_stateless(x, "k")
        t1 = time.perf_counter()
        c.decode(w)
        t2 = time.perf_counter()
        rows.append(
            {
                "kind": "cpu",
                "codec": name,
                "tensor_mb": round(numel * 4 / 1e6, 1),
                "wire_mb": round(w.nbytes / 1e6, 1),
                "encode_s": round(t1 - t0, 3),
                "decode_s": round(t2 - t1, 3),
            }
        )
    return rows


def run_group(
    n: int,
    plan: list[tuple[int, str, int]],
    root: Path,
    numel: int,
    env: dict,
    args: argparse.Namespace,
    cc: str,
    clients: int = 0,
) -> list[dict]:
    net_up(n, cc)
    cc = congestion_of(NS.format(0))  # what the peers really use ('' asked for the host's)
    for i in range(n - clients, n):  # behind a NAT: replies get in, a SYN from outside does not
        sh("ip", "netns", "exec", NS.format(i), "iptables", "-A", "INPUT", "-p", "tcp", "--syn", "-j", "DROP")
    procs = []
    rows = []
    try:
        for i in range(n):
            cmd = [
                "ip",
                "netns",
                "exec",
                NS.format(i),
                sys.executable,
                str(Path(__file__).resolve()),
                "--peer",
                str(i),
                "--n",
                str(n),
                "--dir",
                str(root),
                "--numel",
                str(numel),
                "--chunk-mb",
                str(args.chunk_mb),
                "--threads",
                str(args.threads),
                "--clients",
                str(clients),
                *(["--trace", args.trace] if args.trace else []),
            ]
            procs.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            )
        for p in procs:
            assert json.loads(p.stdout.readline())["event"] == "ready"
        round_id = 0
        for rate, codec, count in [(1000, "fp32", 4096)] + plan:  # the first round opens the TLS channels
            set_rate(n, rate)
            round_id += 1
            sampler = LinkSampler(n, tcp_info=args.trace_tcp) if args.trace and round_id > 1 else None
            for p in procs:
                p.stdin.write(f"round {round_id} {codec} {count}\n")
                p.stdin.flush()
            results = [json.loads(p.stdout.readline()) for p in procs]
            if sampler is not None:
                Path(args.trace, f"link_round{round_id}.json").write_text(json.dumps(sampler.stop()))
                Path(args.trace, f"ss_round{round_id}.json").write_text(json.dumps(sampler.ss))
            if round_id == 1:
                continue
            seconds = max(r["end"] for r in results) - max(r["start"] for r in results)
            sent = sum(r["sent"] for r in results) / n
            wire_mb = {"fp32": 4, "fp16": 2, "int8": 1 + 4 / 64, "int4": 0.5 + 4 / 64}[codec] * count / 1e6
            row = {
                "peers": n,
                "codec": codec,
                "tensor_mb": round(count * 4 / 1e6, 1),
                "link_mbps": rate,
                "seconds": round(seconds, 2),
                "sent_mb": round(sent / 1e6, 1),
                "expected_mb": round(2 * (n - 1) / n * wire_mb, 1),
                "goodput_mbps": round(sent * 8 / seconds / 1e6, 1),
                "link_utilization": round(sent * 8 / seconds / 1e6 / rate, 3),
                "cpu_s": round(sum(r["cpu"] for r in results), 1),
                "cpu_busy": round(sum(r["cpu"] for r in results) / ((os.cpu_count() or 1) * seconds), 2),
                "phase_cpu_s": {
                    k: round(sum(r["phases"].get(k, 0.0) for r in results) / n, 2)
                    for k in sorted({k for r in results for k in r["phases"]})
                },
                "peak_rss_mb": round(max(r["rss_mb"] for r in results)),
                "congestion_control": cc,
                "load": load(),
            }
            if clients:
                owners, mine = results[: n - clients], results[n - clients :]
                k = n - clients
                owner_sent = sum(r["sent"] for r in owners) / len(owners)
                client_sent = sum(r["sent"] for r in mine) / len(mine)
                row.update(
                    clients=clients,
                    expected_mb=None,  # the butterfly's bound does not apply: see the two below
                    owner_sent_mb=round(owner_sent / 1e6, 1),
                    owner_expected_mb=round(((k - 1) / k + (n - 1) / k) * wire_mb, 1),
                    client_sent_mb=round(client_sent / 1e6, 1),
                    client_expected_mb=round(wire_mb, 1),
                    owner_link_utilization=round(owner_sent * 8 / seconds / 1e6 / rate, 3),
                    client_link_utilization=round(client_sent * 8 / seconds / 1e6 / rate, 3),
                )
            print(json.dumps(row), flush=True)
            rows.append(row)
        for p in procs:
            p.stdin.write("exit\n")
            p.stdin.flush()
        for p in procs:
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        net_down(n)
    return rows


def main() -> int:
    global TBF_LATENCY
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--peers", default="2,4,8")
    ap.add_argument("--clients", default="0", help="client-mode peers per group, comma-separated (a row each)")
    ap.add_argument("--numel", type=int, default=100_000_000, help="parameters of the update")
    ap.add_argument("--rates", default="100,1000", help="link rates, Mbit/s")
    ap.add_argument("--codecs", default="int8,fp32", help="codecs for every group size")
    ap.add_argument("--fp32-peers", default="", help="group sizes that also run fp32")
    ap.add_argument("--chunk-mb", type=float, default=4.0, help="ExchangeSettings.chunk_mb")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per peer process")
    ap.add_argument("--tbf-latency", default="200ms", help="tc tbf queue limit of each upload, e.g. 200ms")
    ap.add_argument(
        "--congestion",
        default="cubic",
        help="TCP congestion control in the peers' namespaces, comma-separated to run every row with each "
        "(cubic: Linux's default; '' keeps this host's)",
    )
    ap.add_argument(
        "--ceiling",
        type=int,
        default=0,
        help="MiB: first measure plain TCP through the same shaping (--peers '' for only that)",
    )
    ap.add_argument("--trace", default="", help="directory: per-chunk timelines and upload byte counts")
    ap.add_argument("--trace-tcp", action="store_true", help="with --trace: `ss -tinm` of every peer each 0.5 s")
    ap.add_argument("--notes", default="", help="appended to the JSON's notes")
    ap.add_argument("--out", default=str(HERE / "results" / "exchange.json"))
    args = ap.parse_args()
    if args.peer >= 0:
        return peer_main(args)
    TBF_LATENCY = args.tbf_latency
    congestions = args.congestion.split(",")
    if args.trace:  # the peers write into it from their own namespaces
        args.trace = str(Path(args.trace).resolve())
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        print("error: the benchmark needs root for network namespaces (tc tbf)", file=sys.stderr)
        return 1
    from murmur.protocol.identity import CertificateAuthority

    peers = [int(p) for p in args.peers.split(",") if p]
    rates = [int(r) for r in args.rates.split(",")]
    codecs = args.codecs.split(",")
    fp32_peers = {int(p) for p in args.fp32_peers.split(",") if p}
    rows: list[dict] = []
    loads: list[str] = []
    if args.ceiling:
        for cc in congestions:
            for rate in rates:
                rows += tcp_ceiling(rate, args.ceiling, cc)
        if not args.peers:
            print(json.dumps(rows))
            return 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="murmur-bench-") as tmp:
        ca = CertificateAuthority.create("bench")
        for i in range(max(peers)):
            ca.issue().save(Path(tmp) / str(i))
        for n in peers:
            plan = [(r, c, args.numel) for r in rates for c in codecs]
            if n in fp32_peers:
                plan += [(r, "fp32", args.numel) for r in rates]
            for cc in congestions:
                for k in [int(c) for c in str(args.clients).split(",") if c and int(c) < n]:
                    loads.append(f"{n} peers, {k} in client mode ({cc or 'host default'}): load {load()} before")
                    rows += run_group(n, plan, Path(tmp), args.numel, env, args, cc, clients=k)
    rows += cpu_rows(args.numel, sorted(set(codecs) | {"fp32"}))
    out = {
        "device": (
            f"{platform.node()} CPU ({os.cpu_count()} cores, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB), every peer a "
            f"process in its own network namespace (veth + bridge), upload shaped by tc tbf; "
            f"load averages (1, 5, 15 min): {'; '.join(loads)}; {load()} at the end"
        ),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/exchange.py", *sys.argv[1:]]),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip(),
        "notes": (
            "seconds: last peer's start to last peer's end. sent_mb: payload bytes a peer puts on the "
            "wire (its spans to the owners + its reduced span to the others); goodput counts payload "
            "only, not TLS/HTTP2/protobuf framing. All peers share this machine's cores, so at 1 Gbit/s "
            "the CPU (encode, TLS, copies) bounds the result, not the link. " + args.notes
        ),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
