"""THE inner step, and evaluation: every forward pass of every engine runs here.

One inner step is the same everywhere (the single-node trainer, the simulator's threads engine,
the node; the stacked engine drives it with K replicas at once, see node/sim/stacked.py)::

    lr = lr_at(step)                          # warm-up, then cosine (optim.inner)
    loss = forward(x, y) under autocast       # bf16 on a GPU unless train.dtype says otherwise
    loss.backward()
    sync.before_optimizer_step(step)          # DDP: all-reduce the gradients
    if sync.replaces_optimizer:               # DeMo: the sync is the optimizer, not clipped
        sync.optimizer_step(step, lr)         #   (it steps by the sign of its compressed momentum)
    else:
        clip to optim.grad_clip; AdamW step
    zero the gradients
    sync.after_optimizer_step(step)           # DiLoCo, Streaming DiLoCo: sync when due

No loss scaling: autocast runs in bf16, whose range is fp32's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from murmur.optim.inner import lr_at, set_lr
from murmur.protocol.runconfig import RunConfig

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (inputs, targets) -> loss


def autocast(device: torch.device, dtype: str = "auto") -> contextlib.AbstractContextManager:
    use_bf16 = dtype == "bf16" or (dtype == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, dtype: str = "auto"
) -> float:
    """The mean loss over ``batches``, in eval mode, under the same autocast as training."""
    was_training = model.training
    model.eval()
    total = 0.0
    with autocast(device, dtype):
        for x, y in batches:
            total += model(x.to(device), y.to(device)).item()
    model.train(was_training)
    return total / len(batches)


class SyncHooks(Protocol):
    """What the step calls on a sync algorithm (optim.sync.SyncAlgorithm, or the stacked engine's
    K of them as one)."""

    replaces_optimizer: bool

    def before_optimizer_step(self, step: int) -> None: ...

    def optimizer_step(self, step: int, lr: float) -> None: ...

    def after_optimizer_step(self, step: int) -> object: ...


def clip_grad_norm(module: torch.nn.Module) -> Callable[[float], object]:
    """Clipping for one replica: one global norm over the module's gradients, in module order."""
    return lambda max_norm: torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)


class StepOutput(NamedTuple):
    loss: torch.Tensor  # detached, on the device (reading it would wait for the device)
    lr: float


@dataclass(slots=True)
class InnerStep:
    """The parts of a training loop one inner step uses; call it once per step."""

    forward: Forward
    opt: torch.optim.Optimizer
    cfg: RunConfig
    device: torch.device
    clip: Callable[[float], object]  # clip the gradients to this norm (`clip_grad_norm` for one replica)
    sync: SyncHooks | None = None  # None: training alone (`murmur train`)

    def __call__(self, step: int, total_steps: int, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        lr = lr_at(step, total_steps, self.cfg.optim)
        set_lr(self.opt, lr)
        # From pinned memory (the stacked engine pins its batches) the copy is queued like a kernel.
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with autocast(self.device, self.cfg.train.dtype):
            loss = self.forward(x, y)
        # K stacked replicas give K losses; they share no weights, so their sum's gradient is
        # each replica's own.
        (loss if loss.dim() == 0 else loss.sum()).backward()
        sync = self.sync
        if sync is not None:
            sync.before_optimizer_step(step)
        if sync is not None and sync.replaces_optimizer:
            sync.optimizer_step(step, lr)
        else:
            if self.cfg.optim.grad_clip > 0:
                self.clip(self.cfg.optim.grad_clip)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if sync is not None:
            sync.after_optimizer_step(step)
        return StepOutput(loss.detach(), lr)
