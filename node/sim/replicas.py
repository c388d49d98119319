"""What both simulator engines build their K replicas from: the initial weights (the run seed's or
a warm start's), the in-process group the replicas meet in, and each replica's data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from murmur.node.model.data import BatchLoader, Dataset, Position
from murmur.node.sim.errors import SimError
from murmur.node.train.build import build_model_from_config
from murmur.optim.factory import check_sync_config, make_aggregator_for, make_codec_for
from murmur.optim.inner import saved_inner_state
from murmur.optim.inprocess import InProcessGroup
from murmur.protocol.runconfig import RunConfig

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]
BatchesFor = Callable[[int, int], Batches]  # (replica i, of k) -> its batches


def peer_names(k: int) -> list[str]:
    return [f"w{i:03d}" for i in range(k)]


@dataclass(slots=True)
class WarmStart:
    """What every replica starts from instead of the seed: a checkpoint's weights and, when the
    checkpoint has it, its AdamW state (so the replicas continue the run rather than restart it)."""

    weights: dict[str, torch.Tensor]
    optimizer: dict | None = None  # a make_inner_optimizer state_dict over the same model


def read_warm_start(path: str | Path) -> WarmStart:
    """A `murmur train` checkpoint (weights and AdamW state) or a bare state dict (weights)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        raise SimError(f"--init-from {path} cannot be read ({err.__class__.__name__})") from None
    weights = state.get("model", state) if isinstance(state, dict) else None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise SimError(f"--init-from {path} holds no model weights (a murmur train checkpoint or a state dict)")
    bad = [n for n, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise SimError(f"--init-from {path} has non-finite values in {len(bad)} tensors (e.g. {bad[0]!r})")
    optimizer = state.get("optimizer") if "model" in state else None
    return WarmStart(weights, optimizer if isinstance(optimizer, dict) else None)


def load_inner_state(
    opt: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]], init: WarmStart | None, k: int | None = None
) -> None:
    """The warm start's inner-optimizer state (if it has one) into ``opt``, a fresh optimizer over
    the ``named`` tensors (``k``: the stacked engine's [K, ...] tensors, the state repeated for
    each replica). A tensor under AdamW takes its saved AdamW moments; one under Muon its saved
    Muon momentum or, from an AdamW checkpoint, AdamW's first moment, which is the same running
    mean of the gradients (Muon's momentum 0.95 against beta1's 0.9)."""
    if init is None or init.optimizer is None:
        return
    shapes = [(n, t.shape[1:] if k else t.shape) for n, t in named]
    try:
        saved = saved_inner_state(init.optimizer, shapes)
    except ValueError as err:
        raise SimError(f"the initial optimizer state does not fit the configured model: {err}") from None
    name_of = {id(t): n for n, t in named}
    for group in opt.param_groups:
        for t in group["params"]:
            st = saved.get(name_of[id(t)]) or {}
            if group.get("kind") == "muon":
                buf = st.get("momentum_buffer", st.get("exp_avg"))
                if buf is not None:
                    opt.state[t] = placed_adamw_state({"momentum_buffer": buf}, t, group, k)
            elif "exp_avg" in st:  # each replica its own copy: AdamW updates its state in place
                opt.state[t] = placed_adamw_state(st, t, group, k)


def placed_adamw_state(
    state: dict[str, torch.Tensor], param: torch.Tensor, group: dict, k: int | None = None
) -> dict[str, torch.Tensor]:
    """One parameter's saved AdamW state as its optimizer must hold it: moments on the parameter's
    device (``k``: repeated for K stacked replicas), each a copy since AdamW updates them in
    place; ``step`` on the CPU unless the optimizer is fused or capturable, which wants it as a
    float32 tensor beside the parameter (torch's own load_state_dict rule; the saved step was
    loaded to the CPU, and fused AdamW on a GPU refused it there)."""
    on_device = bool(group.get("fused") or group.get("capturable"))
    out = {}
    for name, v in state.items():
        if name == "step":
            out[name] = v.to(device=param.device, dtype=torch.float32).clone() if on_device else v.clone()
        else:
            v = v.to(param.device)
            out[name] = (v.unsqueeze(0).expand(k, *v.shape) if k else v).clone()
    return out


def build_replica_model(
    cfg: RunConfig, vocab_size: int, device: torch.device | str, init: dict[str, torch.Tensor] | None = None
) -> torch.nn.Module:
    """A replica's module: the run seed's initial weights, or ``init``'s when given."""
    model = build_model_from_config(cfg, vocab_size, device)
    if init is not None:
        want = model.state_dict()
        missing = [n for n in want if n not in init]
        extra = [n for n in init if n not in want]
        reshaped = [n for n in want if n in init and init[n].shape != want[n].shape]
        if missing or extra or reshaped:
            problems = [f"{len(names)} {what} (e.g. {names[0]!r})" for what, names in
                        (("missing", missing), ("unexpected", extra), ("of another shape", reshaped)) if names]
            raise SimError(f"the initial weights do not fit the configured model: {', '.join(problems)}")
        model.load_state_dict(init)
    return model


def make_group(cfg: RunConfig, peers: list[str]) -> InProcessGroup:
    """The in-process exchange the K replicas meet in: a codec per peer, the run's aggregator."""
    check_sync_config(cfg.sync)
    return InProcessGroup(peers, lambda: make_codec_for(cfg.sync), make_aggregator_for(cfg.sync))


def worker_loaders(dataset: Dataset, batch: int, seq_len: int, seed: int = 0) -> BatchesFor:
    """Worker i of k reads shards i, i+k, ...; with fewer shards than workers, workers share a
    shard and start at evenly spaced offsets of it (disjoint leases of one shard). A ``seed`` other
    than 0 deals the shards in a seeded random order and starts each worker a seeded share into
    its first span, so runs that differ only in the seed (a warm start makes the weights the same)
    still see different data."""
    n = dataset.num_shards
    deal = list(range(n))
    shift = 0.0
    if seed:
        gen = torch.Generator().manual_seed(seed)
        deal = torch.randperm(n, generator=gen).tolist()
        shift = float(torch.rand((), generator=gen))

    def start(shard: int, lo: int, length: int) -> int:
        span = batch * seq_len
        return (lo + int(shift * max(0, length - span - 1))) // span * span

    def make(i: int, k: int) -> Batches:
        if n >= k:
            shards = deal[i::k]
            pos = Position(shards[0], start(shards[0], 0, dataset.shard_size(shards[0])))
            return BatchLoader(dataset, shards, batch, seq_len, position=pos)
        shard, share = deal[i % n], math.ceil(k / n)
        length = dataset.shard_size(shard) // share
        offset = start(shard, length * (i // n), length)
        order = [shard] + [s for s in deal if s != shard]
        return BatchLoader(dataset, order, batch, seq_len, position=Position(shard, offset))

    return make
