"""`run_sim`: K replicas trained for ``cfg.train.steps`` inner steps by one of the two engines,
replica 0 reporting (node/sim/report.py)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch

from murmur.errors import MurmurError
from murmur.node.model.data import Dataset, eval_batches
from murmur.node.sim.replicas import BatchesFor, SimError, WarmStart, build_replica_model, peer_names, worker_loaders
from murmur.node.sim.report import Progress, SimResult, load_eval_weights
from murmur.node.sim.stacked import StackedReplicas
from murmur.node.sim.threaded import Worker, build_workers
from murmur.optim.exchange import ExchangeError
from murmur.optim.inner import inner_lr_for
from murmur.protocol.runconfig import RunConfig

JOIN_POLL_S = 0.5  # how often the main thread looks up from joining workers (lets Ctrl+C through)

Engine = Callable[[RunConfig, int, torch.device, BatchesFor, int, Progress, WarmStart | None], SimResult]


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
    ``init``: what every replica starts from (`read_warm_start`) instead of the seed's weights.
    ``sync.inner_lr_scale`` sets the replicas' inner lr for K (optim.inner.inner_lr_for). A run
    that does not end on a sync ends with one (`sync_now`), and every evaluation is of the run's
    model: the global copy for the DiLoCo family, replica 0 (which agrees with all) otherwise."""
    if engine not in ENGINES:
        raise SimError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    scaled = inner_lr_for(cfg.optim.lr, cfg.sync, k)
    if scaled != cfg.optim.lr:
        cfg = cfg.model_copy(deep=True)
        cfg.optim.lr = scaled
        log(f"inner lr {scaled:.3g} (sync.inner_lr_scale={cfg.sync.inner_lr_scale}, {k} workers)")
    probe = build_replica_model(cfg, dataset.vocab_size, "cpu", init and init.weights)  # fail before any work
    seq_len, batch = probe.cfg.seq_len, cfg.train.batch_size
    n_params = sum(p.numel() for p in probe.parameters())
    del probe
    val = eval_batches(dataset, batch, seq_len, cfg.train.eval_batches)
    progress = Progress(cfg, k, n_params, k * batch * seq_len, val, device, log)
    loaders = worker_loaders(dataset, batch, seq_len, cfg.seed)
    return ENGINES[engine](cfg, k, device, loaders, dataset.vocab_size, progress, init)


def _run_stacked(
    cfg: RunConfig, k: int, device: torch.device, loaders: BatchesFor, vocab_size: int, progress: Progress,
    init: WarmStart | None,
) -> SimResult:
    reps = StackedReplicas(cfg, k, device, loaders, vocab_size, peer_names(k), init)
    try:
        progress.start(reps.lead_model(), reps.engine)
        steps = cfg.train.steps
        for s in range(steps):
            losses = reps.step(s, steps)
            if s + 1 == steps:
                reps.finish(s)
            progress.step_done(s, losses[0], reps.lead_sync, reps.eval_model)
    except ExchangeError as err:
        raise SimError(f"a replica's exchange failed: {err}") from err
    finally:
        reps.close()
    return progress.result(reps.lead_sync, reps.engine)


def _run_threads(
    cfg: RunConfig, k: int, device: torch.device, loaders: BatchesFor, vocab_size: int, progress: Progress,
    init: WarmStart | None,
) -> SimResult:
    workers, group = build_workers(cfg, k, device, loaders, vocab_size, init)
    steps = cfg.train.steps
    lead = workers[0]
    progress.start(lead.model, "threads")
    # Evaluation reads a copy: the lead's module keeps training, and the DiLoCo family's model
    # is its global copy, not the lead's weights.
    scratch = copy.deepcopy(lead.model)

    def eval_model() -> torch.nn.Module:
        return load_eval_weights(scratch, lead.sync, [p.detach() for p in lead.model.parameters()])
    errors: list[BaseException] = []

    def run(w: Worker) -> None:
        try:
            for s in range(steps):
                loss = w.step(s, steps)
                if s + 1 == steps:
                    w.sync.sync_now(s)
                    w.sync.finish()
                if w is lead:
                    progress.step_done(s, loss, w.sync, eval_model)
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


ENGINES: dict[str, Engine] = {"stacked": _run_stacked, "threads": _run_threads}
