"""`murmur sim`: K workers of a low-communication run in one process, on one device.

Each worker is a real replica (weights, AdamW, data loader on its own shards as the coordinator
would lease them) driven by the same `optim` sync code a node runs; the workers meet in an
`InProcessGroup`, which counts every payload byte by codec. Worker 0 reports a progress line per
outer step (every H inner steps) and evaluates on the validation split.

Two engines run the inner steps. ``stacked`` (the default, node/sim/stacked.py) keeps the K
replicas' weights in [K, ...] tensors and trains them with one vmapped step; ``threads`` gives
each replica its own module and thread, as separate nodes would run. They agree to float
rounding (tests/test_sim_stacked.py); stacked is many times faster on a GPU.

    murmur sim --config RUN.toml --workers 8 --algorithm diloco --inner-steps 100 --codec int4 --out runs/x

``--out`` gets sim.json (config, curves of validation loss against steps, tokens and bytes, the
summary) and sim.png (validation loss against bytes sent per worker, log scale).
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from murmur.errors import MurmurError
from murmur.node.model.data import BatchLoader, Dataset, Position, eval_batches
from murmur.node.train.trainer import autocast, build_model_from_config, evaluate, resolve_device
from murmur.optim.exchange import ExchangeError
from murmur.optim.factory import build_sync, check_sync_config, make_aggregator_for, make_codec_for
from murmur.optim.inner import adamw_state_in_order, lr_at, make_inner_optimizer, set_lr
from murmur.optim.inprocess import InProcessGroup
from murmur.optim.sync import SyncAlgorithm
from murmur.protocol.runconfig import RunConfig, apply_override, config_from_dict, load_config

JOIN_POLL_S = 0.5  # how often the main thread looks up from joining workers (lets Ctrl+C through)

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


class SimError(MurmurError):
    pass


@dataclass(slots=True)
class Worker:
    """One replica and its training step, as a node's trainer runs it."""

    peer: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sync: SyncAlgorithm
    batches: Batches
    cfg: RunConfig
    device: torch.device

    def step(self, step: int, total_steps: int) -> torch.Tensor:
        lr = lr_at(step, total_steps, self.cfg.optim)
        set_lr(self.opt, lr)
        x, y = next(self.batches)
        with autocast(self.device, self.cfg.train.dtype):
            loss = self.model(x.to(self.device), y.to(self.device))
        loss.backward()
        self.sync.before_optimizer_step(step)
        if self.sync.replaces_optimizer:
            self.sync.optimizer_step(step, lr)
        else:
            if self.cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync.after_optimizer_step(step)
        return loss.detach()


def peer_names(k: int) -> list[str]:
    return [f"w{i:03d}" for i in range(k)]


@dataclass(slots=True)
class WarmStart:
    """What every replica starts from instead of the seed: a checkpoint's weights and, when the
    checkpoint has it, its AdamW state (so the replicas continue the run rather than restart it)."""

    weights: dict[str, torch.Tensor]
    optimizer: dict | None = None  # a make_inner_optimizer state_dict over the same model


def read_warm_start(path: str | Path) -> WarmStart:
    """A `murmur train` checkpoint (weights and AdamW state) or a bare state dict (weights)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        raise SimError(f"--init-from {path} cannot be read ({err.__class__.__name__})") from None
    weights = state.get("model", state) if isinstance(state, dict) else None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise SimError(f"--init-from {path} holds no model weights (a murmur train checkpoint or a state dict)")
    bad = [n for n, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise SimError(f"--init-from {path} has non-finite values in {len(bad)} tensors (e.g. {bad[0]!r})")
    optimizer = state.get("optimizer") if "model" in state else None
    return WarmStart(weights, optimizer if isinstance(optimizer, dict) else None)


def inner_state_for(init: WarmStart | None, params: list[torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
    """The warm start's AdamW state per parameter (checked against ``params``), or None."""
    if init is None or init.optimizer is None:
        return None
    try:
        return adamw_state_in_order(init.optimizer, [p.shape for p in params])
    except ValueError as err:
        raise SimError(f"the initial optimizer state does not fit the configured model: {err}") from None


def build_replica_model(
    cfg: RunConfig, vocab_size: int, device: torch.device | str, init: dict[str, torch.Tensor] | None = None
) -> torch.nn.Module:
    """A replica's module: the run seed's initial weights, or ``init``'s when given."""
    model = build_model_from_config(cfg, vocab_size, device)
    if init is not None:
        want = model.state_dict()
        missing = [n for n in want if n not in init]
        extra = [n for n in init if n not in want]
        reshaped = [n for n in want if n in init and init[n].shape != want[n].shape]
        if missing or extra or reshaped:
            problems = [f"{len(names)} {what} (e.g. {names[0]!r})" for what, names in
                        (("missing", missing), ("unexpected", extra), ("of another shape", reshaped)) if names]
            raise SimError(f"the initial weights do not fit the configured model: {', '.join(problems)}")
        model.load_state_dict(init)
    return model


def make_group(cfg: RunConfig, peers: list[str]) -> InProcessGroup:
    """The in-process exchange the K replicas meet in: a codec per peer, the run's aggregator."""
    check_sync_config(cfg.sync)
    return InProcessGroup(peers, lambda: make_codec_for(cfg.sync), make_aggregator_for(cfg.sync))


def build_workers(
    cfg: RunConfig,
    k: int,
    device: torch.device,
    batches_for: Callable[[int, int], Batches],
    vocab_size: int,
    init: WarmStart | None = None,
) -> tuple[list[Worker], InProcessGroup]:
    """K replicas with the same initial weights (the run seed's, or ``init``'s, with its AdamW
    state when it has one), each with its own data."""
    peers = peer_names(k)
    group = make_group(cfg, peers)
    workers = []
    for i, peer in enumerate(peers):
        model = build_replica_model(cfg, vocab_size, device, init and init.weights)
        opt = make_inner_optimizer(model, cfg.optim)
        in_order = [p for g in opt.param_groups for p in g["params"]]
        saved = inner_state_for(init, in_order)
        if saved:
            for p, st in zip(in_order, saved, strict=True):
                if st:  # each replica its own copy: AdamW updates its state in place
                    opt.state[p] = {k: v.to(p.device if k != "step" else v.device).clone() for k, v in st.items()}
        sync = build_sync(
            cfg.sync, list(model.named_parameters()), group.exchange(peer), weight_decay=cfg.optim.weight_decay
        )
        workers.append(Worker(peer, model, opt, sync, batches_for(i, k), cfg, device))
    return workers, group


def worker_loaders(dataset: Dataset, batch: int, seq_len: int) -> Callable[[int, int], Batches]:
    """Worker i of k reads shards i, i+k, ...; with fewer shards than workers, workers share a
    shard and start at evenly spaced offsets of it (disjoint leases of one shard)."""

    def make(i: int, k: int) -> Batches:
        n = dataset.num_shards
        if n >= k:
            return BatchLoader(dataset, list(range(i, n, k)), batch, seq_len)
        shard, share = i % n, math.ceil(k / n)
        slot = i // n
        span = batch * seq_len
        offset = (dataset.shard_size(shard) // share) * slot // span * span
        order = [shard] + [s for s in range(n) if s != shard]
        return BatchLoader(dataset, order, batch, seq_len, position=Position(shard, offset))

    return make


# ---------------------------------------------------------------------------------------------
# Running


@dataclass(slots=True)
class CurvePoint:
    step: int
    tokens: int
    bytes_sent: int  # per worker (worker 0), cumulative
    val_loss: float
    train_loss: float | None = None


@dataclass(slots=True)
class SimResult:
    algorithm: str
    codec: str
    inner_steps: int
    workers: int
    steps: int
    tokens: int
    n_params: int
    val_loss: float
    bytes_per_worker: int
    ddp_bytes_per_worker: int
    seconds: float
    engine: str = "threads"
    bytes_by_codec: dict[str, int] = field(default_factory=dict)
    curve: list[CurvePoint] = field(default_factory=list)

    @property
    def reduction_vs_ddp(self) -> float:
        return self.ddp_bytes_per_worker / self.bytes_per_worker if self.bytes_per_worker else math.inf

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reduction_vs_ddp"] = self.reduction_vs_ddp if self.bytes_per_worker else None
        return d


def ddp_bytes(n_params: int, k: int, steps: int) -> int:
    """Bytes one worker sends in a ring all-reduce of fp32 gradients every step."""
    return steps * (2 * (k - 1) * 4 * n_params // k) if k > 1 else 0


def eval_points(cfg: RunConfig, steps: int) -> set[int]:
    """Steps after which worker 0 evaluates: multiples of the eval period, which for the
    DiLoCo family is rounded to whole windows (the replicas agree right after a sync)."""
    every = cfg.train.eval_every
    if cfg.sync.algorithm in ("diloco", "streaming"):
        h = cfg.sync.inner_steps
        every = max(h, round(every / h) * h)
    return {s for s in range(every, steps + 1, every)} | {steps}


ENGINES = ("stacked", "threads")


class Progress:
    """Worker 0's side of a run: the train-loss window, evaluations, progress lines, the curve."""

    def __init__(
        self, cfg: RunConfig, k: int, n_params: int, tokens_per_step: int, val: list, device: torch.device,
        log: Callable[[str], None],
    ) -> None:
        self.cfg, self.k, self.n_params, self.tokens_per_step = cfg, k, n_params, tokens_per_step
        self.val, self.device, self.log = val, device, log
        self.steps, self.h = cfg.train.steps, cfg.sync.inner_steps
        self.evals = eval_points(cfg, self.steps)
        self.window: list[torch.Tensor] = []
        self.curve: list[CurvePoint] = []
        self.t0 = time.perf_counter()

    def start(self, model: torch.nn.Module, engine: str) -> None:
        self.curve.append(CurvePoint(0, 0, 0, evaluate(model, self.val, self.device, self.cfg.train.dtype)))
        c = self.cfg
        self.log(
            f"sim {c.sync.algorithm} codec={c.sync.codec} H={self.h} workers={self.k} steps={self.steps} "
            f"params={self.n_params / 1e6:.2f}M tokens/step={self.tokens_per_step} device={self.device} "
            f"engine={engine} | val {self.curve[0].val_loss:.4f}"
        )
        self.t0 = time.perf_counter()

    def step_done(self, s: int, loss: torch.Tensor, sync: SyncAlgorithm, model: Callable[[], torch.nn.Module]) -> None:
        """After inner step ``s`` (0-based) of worker 0; ``model`` gives its module for evaluation."""
        self.window.append(loss)
        if (s + 1) % self.h and s + 1 != self.steps:
            return
        train = torch.stack(self.window).float().mean().item()
        self.window.clear()
        point = None
        if s + 1 in self.evals:
            val = evaluate(model(), self.val, self.device, self.cfg.train.dtype)
            point = CurvePoint(s + 1, (s + 1) * self.tokens_per_step, sync.bytes.total_sent, val, train)
            self.curve.append(point)
        dt = time.perf_counter() - self.t0
        sent = sync.bytes.total_sent
        ratio = f"{ddp_bytes(self.n_params, self.k, s + 1) / sent:,.0f}x less than ddp" if sent else "none yet"
        self.log(
            f"round {math.ceil((s + 1) / self.h):4d} | step {s + 1:6d} | loss {train:.4f}"
            + (f" | val {point.val_loss:.4f}" if point else "")
            + f" | {(s + 1) * self.tokens_per_step / dt:,.0f} tok/s | sent {sent / 1e6:.2f} MB ({ratio})"
        )

    def result(self, sync: SyncAlgorithm, engine: str) -> SimResult:
        c, k, steps = self.cfg, self.k, self.steps
        return SimResult(
            algorithm=c.sync.algorithm,
            codec="demo_dct" if c.sync.algorithm == "demo" else c.sync.codec,
            inner_steps=self.h,
            workers=k,
            steps=steps,
            tokens=steps * self.tokens_per_step,
            n_params=self.n_params,
            val_loss=self.curve[-1].val_loss,
            bytes_per_worker=sync.bytes.total_sent,
            ddp_bytes_per_worker=ddp_bytes(self.n_params, k, steps),
            seconds=time.perf_counter() - self.t0,
            engine=engine,
            bytes_by_codec=dict(sync.bytes.sent),
            curve=self.curve,
        )


def run_sim(
    cfg: RunConfig,
    k: int,
    device: torch.device,
    dataset: Dataset,
    *,
    engine: str = "stacked",
    init: WarmStart | None = None,
    log: Callable[[str], None] = print,
) -> SimResult:
    """Train K replicas for ``cfg.train.steps`` inner steps each. ``engine``: ``stacked`` (one
    vmapped step for all replicas, node/sim/stacked.py; fast on a GPU) or ``threads`` (a thread
    and a module per replica, as separate nodes would run). Both run the same optim code.
    ``init``: what every replica starts from (`read_warm_start`) instead of the seed's weights."""
    if engine not in ENGINES:
        raise SimError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    probe = build_replica_model(cfg, dataset.vocab_size, "cpu", init and init.weights)  # fail before any work
    seq_len, batch = probe.cfg.seq_len, cfg.train.batch_size
    n_params = sum(p.numel() for p in probe.parameters())
    del probe
    val = eval_batches(dataset, batch, seq_len, cfg.train.eval_batches)
    progress = Progress(cfg, k, n_params, k * batch * seq_len, val, device, log)
    loaders = worker_loaders(dataset, batch, seq_len)
    if engine == "stacked":
        return _run_stacked(cfg, k, device, loaders, dataset.vocab_size, progress, init)
    return _run_threads(cfg, k, device, loaders, dataset.vocab_size, progress, init)


def _run_stacked(cfg, k, device, loaders, vocab_size, progress: Progress, init) -> SimResult:
    from murmur.node.sim.stacked import StackedReplicas

    reps = StackedReplicas(cfg, k, device, loaders, vocab_size, peer_names(k), init)
    try:
        progress.start(reps.lead_model(), "stacked")
        steps = cfg.train.steps
        for s in range(steps):
            losses = reps.step(s, steps)
            if s + 1 == steps:
                reps.finish()
            progress.step_done(s, losses[0], reps.lead_sync, reps.lead_model)
    except ExchangeError as err:
        raise SimError(f"a replica's exchange failed: {err}") from err
    finally:
        reps.close()
    return progress.result(reps.lead_sync, "stacked")


def _run_threads(cfg, k, device, loaders, vocab_size, progress: Progress, init) -> SimResult:
    workers, group = build_workers(cfg, k, device, loaders, vocab_size, init)
    steps = cfg.train.steps
    lead = workers[0]
    progress.start(lead.model, "threads")
    errors: list[BaseException] = []

    def run(w: Worker) -> None:
        try:
            for s in range(steps):
                loss = w.step(s, steps)
                if s + 1 == steps:
                    w.sync.finish()
                if w is lead:
                    progress.step_done(s, loss, w.sync, lambda: w.model)
        except BaseException as err:  # noqa: BLE001 - any failure must release the other workers
            errors.append(err)
            group.abort(f"{w.peer} failed: {err}")

    threads = [threading.Thread(target=run, args=(w,), name=f"sim-{w.peer}", daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(JOIN_POLL_S)
    except KeyboardInterrupt:
        group.abort("interrupted")
        for t in threads:
            t.join()
        raise
    if errors:
        first = next((e for e in errors if not isinstance(e, ExchangeError)), errors[0])
        if isinstance(first, MurmurError):
            raise first
        raise SimError(f"a worker failed: {type(first).__name__}: {first}") from first
    return progress.result(lead.sync, "threads")


# ---------------------------------------------------------------------------------------------
# Output


def format_table(results: list[SimResult]) -> str:
    head = f"{'algorithm':10} {'codec':9} {'H':>5} {'K':>3} {'tokens':>12} {'val loss':>9} "
    head += f"{'sent/worker':>12} {'vs ddp':>9} {'time':>7}"
    lines = [head, "-" * len(head)]
    for r in results:
        red = f"{r.reduction_vs_ddp:,.0f}x" if r.bytes_per_worker else "-"
        lines.append(
            f"{r.algorithm:10} {r.codec:9} {r.inner_steps:5d} {r.workers:3d} {r.tokens:12,d} {r.val_loss:9.4f} "
            f"{r.bytes_per_worker / 1e6:10.2f}MB {red:>9} {r.seconds:6.1f}s"
        )
    return "\n".join(lines)


def label(r: SimResult) -> str:
    if r.algorithm in ("ddp", "demo"):
        return r.algorithm if r.algorithm == "demo" or r.codec == "fp32" else f"{r.algorithm} {r.codec}"
    return f"{r.algorithm} {r.codec} H={r.inner_steps}"


def plot_loss_vs_bytes(
    results: list[SimResult], path: Path, title: str = "", labels: list[str] | None = None
) -> None:
    """Validation loss against bytes sent per worker (log scale): the picture users look at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A lone worker sends nothing: its curve is drawn against tokens instead of an empty plot.
    by_bytes = any(p.bytes_sent > 0 for r in results for p in r.curve)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, r in enumerate(results):
        pts = [(p.bytes_sent if by_bytes else p.tokens, p.val_loss) for p in r.curve]
        pts = [(x, y) for x, y in pts if x > 0]
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, marker="o", markersize=3, label=labels[i] if labels else label(r))
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per worker (log scale)" if by_bytes else "tokens trained (log scale; nothing was sent)")
    ax.set_ylabel("validation loss")
    ax.set_title(title or "validation loss against communication")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_outputs(out: Path, cfg: RunConfig, results: list[SimResult]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {"config": cfg.to_dict(), "runs": [r.to_dict() for r in results]}
    (out / "sim.json").write_text(json.dumps(data, indent=1) + "\n")
    plot_loss_vs_bytes(results, out / "sim.png", f"{cfg.name}: {results[0].workers} workers")


# ---------------------------------------------------------------------------------------------
# The command


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="simulate K workers of a low-communication run in one process")
    p.add_argument("--config", help="run TOML (default: built-in defaults)")
    p.add_argument("--workers", "-k", type=int, default=4, help="replicas (default 4)")
    p.add_argument("--algorithm", choices=("ddp", "diloco", "streaming", "demo"), help="sync.algorithm")
    p.add_argument("--inner-steps", "-H", type=int, help="sync.inner_steps (H)")
    p.add_argument("--codec", help="sync.codec (fp32, fp16, bf16, int8, int4, topk, topk2bit, sign, powersgd)")
    p.add_argument("--aggregator", help="sync.aggregator (mean, trimmed_mean, centered_clip)")
    p.add_argument("--steps", type=int, help="train.steps (inner steps per worker)")
    p.add_argument("--data", help="data.path")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config key")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--engine", choices=ENGINES, default="stacked",
                   help="stacked: one vmapped step for all replicas (default); threads: a thread per replica")
    p.add_argument("--init-from", metavar="CKPT",
                   help="start every replica from a murmur train checkpoint (weights and AdamW state): a warm start")
    p.add_argument("--out", help="folder for sim.json and sim.png")
    p.set_defaults(func=_run)


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = []
    for flag, key in (("algorithm", "sync.algorithm"), ("codec", "sync.codec"), ("aggregator", "sync.aggregator"),
                      ("data", "data.path")):
        value = getattr(args, flag)
        if value is not None:
            extra.append(f"{key}={json.dumps(value)}")
    if args.inner_steps is not None:
        extra.append(f"sync.inner_steps={args.inner_steps}")
    if args.steps is not None:
        extra.append(f"train.steps={args.steps}")
    return extra + list(args.set)


def load_sim_config(path: str | None, overrides: list[str]) -> RunConfig:
    if path:
        return load_config(path, overrides)
    data: dict = {}
    for item in overrides:
        apply_override(data, item)
    return config_from_dict(data)


def _run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise SimError(f"--workers must be at least 1, got {args.workers}")
    cfg = load_sim_config(args.config, _overrides(args))
    check_sync_config(cfg.sync)
    device = resolve_device(args.device)
    dataset = Dataset.open(cfg.data.path)
    if dataset.tokenizer != cfg.data.tokenizer:
        raise SimError(
            f"data.tokenizer is {cfg.data.tokenizer!r} but {cfg.data.path} was prepared with {dataset.tokenizer!r}"
        )
    init = read_warm_start(args.init_from) if args.init_from else None
    result = run_sim(cfg, args.workers, device, dataset, engine=args.engine, init=init)
    print(format_table([result]))
    if args.out:
        write_outputs(Path(args.out), cfg, [result])
        print(f"wrote {Path(args.out) / 'sim.json'} and {Path(args.out) / 'sim.png'}")
    return 0
