"""DiLoCo and Streaming DiLoCo (docs/algorithms.md): local AdamW steps, then an outer Nesterov step on
the averaged pseudo-gradient.

DiLoCo keeps fp32 global parameters (on the CPU with ``global_on_cpu``). Every H inner steps:
delta = global - local; all-reduce delta; outer SGD step on global with the mean as gradient;
local <- global.

Streaming DiLoCo splits the parameters into P fragments: of about equal size in model order
(``fragment_layout = "contiguous"``), or strided as the paper prefers (block l in fragment l mod P,
so each fragment spans the depth; what comes before the blocks joins fragment 0, what comes after
the last one). Fragment p syncs once per H-step window, at step offset (p + 1) * H / P, so only 1/P of the model
is on the wire at a time. Its exchange is launched and training goes on for tau more inner steps
before the result is applied: outer step on that fragment's global copy, then
local = (1 - alpha) * global + alpha * local. DiLoCo is the case P = 1, tau = 0, alpha = 0.

Training while the round is in flight (``fill``, set by the node with ``sync.round_budget = "speed"``
and ``sync.fill_wait``): the window's last launch is not applied by the step hooks; the member
trains on while it is in flight and applies it with `land`, which carries the steps trained since
the launch onto the new global copy (local = global_new + (local - local_at_launch)), so none of
them is lost and each reaches the global model once, in the next window's pseudo-gradient.

A run that ends between syncs calls `sync_now`: one last round for every fragment trained since
its last launch, so the final model is the synced global one and not a replica's local drift.
"""

from __future__ import annotations

import re
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


_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers)\.(\d+)\.")


def strided_fragments(names: list[str], parts: int) -> list[list[int]]:
    """Block l of the model in fragment l mod P (parameter names ``blocks.<l>.``/``layers.<l>.``);
    parameters before the first block join fragment 0, those after the last one fragment P-1.
    Without block names, the contiguous split by position."""
    blocks = [int(m.group(1)) if (m := _BLOCK.search(n)) else None for n in names]
    known = sorted({b for b in blocks if b is not None})
    if not known:
        return split_fragments([1] * len(names), parts)
    parts = max(1, min(parts, len(known)))
    rank = {b: i for i, b in enumerate(known)}
    groups: list[list[int]] = [[] for _ in range(parts)]
    seen_block = False
    for i, b in enumerate(blocks):
        if b is not None:
            seen_block = True
            groups[rank[b] % parts].append(i)
        else:
            groups[-1 if seen_block else 0].append(i)
    return [sorted(g) for g in groups if g]


def fragment_groups(names: list[str], sizes: list[int], parts: int, layout: str) -> list[list[int]]:
    if layout == "strided":
        return strided_fragments(names, parts)
    if layout == "contiguous":
        return split_fragments(sizes, parts)
    raise ValueError(f"fragment layout must be contiguous or strided, got {layout!r}")


@dataclass(slots=True)
class _Fragment:
    index: int
    members: list[int]            # indices into the parameter list
    globals_: list[torch.Tensor]  # fp32 global copy
    outer: torch.optim.SGD
    offset: int                   # launches after inner step s when (s + 1) % H == offset % H
    rounds: int = 0
    last_launch: int = -1         # the inner step after which it last launched


@dataclass(slots=True)
class _InFlight:
    fragment: _Fragment
    apply_at: int
    future: Future
    at_launch: list[torch.Tensor] | None = None  # ``fill``: the local weights it was launched from (fp32)
    tick: int = 0  # ``fill``: this member's step count at the launch


class StreamingDiLoCo(SyncAlgorithm):
    name = "streaming"

    def __init__(
        self,
        params: NamedParams,
        sync_cfg,
        exchange: Exchange,
        *,
        fragments: int | None = None,
        fragment_layout: str | None = None,
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
        layout = getattr(sync_cfg, "fragment_layout", "contiguous") if fragment_layout is None else fragment_layout
        groups = fragment_groups(self.names, [p.numel() for p in self.params], n_frag, layout)
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
        # round_budget = "speed" (optim/budget.py): each window's own length, set by `plan_window`.
        # Launches and applies then count this member's own steps (``_tick``), not the schedule's
        # step, which advances by H a round on every member whatever its share.
        self._tick = 0
        self._plan: dict[int, list[_Fragment]] | None = None
        self._last_tick = -1  # the planned window's last step (its last launch)
        # Train on while the window's last launch is in flight (the module docstring; `land`).
        self.fill = False

    def plan_window(self, steps: int) -> int:
        """The next window is ``steps`` inner steps of this member (at least one per fragment, and
        more than tau, so a fragment's result lands before the fragment launches again; returns
        the count used). Fragment p launches after step (p + 1) * steps // P of it, the H-step
        schedule stretched or squeezed to this member's share."""
        steps = max(steps, len(self.fragments), self.tau + 1)
        plan: dict[int, list[_Fragment]] = {}
        for frag in self.fragments:
            at = self._tick + (frag.index + 1) * steps // len(self.fragments) - 1
            plan.setdefault(at, []).append(frag)
        self._plan = plan
        self._last_tick = self._tick + steps - 1
        return steps

    @torch.no_grad()
    def _launch(self, frag: _Fragment, step: int, *, landing: bool = False) -> None:
        locals_ = [self.params[j].detach().to(dtype=torch.float32) for j in frag.members]
        deltas = [g - p.to(g.device) for g, p in zip(frag.globals_, locals_, strict=True)]
        key = f"{self.name}/{frag.index}"
        fut = self.exchange.all_reduce(deltas, round_id=frag.rounds, key=key, weight=self.weight)
        frag.rounds += 1
        frag.last_launch = step
        if landing:  # applied by `land`, however many steps later
            at = [p.clone() if p.data_ptr() == self.params[j].data_ptr() else p
                  for j, p in zip(frag.members, locals_, strict=True)]
            self.in_flight.append(_InFlight(frag, 1 << 62, fut, at, self._tick))
        else:
            self.in_flight.append(_InFlight(frag, step + self.tau, fut))

    @torch.no_grad()
    def locals_to_global(self) -> None:
        """Every local weight set to its fragment's global copy (a state was loaded, or the steps
        trained since the last round are given up)."""
        for frag in self.fragments:
            for j, g in zip(frag.members, frag.globals_, strict=True):
                p = self.params[j]
                p.copy_(g.to(device=p.device, dtype=p.dtype))

    def landing(self) -> Future | None:
        """The in-flight launch that `land` applies (``fill``), or None."""
        return self.in_flight[-1].future if self.in_flight and self.in_flight[-1].at_launch is not None else None

    @torch.no_grad()
    def land(self) -> None:
        """Apply what is in flight (waiting for it), the ``fill`` launch last: the steps trained
        since it launched are carried onto the new global copy."""
        while self.in_flight:
            flight = self.in_flight.pop(0)
            if flight.at_launch is None:
                self._apply(flight)
                continue
            self._outer_step(flight)
            frag = flight.fragment
            moved = self._tick != flight.tick
            for j, g, base in zip(frag.members, frag.globals_, flight.at_launch, strict=True):
                p = self.params[j]
                if moved:  # local + (global_new - local_at_launch): its steps since the launch kept
                    p.add_((g - base.to(g.device)).to(device=p.device, dtype=p.dtype))
                else:
                    p.copy_(g.to(device=p.device, dtype=p.dtype))

    @torch.no_grad()
    def _outer_step(self, flight: _InFlight) -> None:
        frag = flight.fragment
        result = self._wait(flight.future)
        for g, avg in zip(frag.globals_, result.tensors, strict=True):
            # From page-locked memory (node/exchange/grpc_exchange.py) the copy is queued, not waited for.
            g.grad = avg.to(g.device, non_blocking=True)
        frag.outer.step()
        frag.outer.zero_grad(set_to_none=True)
        self.outer_steps += 1

    @torch.no_grad()
    def _apply(self, flight: _InFlight) -> None:
        frag = flight.fragment
        self._outer_step(flight)
        for j, g in zip(frag.members, frag.globals_, strict=True):
            p = self.params[j]
            new = g.to(device=p.device, dtype=p.dtype)
            if self.alpha:
                p.mul_(self.alpha).add_(new, alpha=1 - self.alpha)
            else:
                p.copy_(new)

    def after_optimizer_step(self, step: int) -> bool:
        if self._plan is not None:
            step, self._tick = self._tick, self._tick + 1
            for frag in self._plan.pop(step, ()):
                self._launch(frag, step, landing=self.fill and step == self._last_tick)
        else:
            for frag in self.fragments:
                if (step + 1) % self.h == frag.offset % self.h:
                    self._launch(frag, step)
        applied = False
        while self.in_flight and self.in_flight[0].apply_at <= step:
            self._apply(self.in_flight.pop(0))
            applied = True
        return applied

    def finish(self) -> None:
        self.land()

    def sync_now(self, step: int) -> None:
        """After inner step ``step``: apply what is in flight, then one round, applied at once, for
        every fragment that trained since its last launch. Every member must call it at the same
        step (the simulator does, at the end of a run that does not end on a sync)."""
        self.finish()
        for frag in self.fragments:
            if frag.last_launch < step:
                self._launch(frag, step)
                self.finish()

    def eval_tensors(self) -> list[torch.Tensor]:
        """The global model (every fragment as of its last outer step), in parameter order."""
        out: list[torch.Tensor] = [None] * len(self.params)
        for frag in self.fragments:
            for j, g in zip(frag.members, frag.globals_, strict=True):
                out[j] = g
        return out


class DiLoCo(StreamingDiLoCo):
    """One fragment, no overlap, no mixing: the whole model syncs every H inner steps."""

    name = "diloco"

    def __init__(self, params: NamedParams, sync_cfg, exchange: Exchange, **kw) -> None:
        super().__init__(params, sync_cfg, exchange, fragments=1, fragment_layout="contiguous", overlap_steps=0,
                         mix_alpha=0.0, **kw)

    @property
    def global_params(self) -> list[torch.Tensor]:
        return self.fragments[0].globals_
