"""Muon for the hidden matrices, AdamW for everything else: MuLoCo's inner optimizer (docs/algorithms.md).

Muon (Jordan et al. 2024) keeps a momentum of the gradient, orthogonalises it with a few Newton-
Schulz iterations (an approximation of U V^T from its SVD) and steps by that. It is meant for the
2-D weight matrices of the hidden layers only: embeddings, the output head, norms' gains and biases
keep AdamW, as Muon's authors and the MuLoCo paper do.

The Muon update is torch.optim.Muon's, written again here for two reasons: the simulator's stacked
engine holds K replicas' matrices as one [K, m, n] tensor, which torch's Muon refuses (2-D only),
and the build machine's torch 2.13 and the GPU machine's 2.11 then run the same code. A test holds
the 2-D update equal to torch.optim.Muon's, bit for bit. Per step, for a matrix W with gradient G::

    B = momentum * B + (1 - momentum) * G           (lerp, as torch's)
    U = G + momentum * (B - G) with Nesterov, else B
    O = NewtonSchulz(U)                             (bf16, 5 quintic iterations)
    W = W * (1 - lr * weight_decay) - lr * adjust(shape) * O

``adjust``: ``match_rms_adamw`` (0.2 * sqrt(max(m, n)), Moonshot's rule: the update's RMS matches
AdamW's, so AdamW's lr and weight decay carry over) or ``original`` (sqrt(max(1, m/n)), Keller
Jordan's, which wants an lr about 50x AdamW's).

`MuonAdamW` is one `torch.optim.Optimizer` over both kinds of parameters (its groups carry
``kind``), so everything that holds "the inner optimizer" (lr schedule, zero_grad, state_dict,
checkpoints) treats it as one. Its AdamW groups are stepped by a torch AdamW that shares the
groups and the state with it.
"""

from __future__ import annotations

import math
import re

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic
NS_EPS = 1e-7
ADJUST_LR = ("match_rms_adamw", "original")

# Parameters that keep AdamW although they are 2-D: the token embedding and the output head.
_NOT_HIDDEN = re.compile(r"(?:^|\.)(?:embed|lm_head)(?:\.|$)")


def is_hidden_matrix(name: str, matrix_dims: int) -> bool:
    """Whether Muon steps this parameter: a 2-D matrix of a hidden layer (``matrix_dims``: its
    dimensions without the stacked engine's replica dimension)."""
    return matrix_dims == 2 and not _NOT_HIDDEN.search(name)


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS) -> torch.Tensor:
    """The orthogonalised ``g`` ([m, n], or [..., m, n]: each matrix on its own), in bf16."""
    a, b, c = coefficients
    wide = g.size(-2) > g.size(-1)  # iterate on the side with fewer rows: X X^T is the smaller Gram
    if g.dim() == 2:  # torch.optim.Muon's own sequence of operations, so the result is its
        x = g.bfloat16()
        if wide:
            x = x.T
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, update, x, beta=a)
        return x.T if wide else x
    lead = g.shape[:-2]
    x = g.bfloat16().reshape(-1, *g.shape[-2:])
    if wide:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    if wide:
        x = x.mT
    return x.reshape(*lead, *x.shape[-2:])


def adjusted_lr(lr: float, rule: str, shape: torch.Size) -> float:
    rows, cols = shape[-2], shape[-1]
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"muon_adjust_lr must be one of {', '.join(ADJUST_LR)}, got {rule!r}")


@torch.no_grad()
def muon_update(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, group: dict) -> None:
    momentum = group["momentum"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
    ortho = newton_schulz(update, group["ns_steps"], group["ns_coefficients"], group["eps"])
    lr = group["lr"]
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr"], param.shape))


class MuonAdamW(torch.optim.Optimizer):
    """Muon over ``hidden`` (2-D matrices, or the stacked engine's [K, m, n]), AdamW over the rest:
    ``adamw`` is a torch AdamW already built over those (optim/inner.py's `adamw`), whose groups
    and state this optimizer takes over.

    Each group has ``lr_ratio``: `optim.inner.set_lr` sets a group's lr to the schedule's lr times
    it, so Muon follows AdamW's warm-up and decay from its own peak (optim.muon_lr)."""

    def __init__(self, hidden: list[torch.Tensor], adamw: torch.optim.AdamW, optim_cfg) -> None:
        ratio = optim_cfg.muon_lr / optim_cfg.lr if optim_cfg.lr > 0 else 0.0
        muon_group = {
            "params": hidden, "kind": "muon", "lr": optim_cfg.muon_lr, "lr_ratio": ratio,
            "weight_decay": optim_cfg.muon_weight_decay, "momentum": optim_cfg.muon_momentum,
            "nesterov": optim_cfg.muon_nesterov, "ns_steps": optim_cfg.muon_ns_steps,
            "ns_coefficients": NS_COEFFICIENTS, "eps": NS_EPS, "adjust_lr": optim_cfg.muon_adjust_lr,
        }
        adjusted_lr(1.0, optim_cfg.muon_adjust_lr, torch.Size((1, 1)))  # an unknown rule fails here
        for group in adamw.param_groups:
            group["kind"], group["lr_ratio"] = "adamw", 1.0
        groups = ([muon_group] if hidden else []) + list(adamw.param_groups)
        super().__init__(groups, {})
        self._adamw = adamw
        self._link()

    def _link(self) -> None:
        # The AdamW steps this optimizer's AdamW groups (the same dicts) from this optimizer's state.
        self._adamw.param_groups = [g for g in self.param_groups if g["kind"] == "adamw"]
        self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch.optim.Optimizer's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] != "muon":
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                muon_update(p, p.grad, state["momentum_buffer"], group)
        if self._adamw.param_groups:
            self._adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        kinds = [g.get("kind") for g in state_dict.get("param_groups", [])]
        if kinds != [g["kind"] for g in self.param_groups]:
            raise ValueError(f"the saved optimizer's groups are {kinds}, this one's "
                             f"{[g['kind'] for g in self.param_groups]} (another optim.inner?)")
        super().load_state_dict(state_dict)
        self._link()  # torch's load_state_dict made new group dicts
