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

The data (``data``): ``"dealt"``, the simulator's usual deal (worker i reads shards i, i+K, ...,
node/sim/replicas.py), or ``"pooled"``, one stream of the dataset's batches that every round
hands out in worker order, each worker its share (`PooledBatches`), as the nodes lease shards from
one pool: a fast node takes more shards, not more passes over its own. With the deal a worker that
trains 4x the steps of another reads its own shards 4x as fast, and once it wraps round them it
trains on repeats while the group as a whole has not seen all the data: at equal tokens the rules
then differ in what they trained on, not only in how. Pooled, every rule has trained on the same
tokens at equal tokens.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from murmur.node.model.data import BatchLoader, Dataset, Position, eval_batches
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


DATA_MODES = ("dealt", "pooled")
POOL_WAIT_S = 600.0  # a worker waits this long for the others' draws before the run is given up


class PooledBatches:
    """One stream of batches for all workers: each round, worker 0 draws its share first, then
    worker 1, ... (a turn each, so the split is the same whatever the threads' timing)."""

    def __init__(self, dataset: Dataset, batch: int, seq_len: int, k: int, seed: int = 0) -> None:
        order = list(range(dataset.num_shards))
        if seed:  # another seed, another order of the shards (as the dealt loaders do)
            order = torch.randperm(len(order), generator=torch.Generator().manual_seed(seed)).tolist()
        self.loader = BatchLoader(dataset, order, batch, seq_len, position=Position(order[0], 0))
        self.k, self.turn, self.failed = k, 0, False
        self.cond = threading.Condition()

    def take(self, round_: int, worker: int, n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Worker ``worker``'s ``n`` batches of round ``round_`` (0-based), once the workers before it drew theirs."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.failed or self.turn == round_ * self.k + worker, POOL_WAIT_S):
                raise SimError(f"worker {worker} waited {POOL_WAIT_S:g}s for the others' batches of round {round_}")
            if self.failed:
                raise SimError("another worker failed")
            out = [next(self.loader) for _ in range(n)]
            self.turn += 1
            self.cond.notify_all()
        return iter(out)

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()


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
    data: str = "dealt",
    log: Callable[[str], None] = print,
) -> HeteroResult:
    """``rounds`` rounds of len(speeds) workers (DiLoCo or Streaming DiLoCo); ``data``: see the module docstring."""
    k, h = len(speeds), cfg.sync.inner_steps
    if cfg.sync.algorithm not in ("diloco", "streaming"):
        raise SimError(f"workers of different speeds need sync.algorithm diloco or streaming, got {cfg.sync.algorithm}")
    if data not in DATA_MODES:
        raise SimError(f"the workers' data is one of {', '.join(DATA_MODES)}, not {data!r}")
    probe = build_replica_model(cfg, dataset.vocab_size, "cpu")
    seq_len, batch = probe.cfg.seq_len, cfg.train.batch_size
    del probe
    span = batch * seq_len
    val = eval_batches(dataset, batch, seq_len, cfg.train.eval_batches)
    pool = PooledBatches(dataset, batch, seq_len, k, cfg.seed) if data == "pooled" else None
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
                if pool is not None:
                    w.batches = pool.take(r, i, n)
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
            if pool is not None:
                pool.fail()

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
        first = next((e for e in errors if not isinstance(e, (ExchangeError, threading.BrokenBarrierError, SimError))),
                     errors[0])
        raise SimError(f"a worker failed: {type(first).__name__}: {first}") from first
    result.busy = [sum(p[i] for p in plans) * speeds[i] / result.time for i in range(k)]
    return result
