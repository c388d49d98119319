"""Helpers for the optim tests: tiny replicas driven by the simulator's worker step, on
synthetic token streams (independent of the data pipeline, so golden numbers only move when
the optim code or the model does)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from murmur.node.sim.threaded import Worker, build_workers
from murmur.protocol.runconfig import config_from_dict

VOCAB = 256
SEQ = 32
BATCH = 2


def tiny_config(steps: int = 4, **sync) -> object:
    return config_from_dict(
        {
            "seed": 7,
            "model": {"preset": "tiny", "seq_len": SEQ, "n_layers": 2},
            "optim": {"lr": 3e-3, "warmup_steps": 1, "grad_clip": 1.0},
            "train": {"steps": steps, "batch_size": BATCH, "dtype": "fp32"},
            "sync": {"overlap_steps": 0, **sync},
        }
    )


def token_stream(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A deterministic stream with some structure (a noisy repeating pattern) to learn from."""
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, VOCAB, (97,), generator=gen)
    while True:
        start = int(torch.randint(0, 97, (1,), generator=gen))
        idx = (torch.arange(BATCH * (SEQ + 1)) + start) % 97
        seq = pattern[idx].clone()
        noise = torch.rand(seq.shape, generator=gen) < 0.1
        seq[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=gen)
        seq = seq.view(BATCH, SEQ + 1)
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def make_workers(cfg, k: int, same_data: bool = False) -> list[Worker]:
    torch.manual_seed(0)
    workers, _ = build_workers(
        cfg, k, torch.device("cpu"), lambda i, n: token_stream(0 if same_data else 100 + i), VOCAB
    )
    return workers


def run_workers(workers: list[Worker], steps: int, final_sync: bool = False) -> list[list[float]]:
    """Each worker in its own thread, as the simulator runs them; per-worker losses. With
    ``final_sync``, the run ends as the simulator's does: a last sync if one is due."""
    losses: list[list[float]] = [[] for _ in workers]
    errors: list[BaseException] = []

    def run(i: int, w: Worker) -> None:
        try:
            for s in range(steps):
                losses[i].append(float(w.step(s, steps)))
            if final_sync:
                w.sync.sync_now(steps - 1)
            w.sync.finish()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    if errors:
        raise errors[0]
    return losses


def flat_params(worker: Worker) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in worker.model.parameters()])
