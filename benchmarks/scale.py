"""A run of many peers: rounds completed, one result hash, seconds and bytes per round (issue 49).

    python benchmarks/scale.py                                   # 8, 16, 32, 64 peers on loopback
    python benchmarks/scale.py --peers 16,32 --group-size 8      # bounded groups (sync.group_size=8)
    python benchmarks/scale.py --peers 16 --kills 4              # one peer SIGKILLed in each of 4 rounds
    sudo python benchmarks/scale.py --wan                        # 16 peers, 100 Mbit/s links, 50 ms RTT
    python benchmarks/scale.py --sim                             # the 1,000-peer simulation
    python3 benchmarks/scale.py --peers 64 --group-size 16 --kills 4 --commit abc1234   # a copy without .git

Real exchange peers: each has its own identity (a certificate of the run's CA), its own TLS peer
server on its own socket, its own DHT records signed with its own key, and meets the others at
the DHT rendezvous of a real bootstrap DHT, exactly as node/testnet/exchange_peer_process.py does.
To fit 64 peers on 2 cores, ``--per-process`` peers share one process (its event loop and one DHT
process: node/testnet/peer_host.py); a peer that ``--kills`` will SIGKILL has a process of its own.
Each round every peer all-reduces a deterministic update of ``--numel`` elements in ``--codec``.

Group size: ``--group-size G`` reaches every peer as the run-config override
``sync.group_size=G`` (protocol/runconfig.py); a tree whose run config lacks that key refuses it
in one line. Without it every round is one group of all peers.

Where: any machine with the node's Python packages (grpcio, protobuf, cryptography, psutil,
pydantic, hivemind with its p2pd; no GPU, no network beyond loopback). Nothing is pinned: each row
records ``cpus`` (os.cpu_count(), part of its key: a 16-core host's row does not replace the 2-core
machine's), the 1-minute load before (``load_avg_1m_before``: what else ran) and after it, and the
device. ``--commit`` names the tree where git cannot (a copy of it without .git).

A row (benchmarks/results/scale.json, merged by its key so separate runs add up):
  peers, group_size (null: one group of all), numel, codec, link, kills, rounds,
  rounds_complete (every peer not killed got a result, and all results have one hash),
  one_hash (every round's results had one hash), seconds_per_round (from the common start to the
  last result of the last round, over rounds), bytes_per_peer (payload one peer sends in a round,
  mean), dht_failures (round errors that name the DHT), plus processes, load_avg_1m and the errors.

``--wan`` puts each peer in a network namespace of its own (benchmarks/exchange.py's bridge and
``tc tbf`` upload shaping) and delays every packet between namespaces in user space (this kernel
has no netem): benchmarks/wan_delay.py. Needs root; without namespaces it says so in one line and
writes nothing. ``--sim`` calls ``simulate_rounds`` of the groups simulation (SIM_MODULE) for
1,000 peers, where the tree has it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "scale.json"
DEFAULT_PEERS = (8, 16, 32, 64)
RUN = "scale"
START_TIMEOUT_S = 300.0  # every host process up (torch, hivemind, a DHT each) on a busy 2-core machine
# The groups engineer's simulation: simulate_rounds(peers, group_size, numel, codec, kills_per_round,
# rounds, seed) -> dict with rounds_complete and bytes_per_peer (issue 49, "Beyond what one machine holds").
SIM_MODULE = "murmur.node.exchange.simulate"
SIM_PEERS = 1000
# cpus: a row of the 16-core host and one of the 2-core build machine are two rows, not one.
ROW_KEY = ("peers", "group_size", "numel", "codec", "link", "kills", "rounds", "cpus")


class ArgError(Exception):
    """A bad command line: one line, what is wrong and what to do."""


# --- the arguments ----------------------------------------------------------------------------------


def peer_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ArgError(f"--peers {text!r} must be whole numbers separated by commas, e.g. 8,16,32") from None
    if not counts or any(n < 2 for n in counts):
        raise ArgError(f"--peers {text!r}: every count must be at least 2 (a round needs two peers)")
    return counts


def check_args(args: argparse.Namespace) -> None:
    """Refuse what cannot make a meaningful row, each in one line."""
    args.peer_counts = [16] if args.wan and args.peers is None else peer_counts(args.peers or "8,16,32,64")
    if args.rounds < 1:
        raise ArgError(f"--rounds {args.rounds}: run at least one round")
    if args.numel < 1:
        raise ArgError(f"--numel {args.numel}: the update needs at least one element")
    if args.group_size is not None and args.group_size < 2:
        raise ArgError(f"--group-size {args.group_size}: a group needs at least 2 peers (leave it out for one group)")
    if args.per_process < 1:
        raise ArgError(f"--per-process {args.per_process}: at least one peer a process")
    if args.kills < 0 or args.kills > args.rounds:
        raise ArgError(f"--kills {args.kills}: one peer is killed a round, so 0 to --rounds ({args.rounds})")
    for n in args.peer_counts:
        if 2 * args.kills >= n:
            raise ArgError(f"--kills {args.kills} with {n} peers kills half the run or more: a round needs a "
                           "majority of its peers; use fewer kills or more peers")
    if args.wan and (args.rtt_ms < 0 or args.rate_mbit <= 0):
        raise ArgError("--rtt-ms must be >= 0 and --rate-mbit > 0")
    from murmur.optim.codecs import make_codec

    try:
        make_codec(args.codec)
    except Exception as err:  # noqa: BLE001 - the codec's own message says what is known
        raise ArgError(f"--codec {args.codec!r}: {err}") from None
    if args.group_size is not None:
        from murmur.node.testnet.peer_host import run_config
        from murmur.protocol.runconfig import ConfigError

        try:
            run_config([f"sync.group_size={args.group_size}"])
        except ConfigError as err:
            raise ArgError(f"--group-size needs the run-config key sync.group_size, which this tree refuses ({err}); "
                           "leave --group-size out for the single-group rows") from None


# --- one row ----------------------------------------------------------------------------------------


@dataclass
class Host:
    """One host process: its peers and where its lines go."""

    proc: subprocess.Popen[str]
    node_ids: list[str] = field(default_factory=list)
    victim: bool = False


def _reader(host: Host, lines: queue.Queue) -> None:
    assert host.proc.stdout is not None
    for line in host.proc.stdout:
        if line.startswith("{"):
            try:
                lines.put((host, json.loads(line)))
            except json.JSONDecodeError:
                pass
    lines.put((host, None))  # this process ended


def _bootstrap(tmp: Path, wrap: list[str], host: str) -> tuple[subprocess.Popen[str], str]:
    boot = subprocess.Popen([*wrap, sys.executable, __file__, "--dht-boot", str(tmp / "ca.crt"), "--dht-host", host],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = (boot.stdout.readline() if boot.stdout else "").split()  # type: ignore[union-attr]
    if ready[:1] != ["ready"]:
        boot.kill()
        boot.wait()
        raise RuntimeError("the bootstrap DHT did not start")
    return boot, ready[1]


def layout(peers: int, per_process: int, kills: int) -> list[tuple[int, bool]]:
    """How many peers each host process holds, and whether it is a kill victim (alone in it)."""
    hosts = [(1, True) for _ in range(kills)]
    rest = peers - kills
    while rest > 0:
        hosts.append((min(per_process, rest), False))
        rest -= hosts[-1][0]
    return hosts


def run_row(args: argparse.Namespace, peers: int, link: str, netns: list[tuple[str, str]] | None = None) -> dict:
    """Start the peers, release their rounds at once, SIGKILL a victim per round, collect the row.
    ``netns``: (namespace, its address) for each host process (the WAN row), else loopback."""
    from murmur.protocol.identity import CertificateAuthority

    load_before = os.getloadavg()[0]  # what else was running: the row's own load comes after
    tmp = Path(tempfile.mkdtemp(prefix="murmur-scale-"))
    ca = CertificateAuthority.create("scale-bench")
    (tmp / "ca.crt").write_bytes(ca.cert_pem)
    shape = layout(peers, 1 if netns else args.per_process, args.kills)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    hosts: list[Host] = []
    lines: queue.Queue = queue.Queue()
    boot, boot_address = _bootstrap(tmp, ["ip", "netns", "exec", netns[0][0]] if netns else [],
                                    netns[0][1] if netns else "127.0.0.1")
    overrides = [] if args.group_size is None else ["--set", f"sync.group_size={args.group_size}"]
    try:
        made = 0
        for h, (count, victim) in enumerate(shape):
            dirs = []
            for _ in range(count):
                ca.issue().save(tmp / f"peer{made}")
                dirs += ["--identity", str(tmp / f"peer{made}")]
                made += 1
            wrap = ["ip", "netns", "exec", netns[h][0]] if netns else []
            host = netns[h][1] if netns else "127.0.0.1"
            proc = subprocess.Popen(
                [*wrap, *(["nice", "-n", str(args.nice)] if args.nice else []), sys.executable, "-m",
                 "murmur.node.testnet.peer_host", *dirs, "--run", RUN, "--bootstrap", boot_address,
                 "--peers", str(peers), "--rounds", str(args.rounds), "--numel", str(args.numel),
                 "--codec", args.codec, "--peer-timeout", str(args.peer_timeout),
                 "--round-deadline", str(args.round_deadline), "--rendezvous-deadline", str(args.rendezvous_deadline),
                 "--record-ttl", str(args.record_ttl), "--host", host, *overrides],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp / f"host{h}.log", "w"),  # noqa: SIM115
                text=True, env=env, cwd=REPO)
            hosts.append(Host(proc, victim=victim))
            threading.Thread(target=_reader, args=(hosts[-1], lines), daemon=True).start()
        records = collect(args, peers, hosts, lines)
    finally:
        for host in hosts:
            if host.proc.poll() is None:
                host.proc.send_signal(signal.SIGTERM)
        for host in hosts:
            try:
                host.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                host.proc.kill()
                host.proc.wait()
        if boot.stdin:
            boot.stdin.close()
        try:
            boot.wait(timeout=60)
        except subprocess.TimeoutExpired:
            boot.kill()
            boot.wait()
    row = summarize(args, peers, link, records, processes=len(hosts) + 1)
    row["load_avg_1m_before"] = round(load_before, 2)
    if args.keep_logs:  # the host processes' logs and every round line, for a diagnosis
        (tmp / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records.rounds))
        print(f"logs kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return row


@dataclass
class Records:
    go: float = 0.0
    rounds: list[dict] = field(default_factory=list)  # every round line of every peer
    killed: dict[str, int] = field(default_factory=dict)  # node id -> the round it was killed in
    timed_out: bool = False
    group_size: int | None = None  # the peers' bound on a round group (None: one group of all)


def collect(args: argparse.Namespace, peers: int, hosts: list[Host], lines: queue.Queue) -> Records:
    """Wait for every peer's ready line, start the rounds, kill a victim per round, read the rounds."""
    rec = Records()
    ready = 0
    deadline = time.monotonic() + START_TIMEOUT_S
    while ready < peers:
        try:
            host, msg = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"only {ready} of {peers} peers started within {START_TIMEOUT_S:.0f} s") from None
        if msg is None:
            raise RuntimeError(f"a host process exited while starting (status {host.proc.wait()}); see its log")
        if msg.get("event") == "ready":
            host.node_ids.append(msg["node_id"])
            rec.group_size = msg.get("group_size")
            ready += 1
    rec.go = time.time()
    for host in hosts:
        assert host.proc.stdin is not None
        host.proc.stdin.write("go\n")
        host.proc.stdin.flush()
    victims = [h for h in hosts if h.victim]
    kill_at = time.monotonic() + args.kill_after  # round 1's kill, then one after each round starts
    round_started = {1}
    last_round: dict[str, int] = {}  # node id -> the last round it reported
    ended = 0
    deadline = time.monotonic() + args.rounds * (args.round_deadline + args.rendezvous_deadline) + 60
    while ended < len(hosts):
        timeout = min(deadline, kill_at if victims else deadline) - time.monotonic()
        try:
            host, msg = lines.get(timeout=max(0.05, timeout))
        except queue.Empty:
            msg, host = None, None
        now = time.monotonic()
        if victims and now >= kill_at:
            victim = victims.pop(0)
            victim.proc.send_signal(signal.SIGKILL)
            # The round it dies in: the one after its last reported round (the next round "starts"
            # with the first peer's line of this one; a slower victim may still be in this one).
            rec.killed[victim.node_ids[0]] = last_round.get(victim.node_ids[0], 0) + 1
            kill_at = float("inf")
        if now >= deadline:
            rec.timed_out = True
            break
        if host is None:
            continue
        if msg is None:
            ended += 1
            continue
        if msg.get("event") != "round":
            continue
        rec.rounds.append(msg)
        last_round[msg["node_id"]] = max(last_round.get(msg["node_id"], 0), msg["round"])
        nxt = msg["round"] + 1
        if nxt <= args.rounds and nxt not in round_started:  # the first peer to start the next round
            round_started.add(nxt)
            if victims:
                kill_at = now + args.kill_after
    return rec


def summarize(args: argparse.Namespace, peers: int, link: str, rec: Records, processes: int) -> dict:
    complete, one_hash, errors = 0, True, []
    bytes_sent = [r["bytes_sent"] for r in rec.rounds if r.get("ok")]
    everyone = {r["node_id"] for r in rec.rounds} | set(rec.killed)
    last_end = rec.go
    for r in range(1, args.rounds + 1):
        lines = [x for x in rec.rounds if x["round"] == r]
        survivors = {n for n in everyone if rec.killed.get(n, args.rounds + 1) > r}
        ok = {x["node_id"]: x["hash"] for x in lines if x.get("ok")}
        hashes = set(ok.values())
        one_hash &= len(hashes) <= 1
        if len(hashes) == 1 and survivors <= set(ok):
            complete += 1
        errors += [x["error"] for x in lines if not x.get("ok")]
        last_end = max([last_end, *(x["t1"] for x in lines)])
    return {
        "peers": peers,
        "group_size": rec.group_size,
        "numel": args.numel,
        "codec": args.codec,
        "link": link,
        "kills": len(rec.killed),
        "rounds": args.rounds,
        "rounds_complete": complete,
        "one_hash": one_hash,
        "seconds_per_round": round((last_end - rec.go) / args.rounds, 2) if rec.rounds else None,
        "bytes_per_peer": round(sum(bytes_sent) / len(bytes_sent)) if bytes_sent else None,
        "dht_failures": sum("DHT" in e for e in errors),
        "processes": processes,
        "cpus": os.cpu_count(),
        "record_ttl_s": args.record_ttl,
        "timed_out": rec.timed_out,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "errors": sorted(set(errors))[:5],
    }


# --- the WAN row ------------------------------------------------------------------------------------


def wan_row(args: argparse.Namespace, peers: int) -> dict | None:
    """``peers`` peers, one a namespace, 100 Mbit/s uploads and ``--rtt-ms`` between any two."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("skipped the WAN row: it needs root with ip and tc (network namespaces); run it with sudo",
              file=sys.stderr)
        return None
    sys.path.insert(0, str(HERE))
    import exchange as net  # benchmarks/exchange.py: the bridge, the namespaces, the tbf shaping
    import wan_delay

    try:
        net.net_up(peers, "cubic")
    except subprocess.CalledProcessError as err:
        net.net_down(peers)
        print(f"skipped the WAN row: network namespaces are not available here ({err})", file=sys.stderr)
        return None
    delayer = None
    try:
        net.set_rate(peers, args.rate_mbit)
        delayer = wan_delay.start(net.BRIDGE, args.rtt_ms / 2) if args.rtt_ms else None
        link = f"{args.rate_mbit}mbit-{args.rtt_ms:g}ms-rtt" + ("" if delayer or not args.rtt_ms else "-nodelay")
        return run_row(args, peers, link, netns=[(net.NS.format(i), net.SUBNET.format(i + 1)) for i in range(peers)])
    finally:
        if delayer is not None:
            delayer.stop()
        net.net_down(peers)


# --- the simulation ---------------------------------------------------------------------------------


def sim_row(args: argparse.Namespace) -> dict | None:
    """The 1,000-peer row, from the groups simulation (same formation and failure rules, simulated
    transport). Skipped in one line where the tree has no simulation yet."""
    try:
        sim = importlib.import_module(SIM_MODULE)
    except ImportError:
        print(f"skipped the --sim row: this tree has no {SIM_MODULE}.simulate_rounds yet (the groups branch adds it)",
              file=sys.stderr)
        return None
    group = args.group_size or 16
    t0 = time.monotonic()
    out = sim.simulate_rounds(peers=SIM_PEERS, group_size=group, numel=args.numel, codec=args.codec,
                              kills_per_round=1 if args.kills else 0, rounds=args.rounds, seed=0)
    return {
        "peers": SIM_PEERS, "group_size": group, "numel": args.numel, "codec": args.codec, "link": "simulated",
        "kills": args.rounds if args.kills else 0, "rounds": args.rounds,
        "rounds_complete": out.get("rounds_complete"), "one_hash": out.get("one_hash"),
        "seconds_per_round": out.get("seconds_per_round"), "bytes_per_peer": out.get("bytes_per_peer"),
        "dht_failures": out.get("dht_failures", 0), "sim_seconds": round(time.monotonic() - t0, 2),
        "sim": {k: v for k, v in out.items() if isinstance(v, int | float | str | bool)},
    }


# --- results ----------------------------------------------------------------------------------------


def merge(old_rows: list[dict], new_rows: list[dict]) -> list[dict]:
    """The rows of earlier runs with the same key are replaced; the others are kept."""
    keys = {tuple(r.get(k) for k in ROW_KEY) for r in new_rows}
    kept = [r for r in old_rows if tuple(r.get(k) for k in ROW_KEY) not in keys]
    return sorted([*kept, *new_rows], key=lambda r: (r["link"], r.get("group_size") or 0, r["kills"], r["peers"]))


def tree_commit(given: str | None) -> str:
    """``--commit`` where given (a copy of the tree without its .git: the GPU host's), else git's."""
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    except OSError:  # no git there
        return "unknown (pass --commit)"
    return out.stdout.strip() or "unknown (pass --commit)"


def device() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (CPU only)"


def write(path: Path, rows: list[dict], command: str, commit: str) -> None:
    old = json.loads(path.read_text()) if path.exists() else {}
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for row in rows:  # rows of several runs (and machines) share the file: each says where it came from
        row.update(command=command, commit=commit, date=date, device=device())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "device": device(),
        "date": date,
        "commit": commit,
        "command": command,
        "notes": old.get("notes", ""),
        "rows": merge(old.get("rows", []), rows),
    }, indent=1) + "\n")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", help="peer counts, e.g. 8,16,32,64 (default; 16 with --wan)")
    ap.add_argument("--group-size", type=int, help="sync.group_size for every peer (default: one group of all)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--numel", type=int, default=2_000_000, help="elements of each peer's update")
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--kills", type=int, default=0, help="SIGKILL one peer in each of the first K rounds")
    ap.add_argument("--kill-after", type=float, default=1.0, help="seconds into a round at which its victim dies")
    ap.add_argument("--per-process", type=int, default=8, help="peers sharing one host process (loopback rows)")
    ap.add_argument("--peer-timeout", type=float, default=10.0)
    # One deadline bounds a whole grouped round, its three phases and its catch-up: the 64-peer
    # row's rounds took 199 s at a load of 28, when each phase had a deadline of its own.
    ap.add_argument("--round-deadline", type=float, default=300.0)
    ap.add_argument("--rendezvous-deadline", type=float, default=60.0)
    # Longer than a round: with bounded groups each peer forms the round's groups from the live
    # records, and a record that expired mid-round at some peers gives them another formation.
    ap.add_argument("--record-ttl", type=float, default=60.0, help="seconds a peer's DHT record lives")
    ap.add_argument("--wan", action="store_true", help="the emulated-WAN row (root: namespaces)")
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--rate-mbit", type=int, default=100)
    ap.add_argument("--sim", action="store_true", help="only the 1,000-peer simulation row")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the peer processes")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--no-write", action="store_true", help="print the rows, do not write the results")
    ap.add_argument("--keep-logs", action="store_true", help="keep each row's host logs and round lines")
    ap.add_argument("--commit", help="the tree's commit, for a copy of the tree where git cannot tell")
    ap.add_argument("--dht-boot", help=argparse.SUPPRESS)  # internal: the bootstrap DHT's process
    ap.add_argument("--dht-host", default="127.0.0.1", help=argparse.SUPPRESS)
    return ap


def dht_boot(ca_file: str, host: str) -> int:
    """The bootstrap DHT: prints ``ready MADDR`` and serves until stdin closes."""
    from murmur.protocol.dht import DHTSettings, MurmurDHT

    dht = MurmurDHT(RUN, ca_cert_pem=Path(ca_file).read_bytes(), settings=DHTSettings(host=host)).start()
    try:
        print("ready", dht.addresses[0], flush=True)
        sys.stdin.read()
    finally:
        dht.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.dht_boot:
        return dht_boot(args.dht_boot, args.dht_host)
    try:
        check_args(args)
    except ArgError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    command = "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    commit = tree_commit(args.commit)

    def done(row: dict) -> None:
        """Print the row and merge it into the results at once: a run stopped by a time limit
        (``timeout``'s SIGTERM, which ends the row's peers too) keeps the rows it finished."""
        print(json.dumps(row), flush=True)
        if not args.no_write:
            write(Path(args.results), [row], command, commit)
            print(f"wrote {args.results}", flush=True)

    if args.sim:
        row = sim_row(args)
        if row:
            done(row)
    elif args.wan:
        for n in args.peer_counts:
            row = wan_row(args, n)
            if row is None:
                return 0
            done(row)
    else:
        for n in args.peer_counts:
            done(run_row(args, n, "loopback"))
    return 0


if __name__ == "__main__":
    # SIGTERM (a time limit: `timeout`) as an exception: run_row's cleanup stops its host processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
