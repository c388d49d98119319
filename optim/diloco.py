"""DiLoCo and Streaming DiLoCo (docs/algorithms.md): local AdamW steps, then an outer Nesterov step on
the averaged pseudo-gradient.

DiLoCo keeps fp32 global parameters (on the CPU with ``global_on_cpu``). Every H inner steps:
delta = global - local; all-reduce delta; outer SGD step on global with the mean as gradient;
local <- global.

Streaming DiLoCo splits the parameters into P fragments of about equal size (in model order).
Fragment p syncs once per H-step window, at step offset (p + 1) * H / P, so only 1/P of the model
is on the wire at a time. Its exchange is launched and training goes on for tau more inner steps
before the result is applied: outer step on that fragment's global copy, then
local = (1 - alpha) * global + alpha * local. DiLoCo is the case P = 1, tau = 0, alpha = 0.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from murmur.optim.exchange import Exchange
from murmur.optim.sync import ROUND_TIMEOUT_S, NamedParams, SyncAlgorithm


def split_fragments(sizes: list[int], parts: int) -> list[list[int]]:
    """Contiguous groups of indices with about equal total size (at least one index each)."""
    parts = max(1, min(parts, len(sizes)))
    total, groups, current, acc = sum(sizes), [], [], 0
    for i, n in enumerate(sizes):
        current.append(i)
        acc += n
        left_items, left_groups = len(sizes) - i - 1, parts - len(groups) - 1
        if left_groups > 0 and (acc >= total * (len(groups) + 1) / parts or left_items == left_groups):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


@dataclass(slots=True)
class _Fragment:
    index: int
    members: list[int]            # indices into the parameter list
    globals_: list[torch.Tensor]  # fp32 global copy
    outer: torch.optim.SGD
    offset: int                   # launches after inner step s when (s + 1) % H == offset % H
    rounds: int = 0


@dataclass(slots=True)
class _InFlight:
    fragment: _Fragment
    apply_at: int
    future: Future


class StreamingDiLoCo(SyncAlgorithm):
    name = "streaming"

    def __init__(
        self,
        params: NamedParams,
        sync_cfg,
        exchange: Exchange,
        *,
        fragments: int | None = None,
        overlap_steps: int | None = None,
        mix_alpha: float | None = None,
        round_timeout_s: float = ROUND_TIMEOUT_S,
    ) -> None:
        super().__init__(params, sync_cfg, exchange, round_timeout_s=round_timeout_s)
        self.h = sync_cfg.inner_steps
        n_frag = sync_cfg.fragments if fragments is None else fragments
        self.tau = sync_cfg.overlap_steps if overlap_steps is None else overlap_steps
        self.alpha = sync_cfg.mix_alpha if mix_alpha is None else mix_alpha
        device = torch.device("cpu") if sync_cfg.global_on_cpu else self.params[0].device
        groups = split_fragments([p.numel() for p in self.params], n_frag)
        self.fragments: list[_Fragment] = []
        for i, members in enumerate(groups):
            globals_ = [
                self.params[j].detach().to(device=device, dtype=torch.float32, copy=True) for j in members
            ]
            momentum = sync_cfg.outer_momentum
            outer = torch.optim.SGD(
                globals_, lr=sync_cfg.outer_lr, momentum=momentum, nesterov=sync_cfg.nesterov and momentum > 0
            )
            offset = (i + 1) * self.h // len(groups)
            self.fragments.append(_Fragment(i, members, globals_, outer, offset))
        self.in_flight: list[_InFlight] = []

    @torch.no_grad()
    def _launch(self, frag: _Fragment, step: int) -> None:
        deltas = [
            g - self.params[j].detach().to(device=g.device, dtype=torch.float32)
            for j, g in zip(frag.members, frag.globals_, strict=True)
        ]
        key = f"{self.name}/{frag.index}"
        fut = self.exchange.all_reduce(deltas, round_id=frag.rounds, key=key, weight=self.weight)
        frag.rounds += 1
        self.in_flight.append(_InFlight(frag, step + self.tau, fut))

    @torch.no_grad()
    def _apply(self, flight: _InFlight) -> None:
        frag = flight.fragment
        result = self._wait(flight.future)
        for g, avg in zip(frag.globals_, result.tensors, strict=True):
            g.grad = avg.to(g.device)
        frag.outer.step()
        frag.outer.zero_grad(set_to_none=True)
        for j, g in zip(frag.members, frag.globals_, strict=True):
            p = self.params[j]
            new = g.to(device=p.device, dtype=p.dtype)
            if self.alpha:
                p.mul_(self.alpha).add_(new, alpha=1 - self.alpha)
            else:
                p.copy_(new)
        self.outer_steps += 1

    def after_optimizer_step(self, step: int) -> bool:
        for frag in self.fragments:
            if (step + 1) % self.h == frag.offset % self.h:
                self._launch(frag, step)
        applied = False
        while self.in_flight and self.in_flight[0].apply_at <= step:
            self._apply(self.in_flight.pop(0))
            applied = True
        return applied

    def finish(self) -> None:
        while self.in_flight:
            self._apply(self.in_flight.pop(0))


class DiLoCo(StreamingDiLoCo):
    """One fragment, no overlap, no mixing: the whole model syncs every H inner steps."""

    name = "diloco"

    def __init__(self, params: NamedParams, sync_cfg, exchange: Exchange, **kw) -> None:
        super().__init__(params, sync_cfg, exchange, fragments=1, overlap_steps=0, mix_alpha=0.0, **kw)

    @property
    def global_params(self) -> list[torch.Tensor]:
        return self.fragments[0].globals_
