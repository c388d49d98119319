"""The per-worker sync algorithm a training loop drives, and the DDP baseline.

A training loop (the node's trainer, the simulator's workers) runs every inner step as::

    loss.backward()
    sync.before_optimizer_step(step)          # DDP: all-reduce the gradients
    if sync.replaces_optimizer:               # DeMo: the sync *is* the optimizer
        sync.optimizer_step(step, lr)
    else:
        clip; inner_optimizer.step()
    sync.after_optimizer_step(step)           # DiLoCo, Streaming DiLoCo: sync when due
    ...
    sync.finish()                             # at the end: apply what is still in flight
                                              # (sync_now(step) first: a last round, if due)

Each algorithm talks only to its `Exchange`; every wait is bounded by ``round_timeout_s``.
A failed round raises `ExchangeError` before anything is applied, so no partial average ever
reaches the weights (commit-or-rollback: the caller decides whether to retry or stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch
from torch import nn

from murmur.optim.accounting import ByteCounter
from murmur.optim.exchange import Exchange, ExchangeError, GatherResult, ReduceResult

ROUND_TIMEOUT_S = 600.0  # longest wait for one round's result before the round counts as failed

NamedParams = Sequence[tuple[str, nn.Parameter]]


class SyncAlgorithm:
    name = "none"
    replaces_optimizer = False

    def __init__(
        self, params: NamedParams, sync_cfg, exchange: Exchange, *, round_timeout_s: float = ROUND_TIMEOUT_S
    ) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.cfg = sync_cfg
        self.exchange = exchange
        self.round_timeout_s = round_timeout_s
        self.bytes = ByteCounter()
        self.weight = 1.0  # 0 for a late joiner: takes part without moving the result
        self.outer_steps = 0  # completed syncs (fragments count one each for Streaming DiLoCo)

    # Hooks; the defaults do nothing.
    def before_optimizer_step(self, step: int) -> None:
        pass

    def optimizer_step(self, step: int, lr: float) -> None:
        raise NotImplementedError(f"{self.name} uses the inner optimizer")

    def after_optimizer_step(self, step: int) -> bool:
        """Returns True when this step completed a sync (an outer step)."""
        return False

    def finish(self) -> None:
        pass

    def sync_now(self, step: int) -> None:
        """Bring the replicas together now, after inner step ``step`` (every member at the same
        step). Nothing to do for algorithms whose replicas agree after every step."""

    def eval_tensors(self) -> list[torch.Tensor] | None:
        """The weights that stand for the run's model, in parameter order; None: the replica's own
        (DDP and DeMo replicas agree after every step; DiLoCo's is the global copy)."""
        return None

    def _wait(self, fut: Future) -> ReduceResult | GatherResult:
        try:
            result = fut.result(timeout=self.round_timeout_s)
        except FutureTimeout:
            raise ExchangeError(f"no result within round_timeout_s={self.round_timeout_s:g}") from None
        self.bytes.add(result.codec, result.bytes_sent, result.bytes_received)
        return result


class DDP(SyncAlgorithm):
    """The baseline: all-reduce every gradient every step (bytes counted as a ring all-reduce)."""

    name = "ddp"

    @torch.no_grad()
    def before_optimizer_step(self, step: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        result = self._wait(self.exchange.all_reduce(grads, round_id=step, key="ddp", weight=self.weight))
        for p, g in zip(self.params, result.tensors, strict=True):
            p.grad = g.to(device=p.device, dtype=p.dtype)

    def after_optimizer_step(self, step: int) -> bool:
        self.outer_steps += 1
        return False
