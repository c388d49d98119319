"""`run_hetero`: K replicas of different speeds, on the threads engine (node/sim/threaded.py).

Worker i is ``speeds[i]`` times slower than a speed-1 worker (a slowdown factor, as `murmur
testnet --speeds` and ``--fault slow:FACTOR`` give it). Time is simulated, in units of one inner
step of a speed-1 worker: a round lasts as long as its slowest member's window, ``max_i n_i *
speeds[i]``. Each round every worker trains n_i inner steps, the count a node of the same run
would take (optim/budget.py: H with ``round_budget = "fixed"``; its share of K*H by speed with
``"speed"``), and its pseudo-gradient carries its tokens as its weight, as the node's does. The
inner steps, the DiLoCo code, the codec and the aggregator are the ones the nodes run; only the
clock is simulated, so the quality effect of uneven shares is measured apart from machine noise.

After every ``eval_every_rounds`` rounds worker 0 evaluates the global model: the curve gives the
validation loss against simulated time and against tokens trained.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from murmur.node.model.data import Dataset, eval_batches
from murmur.node.sim.errors import SimError
from murmur.node.sim.replicas import build_replica_model, worker_loaders
from murmur.node.sim.report import load_eval_weights
from murmur.node.sim.threaded import build_workers
from murmur.node.train.step import evaluate
from murmur.optim.budget import member_steps
from murmur.optim.diloco import StreamingDiLoCo
from murmur.optim.exchange import ExchangeError
from murmur.protocol.runconfig import RunConfig


@dataclass(slots=True)
class HeteroPoint:
    round: int
    time: float  # simulated, in speed-1 inner steps
    tokens: int  # trained by all workers so far
    val_loss: float


@dataclass(slots=True)
class HeteroResult:
    rule: str
    speeds: list[float]
    rounds: int
    steps: list[list[int]]  # per round, each worker's inner steps
    busy: list[float]  # per worker: simulated time training / the run's simulated time
    curve: list[HeteroPoint] = field(default_factory=list)

    @property
    def time(self) -> float:
        return self.curve[-1].time

    @property
    def tokens(self) -> int:
        return self.curve[-1].tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "time": self.time, "tokens": self.tokens}


def parse_speeds(text: str) -> list[float]:
    """``1,1,2,4`` -> slowdown factors, each at least 1."""
    try:
        speeds = [float(x) for x in text.split(",")]
    except ValueError:
        raise SimError(f"--speeds wants comma-separated slowdown factors such as 1,1,2,4, got {text!r}") from None
    if not speeds or any(not (s >= 1 and s < 1e6) for s in speeds):
        raise SimError(f"--speeds: every slowdown factor is at least 1 (1: full speed), got {text!r}")
    return speeds


def plan_round(cfg: RunConfig, speeds: list[float]) -> list[int]:
    """Each worker's inner steps this round, by the run's rule (rates: 1 / slowdown)."""
    h = cfg.sync.inner_steps
    if cfg.sync.round_budget != "speed":
        return [h] * len(speeds)
    rates = [1.0 / s for s in speeds]
    return [member_steps(h, r, rates, cfg.sync.max_step_ratio) for r in rates]


def run_hetero(
    cfg: RunConfig,
    speeds: list[float],
    device: torch.device,
    dataset: Dataset,
    *,
    rounds: int,
    eval_every_rounds: int = 1,
    log: Callable[[str], None] = print,
) -> HeteroResult:
    """``rounds`` rounds of len(speeds) workers (DiLoCo or Streaming DiLoCo)."""
    k, h = len(speeds), cfg.sync.inner_steps
    if cfg.sync.algorithm not in ("diloco", "streaming"):
        raise SimError(f"workers of different speeds need sync.algorithm diloco or streaming, got {cfg.sync.algorithm}")
    probe = build_replica_model(cfg, dataset.vocab_size, "cpu")
    seq_len, batch = probe.cfg.seq_len, cfg.train.batch_size
    del probe
    span = batch * seq_len
    val = eval_batches(dataset, batch, seq_len, cfg.train.eval_batches)
    workers, group = build_workers(cfg, k, device, worker_loaders(dataset, batch, seq_len, cfg.seed),
                                   dataset.vocab_size)
    lead = workers[0]
    scratch = copy.deepcopy(lead.model)
    total = rounds * h  # the schedule: H nominal steps a round on every worker
    plans = [plan_round(cfg, speeds) for _ in range(rounds)]  # simulated speeds do not drift
    result = HeteroResult(cfg.sync.round_budget, list(speeds), rounds, plans, [0.0] * k)
    clock, tokens = 0.0, 0
    result.curve.append(HeteroPoint(0, 0.0, 0, evaluate(lead.model, val, device, cfg.train.dtype)))
    log(f"hetero {cfg.sync.round_budget} speeds={speeds} H={h} rounds={rounds} | val {result.curve[0].val_loss:.4f}")
    errors: list[BaseException] = []
    done = threading.Barrier(k)  # the lead evaluates between rounds; nobody runs ahead of it then

    def run(i: int) -> None:
        w = workers[i]
        sync = w.sync
        assert isinstance(sync, StreamingDiLoCo)
        try:
            for r in range(rounds):
                n = sync.plan_window(plans[r][i])
                sync.weight = float(n * span)
                for j in range(n):
                    w.step(r * h + j * h // n, total)
                if r + 1 == rounds:
                    sync.finish()
                if (r + 1) % eval_every_rounds == 0 or r + 1 == rounds:
                    done.wait()
                    if i == 0:
                        _lead_eval(r)
                    done.wait()
        except BaseException as err:  # noqa: BLE001 - any failure must release the other workers
            errors.append(err)
            group.abort(f"{w.peer} failed: {err}")
            done.abort()

    def _lead_eval(r: int) -> None:
        nonlocal clock, tokens
        for rr in range(result.curve[-1].round, r + 1):  # the rounds since the last point
            clock += max(n * s for n, s in zip(plans[rr], speeds, strict=True))
            tokens += sum(plans[rr]) * span
        model = load_eval_weights(scratch, lead.sync, [p.detach() for p in lead.model.parameters()])
        v = evaluate(model, val, device, cfg.train.dtype)
        result.curve.append(HeteroPoint(r + 1, clock, tokens, v))
        log(f"round {r + 1:4d} | time {clock:8.0f} | tokens {tokens:,} | val {v:.4f}")

    threads = [threading.Thread(target=run, args=(i,), name=f"hetero-{i}", daemon=True) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, (ExchangeError, threading.BrokenBarrierError))), errors[0])
        raise SimError(f"a worker failed: {type(first).__name__}: {first}") from first
    result.busy = [sum(p[i] for p in plans) * speeds[i] / result.time for i in range(k)]
    return result
