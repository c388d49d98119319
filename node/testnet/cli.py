"""`murmur testnet`: a whole network on this machine, as real processes on loopback.

    murmur testnet up --nodes 3 --config configs/testnet-small.toml --duration 180
    murmur testnet chaos --nodes 4 --mtbf 30 --duration 300
    murmur testnet up --stages 2 --nodes 4 --config configs/testnet-tiny.toml --duration 120
    murmur testnet up --nodes 4 --speeds 1,1,2,4 --duration 120

`up` starts a coordinator (its own CA, ledger and admin key under --out), creates the run and a
join token, starts N nodes (one torch thread each), shows one live row per node, and at the end
(after --duration, or when every node is done) stops everything with SIGTERM, prints a summary
table and writes the loss curves to OUT/loss.png. `chaos` does the same and meanwhile SIGKILLs a
random node now and then (exponential gaps with mean --mtbf) and restarts it from its state folder.
``--speeds 1,1,2,4`` (one slowdown factor per node) makes node i that many times slower: it
sleeps factor - 1 times each inner step's own time (the production fault ``slow:FACTOR``, kept
across chaos restarts); with ``sync.round_budget = "speed"`` the slow ones train a smaller share.
With ``--stages S`` `up` brings up a pipelined run instead (node/testnet/pipeline_net.py): N
stage peers the coordinator assigns to the S stages and ``--drivers`` drivers.
If the run's dataset is missing, it is prepared from the bundled corpus first.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from murmur.errors import MurmurError
from murmur.node.daemon.state_dir import read_rounds
from murmur.node.testnet.chaos import Chaos
from murmur.node.testnet.pipeline_net import PIPELINE_TESTNET_STEPS, run_pipeline
from murmur.node.testnet.procs import NodeProc, Testnet, TestnetError, stop_like_ctrl_c

if TYPE_CHECKING:
    from murmur.protocol.runconfig import RunConfig

DEFAULT_CONFIG = "configs/testnet-small.toml"
REFRESH_S = 1.0  # how often the live rows are redrawn
# Loopback answers in microseconds: a testnet notices a dead node within seconds, not the
# internet defaults (docs/failure-model.md explains each).
LOOPBACK_NODE = ["--peer-timeout", "8", "--rendezvous-deadline", "8", "--dht-record-ttl", "6"]
# The coordinator is the DHT bootstrap peer (its join reply hands out its addresses), so a node
# restarted under chaos never depends on another node that may have just died.
LOOPBACK_COORDINATOR = ["--dht", "--heartbeat-ttl", "3", "--lease-ttl", "6", "--restart-grace", "6"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("testnet", help="a local network: coordinator and nodes on loopback")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb, help_text in (
        ("up", "start a coordinator and N nodes, show them train, summarize"),
        ("chaos", "like up, and kill and restart nodes at random"),
    ):
        # The examples at the top of the description stay one to a line.
        v = verbs.add_parser(verb, help=help_text, description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        v.add_argument("--nodes", "-n", type=int, default=3, help="how many nodes (default 3)")
        v.add_argument("--config", default=DEFAULT_CONFIG, help="run TOML (default %(default)s)")
        v.add_argument("--duration", type=float, default=180.0, help="seconds before stopping (default 180)")
        v.add_argument("--algo", choices=("diloco", "streaming", "demo"), help="override sync.algorithm")
        v.add_argument("--speeds", help="slowdown factor per node, e.g. 1,1,2,4: slower volunteers (default all 1)")
        v.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
        )
        v.add_argument("--out", default="runs/testnet", help="folder for the ledger, node states, logs, PNG")
        v.add_argument("--threads", type=int, default=1, help="torch threads per node (default 1)")
        v.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="every node's (with --stages: every stage peer's) --device (default auto: a GPU when "
                            "there is one)")
        v.add_argument("--gpus", type=int, default=1,
                       help="local ranks per node (murmur node run --gpus): one per GPU, CPU processes otherwise")
        v.add_argument("--solo", action="store_true", help=argparse.SUPPRESS)  # nodes without peers
        if verb == "up":
            v.add_argument("--stages", type=int, default=0,
                           help="a pipelined run of S stages: --nodes stage peers and --drivers drivers "
                                "(--duration then counts from the drivers' start)")
            v.add_argument("--drivers", type=int, default=1, help="with --stages: drivers (default 1)")
        if verb == "chaos":
            v.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between kills (default 30)")
            v.add_argument("--restart-delay", type=float, default=3.0, help="seconds before a restart")
            v.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
        v.set_defaults(func=_run)


# ---------------------------------------------------------------------------------------------
# Preparing the run


def load_run(config: str, overrides: list[str]) -> RunConfig:
    """The run config, read and checked (a typo is a one-line error); nothing is written."""
    from murmur.protocol.runconfig import load_config

    return load_config(config, overrides)


def write_run(cfg: RunConfig, out: Path) -> tuple[Path, Path]:
    """OUT/run.toml with an absolute data path, the data prepared from the bundled corpus if missing."""
    from murmur.node.model.data import prepare

    data = Path(cfg.data.path).resolve()
    if not (data / "manifest.json").is_file():
        print(f"preparing {data} from the bundled corpus ({cfg.data.tokenizer} tokens) ...", flush=True)
        prepare(data, tokenizer=cfg.data.tokenizer)
    cfg.data.path = str(data)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "run.toml"
    path.write_text(cfg.to_toml())
    return path, data


def fresh_folder(out: Path) -> None:
    """A testnet starts from nothing: an old ledger or node state would resume another run."""
    import shutil

    for name in (
        "coordinator.db",
        "coordinator.db-wal",
        "coordinator.db-shm",
        "coordinator.db.ca.key",
        "coordinator.db.ca.crt",
        "coordinator.db.admin-key",
        "coordinator.log",
        "nodes",
        "loss.png",
        "summary.json",
        "model",
    ):
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Live rows, summary, plot


@dataclass(slots=True)
class Row:
    name: str
    status: str
    rounds: int
    loss: float
    val: float | None
    first_val: float | None
    tokens: int
    tokens_per_s: float
    sent: int
    peers: int
    hash: str
    restarts: int


def node_row(node: NodeProc) -> Row:
    recs = read_rounds(node.state_dir)
    trained = [r for r in recs if "loss" in r]
    vals = [r["val_loss"] for r in recs if r.get("val_loss") is not None]
    last = trained[-1] if trained else {}
    if node.alive():
        status = "training" if trained else "starting"
    elif node.proc is None:
        status = "-"
    else:
        status = f"exit {node.proc.returncode}"
    speeds = [r["tokens_per_s"] for r in trained[-5:]]
    return Row(
        name=node.name,
        status=status,
        rounds=int(last.get("round", 0)),
        loss=float(last.get("loss", math.nan)),
        val=vals[-1] if vals else None,
        first_val=vals[0] if vals else None,
        tokens=sum(int(r.get("tokens", 0)) for r in trained),
        tokens_per_s=sum(speeds) / len(speeds) if speeds else 0.0,
        sent=int(last.get("bytes_sent", 0)),
        peers=int(last.get("peers", 0)),
        hash=str(last.get("hash", ""))[:10],
        restarts=max(0, node.starts - 1),
    )


HEADER = (
    f"{'node':8} {'status':9} {'round':>5} {'loss':>7} {'val':>7} {'tokens':>10} {'tok/s':>7} "
    f"{'sent':>9} {'peers':>5} {'state hash':10} {'restarts':>8}"
)


def format_row(r: Row) -> str:
    val = f"{r.val:7.4f}" if r.val is not None else f"{'-':>7}"
    loss = f"{r.loss:7.4f}" if math.isfinite(r.loss) else f"{'-':>7}"
    return (
        f"{r.name:8} {r.status:9} {r.rounds:5d} {loss} {val} {r.tokens:10,d} {r.tokens_per_s:7,.0f} "
        f"{r.sent / 1e6:7.2f}MB {r.peers:5d} {r.hash:10} {r.restarts:8d}"
    )


class LiveView:
    """One row per node, redrawn in place on a terminal; a new line per change otherwise."""

    def __init__(self, stream=sys.stdout) -> None:  # noqa: ANN001
        self.stream = stream
        self.tty = stream.isatty()
        self.drawn = 0
        self.last: dict[str, tuple] = {}

    def show(self, rows: list[Row], elapsed: float, note: str = "") -> None:
        if self.tty:
            if self.drawn:
                self.stream.write(f"\x1b[{self.drawn}F")
            lines = [f"testnet: {elapsed:6.0f}s {note}", HEADER] + [format_row(r) for r in rows]
            self.stream.write("".join(line + "\x1b[K\n" for line in lines))
            self.drawn = len(lines)
        else:
            if not self.drawn:
                self.stream.write(HEADER + "\n")
                self.drawn = 1
            for r in rows:
                key = (r.status, r.rounds, r.restarts)
                if self.last.get(r.name) != key:
                    self.last[r.name] = key
                    self.stream.write(f"{format_row(r)}   [{elapsed:.0f}s]\n")
        self.stream.flush()


def plot_losses(nodes: list[NodeProc], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for node in nodes:
        recs = read_rounds(node.state_dir)
        train = [(r["round"], r["loss"]) for r in recs if "loss" in r]
        vals = [(r["round"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
        if train:
            (line,) = ax.plot(*zip(*train, strict=True), label=f"{node.name} train", alpha=0.8)
            if vals:
                ax.plot(*zip(*vals, strict=True), "o--", color=line.get_color(), label=f"{node.name} val")
    ax.set_xlabel("outer round")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The command


def _check_args(args: argparse.Namespace) -> None:
    """Every argument, before anything is touched: a mistake leaves the previous run's folder as it was."""
    if args.nodes < 1:
        raise MurmurError(f"--nodes must be at least 1, got {args.nodes}")
    if args.duration <= 0:
        raise MurmurError(f"--duration must be positive, got {args.duration}")
    if args.threads < 0:
        raise MurmurError(f"--threads must not be negative, got {args.threads}")
    if args.gpus < 1:
        raise MurmurError(f"--gpus must be at least 1, got {args.gpus}")
    if args.verb == "chaos" and (args.mtbf <= 0 or args.restart_delay < 0):
        raise MurmurError(f"--mtbf must be positive and --restart-delay not negative, got {args.mtbf}, "
                          f"{args.restart_delay}")
    stages = getattr(args, "stages", 0)
    if stages < 0 or (stages and args.drivers < 1):
        raise MurmurError("--stages must be positive and --drivers at least 1")
    if stages and args.nodes < stages:
        raise MurmurError(f"--nodes {args.nodes} cannot serve --stages {stages}: every stage needs a peer")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise MurmurError(f"--out {out} is a file, not a folder")
    if args.speeds is not None:
        node_speeds(args.speeds, args.nodes)
        if stages:
            raise MurmurError("--speeds slows data-parallel nodes; a pipelined run (--stages) does not take it")


def node_speeds(text: str, nodes: int) -> list[float]:
    """``--speeds 1,1,2,4``: one slowdown factor (>= 1) per node."""
    try:
        speeds = [float(x) for x in text.split(",")]
    except ValueError:
        raise MurmurError(f"--speeds wants one slowdown factor per node, such as 1,1,2,4; got {text!r}") from None
    if len(speeds) != nodes:
        raise MurmurError(f"--speeds gives {len(speeds)} factors for --nodes {nodes}: give one per node")
    if any(not (1 <= s < 1e6) for s in speeds):
        raise MurmurError(f"--speeds: every factor is at least 1 (1: full speed), got {text!r}")
    return speeds


def slow_args(speed: float) -> list[str]:
    """The node arguments that make it ``speed`` times slower (node/net/faults.py's ``slow``)."""
    return ["--fault", f"slow:{speed:g}@x*"] if speed > 1 else []


def _run(args: argparse.Namespace) -> int:
    _check_args(args)
    stop_like_ctrl_c()
    chaos = args.verb == "chaos"
    stages = getattr(args, "stages", 0)
    out = Path(args.out)
    overrides = list(args.set) + ([f'sync.algorithm="{args.algo}"'] if args.algo else [])
    if stages:
        overrides.append(f"pipeline.stages={stages}")
        if not any(o.replace(" ", "").startswith("pipeline.drivers=") for o in args.set):
            # Its D drivers are the drivers the run wants: a shipped config's pipeline.drivers
            # (the coordinator's lease cap) must not keep one of them waiting for a lease.
            overrides.append(f"pipeline.drivers={getattr(args, 'drivers', 0)}")
        if not any(o.replace(" ", "").startswith("train.steps=") for o in args.set):
            # The pipelined testnet lasts --duration: a schedule that outlasts it (the data may still
            # run out first). --set train.steps=N ends it at a schedule instead.
            overrides.append(f"train.steps={PIPELINE_TESTNET_STEPS}")
    cfg = load_run(args.config, overrides)  # a typo stops here, before the old run is wiped
    fresh_folder(out)
    config_path, data = write_run(cfg, out)
    if stages:  # stage peers find each other through the coordinator: no DHT
        return run_pipeline(args, out, config_path, data,
                            [*(a for a in LOOPBACK_COORDINATOR if a != "--dht"), "--no-dht"])
    node_args = (["--solo"] if args.solo else list(LOOPBACK_NODE)) + ["--device", args.device, "--gpus", str(args.gpus)]
    net = Testnet(root=out, config_path=config_path, data=data, threads=args.threads, node_args=node_args,
                  coordinator_args=list(LOOPBACK_COORDINATOR))
    view = LiveView()
    t0 = time.monotonic()
    started_at = time.time()
    monkey: Chaos | None = None
    progress: dict | None = None
    try:
        info = net.start_coordinator()
        print(f"coordinator on {info['address']} (ledger {net.db}, admin key {info['admin_key_file']})")
        if info.get("metrics"):
            print(f"status page: http://{info['metrics']}/ (open it while the run lasts)")
        # Enough uses for every node to rejoin after a clean stop a few times over.
        net.create_run(token_uses=args.nodes * 20)
        min_peers = ["--min-peers", str(args.nodes)] if not args.solo else []
        speeds = node_speeds(args.speeds, args.nodes) if args.speeds else [1.0] * args.nodes
        first = net.add_node(extra=min_peers, args=slow_args(speeds[0]))
        if not args.solo and not info.get("dht"):
            # No DHT at the coordinator: the first node starts the run's DHT, the others join it.
            net.wait_dht_bootstrap()
            if not first.alive():
                raise TestnetError(f"{first.name} exited at start; see {first.log_path}")
        for speed in speeds[1:]:
            net.add_node(extra=min_peers, args=slow_args(speed))
        print(f"{args.nodes} nodes started; logs in {out / 'nodes'}; Ctrl+C stops everything")
        if chaos:
            monkey = Chaos(net, args.mtbf, seed=args.seed, restart_delay_s=args.restart_delay)
        note = ""
        while time.monotonic() - t0 < args.duration:
            now = time.monotonic()
            if monkey is not None:
                note = (f"{kill} at {now - t0:.0f}s" if (kill := monkey.tick()) else "") or note
            view.show([node_row(n) for n in net.nodes], now - t0, note)
            if (monkey is None or not monkey.pending()) and all(not n.alive() for n in net.nodes):
                break
            time.sleep(REFRESH_S)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the nodes (each commits, releases its lease and leaves)")
    finally:
        ended_at = time.time()
        codes = net.stop_nodes()  # each commits, releases and leaves: the ledger is read after
        progress = _progress(net, started_at, ended_at, monkey)
        codes["coordinator"] = net.stop_coordinator()
        for node in monkey.pending() if monkey is not None else []:  # killed, not restarted yet
            codes[node.name] = None
    return _summarize(net, out, codes, time.monotonic() - t0, progress, chaos)


def _progress(net: Testnet, started_at: float, ended_at: float, monkey: Chaos | None) -> dict | None:
    """The run's progress as the ledger counts it (node/testnet/chaos.py's analyze), or None when
    the coordinator cannot say (it never started, or died)."""
    from murmur.node.testnet.chaos import analyze, round_records

    if net.coordinator is None or net.coordinator.poll() is not None or not getattr(net, "run_id", None):
        return None
    try:
        # From the first round on: the nodes' start-up is neither a stall nor a slow minute.
        started_at = min((float(r["time"]) for r in round_records(net)), default=started_at)
        return analyze(net, started_at, ended_at, restarted=monkey.restarted if monkey is not None else ())
    except (TestnetError, OSError, KeyError, ValueError) as err:
        print(f"warning: no progress figures ({err})")
        return None


def _print_progress(stats: dict, chaos: bool) -> None:
    """Tokens committed per minute (compare a chaos run's with a `testnet up` run's of the same
    config and nodes: that ratio is the honest progress figure), rounds by group size, the
    longest time with no round and, under chaos, each restart's time to its first round."""
    from murmur.node.testnet.chaos import percentile

    # "16 with 3 members", not "16 of 3", which read as 16 out of 3.
    sizes = ", ".join(f"{n} with {k} member{'' if int(k) == 1 else 's'}"
                      for k, n in stats["rounds_by_group_size"].items()) or "none"
    print(f"progress from the first round: {stats['tokens_per_min']:,} tokens committed per minute; "
          f"{stats['rounds']} rounds ({sizes}); longest time with no round {stats['max_stall_s']:.1f}s")
    if chaos:
        times = stats["restart_s"]
        p50, worst = percentile(times, 0.5), max(times, default=None)
        tail = f"p50 {p50:.1f}s, max {worst:.1f}s" if times else "none trained a round"
        print(f"restarts: {len(times)} to a first round ({tail}); {stats['restarts_without_round']} without one")
        print(f"state hashes agree in every round: {stats['hash_agreement']}; ledger exact: {stats['ledger_exact']}")


def _show_model(out: Path) -> None:
    """Export the newest node's model to OUT/model and print a short sample of it (node/export/demo.py)."""
    try:
        from murmur.node.export.demo import export_and_sample

        model, source, sample = export_and_sample(out)
    except MurmurError as err:
        print(f"no model exported: {err}")
        return
    p = source.provenance
    print(f"model: {model} (round {p.get('round')}, state {str(p.get('state_hash'))[:12]}; transformers loads it, "
          f"`murmur generate {model} --prompt TEXT` samples it)")
    lines = sample.strip("\n").splitlines()[:8] or [""]
    print("sample:\n" + "\n".join(f"  | {line}" for line in lines))


def _summarize(
    net: Testnet, out: Path, codes: dict[str, int | None], wall: float, progress: dict | None = None,
    chaos: bool = False,
) -> int:
    rows = [node_row(n) for n in net.nodes]
    print(f"\nsummary after {wall:.0f}s")
    head = (
        f"{'node':8} {'rounds':>6} {'val first':>9} {'val last':>8} {'loss':>7} {'tokens':>10} "
        f"{'tok/s':>7} {'sent':>9} {'restarts':>8} {'exit':>4}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        vf = f"{r.first_val:9.4f}" if r.first_val is not None else f"{'-':>9}"
        vl = f"{r.val:8.4f}" if r.val is not None else f"{'-':>8}"
        loss = f"{r.loss:7.4f}" if math.isfinite(r.loss) else f"{'-':>7}"
        print(
            f"{r.name:8} {r.rounds:6d} {vf} {vl} {loss} {r.tokens:10,d} {r.tokens_per_s:7,.0f} "
            f"{r.sent / 1e6:7.2f}MB {r.restarts:8d} {codes.get(r.name)!s:>4}"
        )
    hashes = {r.hash for r in rows if r.hash}
    same_round = len({r.rounds for r in rows}) == 1
    if same_round and len(hashes) == 1:
        print(f"all nodes hold the same global state after round {rows[0].rounds} (hash {rows[0].hash})")
    if progress is not None:
        _print_progress(progress, chaos)
    plot = out / "loss.png"
    try:
        plot_losses(net.nodes, plot, f"murmur testnet: {len(net.nodes)} nodes")
        print(f"loss curves: {plot}")
    except Exception as err:  # noqa: BLE001 - a missing plot must not hide the summary
        print(f"warning: no plot ({err})")
    _show_model(out)
    (out / "summary.json").write_text(
        json.dumps(
            {"wall_s": wall, "exit_codes": codes, "nodes": [asdict(r) for r in rows], "progress": progress},
            indent=1, default=str,
        )
        + "\n"
    )
    bad = {k: v for k, v in codes.items() if v not in (0, None)}
    if bad:
        raise TestnetError(f"some processes did not exit cleanly: {bad}; see the logs in {out}")
    return 0
