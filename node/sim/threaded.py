"""The simulator's threads engine: each replica its own module, inner optimizer and sync, as separate nodes
would run them, stepped in a thread of its own (node/sim/run.py); the replicas meet only in the
in-process group."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from murmur.node.sim.replicas import (
    Batches,
    BatchesFor,
    WarmStart,
    build_replica_model,
    load_inner_state,
    make_group,
    peer_names,
)
from murmur.node.train.step import InnerStep, clip_grad_norm
from murmur.optim.factory import build_sync
from murmur.optim.inner import make_inner_optimizer
from murmur.optim.inprocess import InProcessGroup
from murmur.optim.sync import SyncAlgorithm
from murmur.protocol.runconfig import RunConfig


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
    inner: InnerStep = field(init=False)

    def __post_init__(self) -> None:
        self.inner = InnerStep(self.model, self.opt, self.cfg, self.device, clip_grad_norm(self.model), self.sync)

    def step(self, step: int, total_steps: int) -> torch.Tensor:
        """Inner step ``step`` of ``total_steps`` on the next batch; its loss, on the device."""
        x, y = next(self.batches)
        return self.inner(step, total_steps, x, y).loss


def build_workers(
    cfg: RunConfig,
    k: int,
    device: torch.device,
    batches_for: BatchesFor,
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
        load_inner_state(opt, list(model.named_parameters()), init)
        sync = build_sync(
            cfg.sync, list(model.named_parameters()), group.exchange(peer), weight_decay=cfg.optim.weight_decay
        )
        workers.append(Worker(peer, model, opt, sync, batches_for(i, k), cfg, device))
    return workers, group

