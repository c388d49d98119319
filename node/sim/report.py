"""What a simulator run reports: worker 0's progress lines and validation curve while it runs,
then the result (sim.json), its table and its plot (sim.png)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from murmur.node.train.step import evaluate
from murmur.optim.sync import SyncAlgorithm
from murmur.protocol.model_shape import ddp_bytes
from murmur.protocol.runconfig import RunConfig


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


def eval_points(cfg: RunConfig, steps: int) -> set[int]:
    """Steps after which the run's model is evaluated: the multiples of train.eval_every and the
    last step, whatever the algorithm (what is evaluated is the synced model, `load_eval_weights`)."""
    every = cfg.train.eval_every
    return set(range(every, steps + 1, every)) | {steps}


@torch.no_grad()
def load_eval_weights(module: torch.nn.Module, sync: SyncAlgorithm, own: list[torch.Tensor]) -> torch.nn.Module:
    """``module`` holding the run's model: the sync's global weights (DiLoCo, Streaming DiLoCo:
    each fragment as of its last outer step) or else ``own``, a replica's weights, in order."""
    src = sync.eval_tensors() or own
    for p, t in zip(module.parameters(), src, strict=True):
        p.copy_(t)
    return module


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
        """After inner step ``s`` (0-based) of worker 0; ``model`` gives the module to evaluate.
        A progress line after every H steps and after each evaluation."""
        self.window.append(loss)
        if (s + 1) % self.h and s + 1 not in self.evals:
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


def seed_summary(results: list[SimResult], seeds: list[int]) -> dict:
    """One row's runs over several seeds: the mean validation loss and its spread, half the range
    (mean +- spread covers every seed), with each seed's loss."""
    return loss_summary([r.val_loss for r in results], seeds)


def loss_summary(losses: list[float], seeds: list[int]) -> dict:
    """seed_summary's figures from the losses themselves (a row joined from two calls' seeds)."""
    return {
        "seeds": list(seeds),
        "val_losses": [round(v, 6) for v in losses],
        "val_loss_mean": sum(losses) / len(losses),
        "val_loss_spread": (max(losses) - min(losses)) / 2,
    }


def format_seeds(summary: dict) -> str:
    return (f"{len(summary['seeds'])} seeds ({', '.join(map(str, summary['seeds']))}): val loss "
            f"{summary['val_loss_mean']:.4f} +- {summary['val_loss_spread']:.4f}")


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


def write_outputs(out: Path, cfg: RunConfig, results: list[SimResult], seeds: dict | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {"config": cfg.to_dict(), "runs": [r.to_dict() for r in results]}
    if seeds is not None:
        data["seeds"] = seeds
    (out / "sim.json").write_text(json.dumps(data, indent=1) + "\n")
    plot_loss_vs_bytes(results, out / "sim.png", f"{cfg.name}: {results[0].workers} workers")
