"""The node's trainer: one replica, its inner optimizer and its sync algorithm, built alike on every node.

It runs in the daemon's training thread (node/daemon/training_thread.py; node/daemon/node.py owns
the asyncio loop). The inner step is every engine's (node/train/step.py), with the node's extras:
the data comes from the shard the coordinator leased, compute time is measured apart from time
spent waiting for the exchange, and the whole state (model, inner optimizer, global copy, outer
momentum, round counters; the codec's error-feedback residual in the checkpoint, which is this
node's alone) can be saved, restored, hashed and handed to a joiner.

`NodeTrainer` builds those parts and holds their state; its three sides are modules of their own:

    node/daemon/window.py            one window of inner steps between two rounds (`run_window`)
    node/daemon/shared_state.py      the replicated state a node publishes and a joiner takes
    node/daemon/checkpoint_state.py  the local checkpoint: the shared state and this node's own
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from murmur.node.daemon.checkpoint_state import CheckpointState
from murmur.node.daemon.ranks import LocalRanks, RankedSync
from murmur.node.daemon.shared_state import SharedState
from murmur.node.daemon.wait_meter import WaitMeter
from murmur.node.daemon.window import WindowLoop
from murmur.node.daemon.window_types import Carry, LeaseView
from murmur.node.model.data import BatchLoader, Dataset
from murmur.node.train.build import build_model_from_config
from murmur.node.train.step import InnerStep, clip_grad_norm
from murmur.optim.budget import SpeedMeter
from murmur.optim.exchange import Exchange
from murmur.optim.factory import build_sync
from murmur.optim.inner import make_inner_optimizer
from murmur.protocol.runconfig import RunConfig


class NodeTrainer(WindowLoop, SharedState, CheckpointState):
    """One replica: its model, inner optimizer and sync algorithm, built the same on every node
    (same seed, same initial weights). Its three sides: the inner-step loop (node/daemon/window.py),
    the state it shares with the run (node/daemon/shared_state.py) and its local checkpoint
    (node/daemon/checkpoint_state.py)."""

    def __init__(
        self,
        cfg: RunConfig,
        dataset: Dataset,
        device: torch.device,
        exchange: Exchange | None,
        *,
        round_timeout_s: float,
        ranks: LocalRanks | None = None,
    ) -> None:
        self.cfg, self.dataset, self.device = cfg, dataset, device
        self.ranks = ranks  # local ranks beside this one (node/daemon/ranks.py): data parallel inside the node
        torch.manual_seed(cfg.seed)
        # Same seed, same initial weights on every node (node/model/transformer.py draws them on the CPU).
        self.model = build_model_from_config(cfg, dataset.vocab_size, device)
        self.opt = make_inner_optimizer(self.model, cfg.optim)
        self.meter = WaitMeter(exchange)
        self.sync = build_sync(
            cfg.sync,
            list(self.model.named_parameters()),
            self.meter,
            weight_decay=cfg.optim.weight_decay,
            round_timeout_s=round_timeout_s,
        )
        hooks = RankedSync(self.sync, ranks, self.model) if ranks is not None else self.sync
        self.inner = InnerStep(self.model, self.opt, cfg, device, clip_grad_norm(self.model), hooks)
        self.seq_len = self.model.cfg.seq_len
        # With local ranks the node's batch is train.batch_size rows per rank, all from its lease.
        self.batch = cfg.train.batch_size * (ranks.world if ranks is not None else 1)
        self.span = self.batch * self.seq_len
        self.h = cfg.sync.inner_steps
        self.step = 0  # inner steps done (drives the lr schedule and DeMo's round ids)
        self.round = 0  # windows done
        self._last_loss = math.nan  # the last window's mean loss (what a dry window of no step reports)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.lease: LeaseView | None = None
        self.loader: BatchLoader | None = None
        # sync.round_budget = "speed": this node's compute speed (inner steps/s) and the last round's
        # members' (the training thread sets the source); the window's length comes from both.
        self.speed = SpeedMeter()
        self.group_rates: Callable[[], Iterable[float]] = tuple
        self.after_step: Callable[[float], None] | None = None  # --fault slow: told each step's seconds
        self.carry = Carry()  # sync.fill_wait: steps trained while the last round was in flight
        # The last `_fill`'s steps, their time, its wait for the round to land after them, and its
        # waits for leases (a shard that ran out while it filled).
        self._filled_steps, self._fill_seconds, self._land_wait, self._fill_leasing = 0, 0.0, 0.0, 0.0
        # With local ranks too: rank 0 alone decides to fill and lands the round, and the other
        # ranks follow it step by step (every step is one collective that rank 0 starts, from its
        # weights), so all of them fill the same steps (docs/algorithms.md).
        if self.by_speed() and cfg.sync.fill_wait:
            self.sync.fill = True
        self._eval_copy: torch.nn.Module | None = None

    def attach(self, exchange: Exchange) -> None:
        """The run's exchange, once the data plane is open: a node builds its trainer while its
        data plane starts (node/daemon/node.py), with ``exchange`` None until here."""
        self.meter.inner = exchange
