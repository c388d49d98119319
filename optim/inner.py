"""The inner optimizer every engine steps (optim.inner): AdamW, or Muon for the hidden matrices with
AdamW for the rest (optim/muon.py); warm-up and cosine decay.

AdamW's weight decay applies to matrices only (embeddings and linear weights), not to norms' gains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from murmur.optim.muon import MuonAdamW, is_hidden_matrix


def make_inner_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:  # protocol OptimSection
    return inner_optimizer([(n, p) for n, p in model.named_parameters() if p.requires_grad], optim_cfg)


def inner_optimizer(
    named: Sequence[tuple[str, torch.Tensor]], optim_cfg, *, stacked: bool = False
) -> torch.optim.Optimizer:
    """optim.inner over the named tensors: ``adamw``, or ``muon`` (`MuonAdamW`: Muon for the hidden
    matrices, AdamW for embeddings, head, norms and biases). ``stacked``: the simulator's [K, ...]
    tensors, whose first dimension is the replica's, not the parameter's."""
    lead = 1 if stacked else 0
    kind = getattr(optim_cfg, "inner", "adamw")
    order = inner_param_order([(n, t.dim() - lead) for n, t in named], kind)
    tensors = [named[i][1] for i in order]
    n_hidden = sum(1 for n, t in named if kind == "muon" and is_hidden_matrix(n, t.dim() - lead))
    n_decay = sum(1 for t in tensors[n_hidden:] if t.dim() - lead >= 2)
    opt = adamw(tensors[n_hidden:n_hidden + n_decay], tensors[n_hidden + n_decay:], optim_cfg)
    if kind == "muon":
        return MuonAdamW(tensors[:n_hidden], opt, optim_cfg)
    if kind != "adamw":
        raise ValueError(f"optim.inner must be adamw or muon, got {kind!r}")
    return opt


def inner_param_order(named_dims: Sequence[tuple[str, int]], kind: str) -> list[int]:
    """The positions of the named parameters in the order `inner_optimizer` puts them in its groups
    (the order of a saved state dict's entries): Muon's hidden matrices (``muon``), then AdamW's
    matrices, then its vectors."""
    hidden = [i for i, (n, d) in enumerate(named_dims) if kind == "muon" and is_hidden_matrix(n, d)]
    rest = [i for i in range(len(named_dims)) if i not in set(hidden)]
    return hidden + [i for i in rest if named_dims[i][1] >= 2] + [i for i in rest if named_dims[i][1] < 2]


def saved_inner_state(state_dict: dict, named_shapes: Sequence[tuple[str, torch.Size]]) -> dict[str, dict]:
    """A saved inner optimizer's per-tensor state by parameter name (``named_shapes``: the model's
    parameters in model order, which the saved optimizer was built over), checked against the
    shapes. The saved optimizer may be either kind (its groups tell): Muon keeps a
    ``momentum_buffer``, AdamW ``exp_avg`` and ``exp_avg_sq``. Raises ValueError on a mismatch."""
    groups = state_dict.get("param_groups", [])
    kind = "muon" if any(g.get("kind") == "muon" for g in groups) else "adamw"
    order = inner_param_order([(n, len(s)) for n, s in named_shapes], kind)
    saved = adamw_state_in_order(state_dict, [named_shapes[i][1] for i in order])
    return {named_shapes[i][0]: st for i, st in zip(order, saved, strict=True)}


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
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
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
    """The schedule's ``lr`` on every group; a group with ``lr_ratio`` (MuonAdamW's Muon group:
    optim.muon_lr / optim.lr) gets that multiple of it."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)


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
