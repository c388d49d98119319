"""The inner optimizer, as single-node training uses it: AdamW with warm-up and cosine decay.

Weight decay applies to matrices only (embeddings and linear weights), not to norms' gains.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def make_inner_optimizer(model: nn.Module, optim_cfg) -> torch.optim.AdamW:  # protocol OptimSection
    params = [p for p in model.parameters() if p.requires_grad]
    return adamw([p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2], optim_cfg)


def adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], optim_cfg) -> torch.optim.AdamW:
    """AdamW from the config over tensors with and without weight decay (the simulator's stacked
    replicas pass [K, ...] tensors here, whose matrices are not 2-D any more).

    On a GPU the fused implementation: one pass over parameters, gradients and both moments
    (benchmarks/results/train_throughput.json measures it against foreach, torch's own default
    there). On the CPU foreach, whose results the CPU tests pin across engines."""
    on_gpu = any(t.is_cuda for t in (*decay, *no_decay))
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
        foreach=None if on_gpu else True,
        fused=True if on_gpu else None,
    )


def adamw_state_in_order(state_dict: dict, shapes: list[torch.Size]) -> list[dict[str, torch.Tensor]]:
    """The per-tensor state of a saved `make_inner_optimizer` AdamW, in parameter order, checked
    against the ``shapes`` of the tensors it is meant for (empty dicts where nothing was saved).
    Raises ValueError naming the first mismatch."""
    order = [i for group in state_dict.get("param_groups", []) for i in group["params"]]
    if len(order) != len(shapes):
        raise ValueError(f"the saved optimizer has {len(order)} tensors, the model {len(shapes)}")
    out = []
    for pos, (i, shape) in enumerate(zip(order, shapes, strict=True)):
        st = state_dict.get("state", {}).get(i, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st and st[key].shape != shape:
                raise ValueError(f"the saved optimizer's tensor {pos} has {key} of shape {list(st[key].shape)}, "
                                 f"the model's is {list(shape)}")
        out.append(st)
    return out


def lr_at(step: int, total_steps: int, optim_cfg) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from lr down to lr * min_lr_ratio."""
    lr, warm = optim_cfg.lr, optim_cfg.warmup_steps
    if warm and step < warm:
        return lr * (step + 1) / warm
    span = max(1, total_steps - warm)
    progress = min(1.0, (step - warm) / span)
    floor = lr * optim_cfg.min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# Algorithms whose workers each step alone on their own batch (DDP and DeMo step one model on the
# whole batch; their lr is the single model's).
LOCAL_STEP_ALGORITHMS = ("diloco", "streaming")


def inner_lr_for(lr: float, sync_cfg, workers: int) -> float:
    """The inner lr of each of ``workers`` workers under ``sync.inner_lr_scale``: ``none`` keeps
    ``lr``; ``sqrt_k`` multiplies it by sqrt(K) for DiLoCo and Streaming DiLoCo. Each worker's AdamW
    normalises the noise of a gradient on 1/K of DDP's batch, so its useful step is about sqrt(K)
    smaller than DDP's (the square-root batch-size rule for Adam)."""
    rule = getattr(sync_cfg, "inner_lr_scale", "none")
    if rule == "none" or sync_cfg.algorithm not in LOCAL_STEP_ALGORITHMS:
        return lr
    if rule == "sqrt_k":
        return lr * math.sqrt(workers)
    raise ValueError(f"inner_lr_scale must be none or sqrt_k, got {rule!r}")
