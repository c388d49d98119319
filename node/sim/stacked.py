"""The simulator's stacked engine: K replicas' weights stacked on a leading dimension and trained
by one vmapped step, instead of K threads that each launch their own small kernels.

With threads, K replicas of a small model are bound by Python and kernel launches (every op runs
K times, and the threads take turns at the interpreter): on an H200, 8 replicas of a 30M model
reached about 60k tokens/s. Stacked, every op runs once for all K replicas (a matmul becomes a
batched matmul), so the GPU sees K-times-larger kernels for the same launch cost.

Only the inner step is batched. Each replica still has its own `SyncAlgorithm` from `optim`,
built on views of its slice of the stacked weights, and its own handle on the `InProcessGroup`:
the outer steps, codecs, error feedback, aggregation and byte counts are the code a node runs.
The sync hooks of the K replicas run on a small thread pool, because an exchange completes only
once every member has submitted. AdamW is elementwise, so one AdamW over the stacked tensors is
K independent AdamWs; Muon (optim.inner = "muon") orthogonalises each replica's [m, n] slice of a
[K, m, n] matrix on its own (a batched Newton-Schulz, optim/muon.py), so it is K Muons too; gradient
clipping is done per replica, by each replica's own norm.

The step is node/train/step.py's `InnerStep`, the one every engine runs: the same lr schedule,
autocast, hook order and clipping rule (clip to optim.grad_clip unless the sync replaces the
optimizer). Three parts of it must differ here, and are handed to it: the forward is the model
called functionally under vmap on the stacked weights (its loss is K losses, summed for one
backward; where the fused linear + cross-entropy kernel runs, the head is called per replica
outside vmap); the clip takes each replica's own norm (one norm over the stack would couple the
replicas); and the sync is `_EverySync`, the K replicas' syncs as one, which runs each hook for
all of them on the pool and lends each replica its slice of the stacked gradients when its
algorithm reads or rewrites them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from murmur import kernels
from murmur.kernels.dispatch import compile_requested
from murmur.node.sim.replicas import (
    BatchesFor,
    WarmStart,
    build_replica_model,
    load_inner_state,
    make_group,
)
from murmur.node.sim.report import load_eval_weights
from murmur.node.train.step import InnerStep
from murmur.optim.factory import build_sync
from murmur.optim.inner import inner_optimizer
from murmur.optim.inprocess import InProcessGroup
from murmur.optim.sync import SyncAlgorithm
from murmur.protocol.runconfig import RunConfig

# SDPA has no batching rule on the CPU, so vmap loops over the replicas for that one op; the
# result is exact, and the warning would only repeat on every step.
warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")


class StackedReplicas:
    """K replicas of one model in one set of [K, ...] tensors, each with its own sync and data."""

    def __init__(
        self,
        cfg: RunConfig,
        k: int,
        device: torch.device,
        batches_for: BatchesFor,
        vocab_size: int,
        peers: list[str],
        init: WarmStart | None = None,
    ) -> None:
        self.cfg, self.k, self.device = cfg, k, device
        # The module supplies the code and the buffers; its own weights are only the place where
        # replica 0 is copied for evaluation.
        self.model = build_replica_model(cfg, vocab_size, device, init and init.weights)
        named = list(self.model.named_parameters())
        self.names = [n for n, _ in named]
        self.stacked = {
            n: p.detach().unsqueeze(0).expand(k, *p.shape).clone().requires_grad_(True) for n, p in named
        }
        stacked_named = [(n, self.stacked[n]) for n in self.names]
        self.opt = inner_optimizer(stacked_named, cfg.optim, stacked=True)
        load_inner_state(self.opt, stacked_named, init, k)  # the one saved state, repeated for each replica
        self.group = make_group(cfg, peers)
        # Replica i's parameters: views of slice i, which the sync reads and writes in place.
        self.views = [[(n, self.stacked[n].detach()[i]) for n in self.names] for i in range(k)]
        self.syncs: list[SyncAlgorithm] = [
            build_sync(cfg.sync, self.views[i], self.group.exchange(peer), weight_decay=cfg.optim.weight_decay)
            for i, peer in enumerate(peers)
        ]
        self.batches = [batches_for(i, k) for i in range(k)]
        self.every = _EverySync(self.syncs, self.views, self.stacked, self.group)
        self._trunk = _Trunk(self.model)
        self._head_weight = "embed.weight" if self.model.lm_head is None else "lm_head.weight"
        self.compiled = stacked_compile(device)
        # Static shapes: on an H200 (torch 2.11) the recompile for a second batch size with
        # automatic dynamic shapes failed inside vmap; one graph per batch size costs seconds.
        self._forward = torch.compile(self._stacked_loss, dynamic=False) if self.compiled else self._stacked_loss
        self.inner = InnerStep(self._loss, self.opt, cfg, device, self._clip, self.every)

    @property
    def engine(self) -> str:
        """The engine's name in results: ``stacked``, or ``stacked+compile``."""
        return "stacked+compile" if self.compiled else "stacked"

    def close(self) -> None:
        self.every.close()

    # -- one inner step of every replica ---------------------------------------------------------

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The K replicas' losses on their K batches ([K, batch, seq] inputs)."""
        return self._forward(self.stacked, x, y)

    def _stacked_loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # What torch.compile traces when it is on: the vmapped forward, the backend choice inside
        # it so the trace records the same attention kernel as the eager path.
        with self._attention_backends():
            if not kernels.use_triton(x, op="linear_cross_entropy"):
                return vmap(self._replica_loss, randomness="error")(params, x, y)
            # The head apart, one replica at a time: the fused linear + cross-entropy kernel has no
            # batching rule, and under vmap the reference materialized [K, tokens, vocab] fp32
            # logits, whose softmax passes took a third of the step on an H200 (a 50k vocabulary
            # against a 384-wide model; sim_throughput.json).
            hidden = vmap(self._replica_hidden, randomness="error")(params, x)
            weights = params[self._head_weight].unbind(0)
            return torch.stack([
                kernels.linear_cross_entropy(h.flatten(0, 1), w, t.flatten())
                for h, w, t in zip(hidden.unbind(0), weights, y.unbind(0), strict=True)
            ])

    def _replica_loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, params, (x, y))

    def _replica_hidden(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(self._trunk, {"model." + n: t for n, t in params.items()}, (x,))

    def step(self, step: int, total_steps: int) -> torch.Tensor:
        """One inner step of all K replicas; returns their K losses (on the device)."""
        xs, ys = zip(*(next(b) for b in self.batches), strict=True)
        return self.inner(step, total_steps, self._pinned(torch.stack(xs)), self._pinned(torch.stack(ys))).loss

    def _attention_backends(self) -> contextlib.AbstractContextManager:
        # Under vmap on an H200 (torch 2.11) the cuDNN attention's batching rule gave NaN
        # gradients and memory-efficient attention refused the batched strides; flash attention
        # matched the unbatched model. Math is the fallback for shapes flash does not take.
        if self.device.type == "cuda":
            return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
        return contextlib.nullcontext()

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        # From pageable memory a copy to the GPU waits for the queue to drain; from pinned memory
        # it is queued like a kernel, so the CPU can run ahead of the GPU.
        return t.pin_memory() if self.device.type == "cuda" else t

    def finish(self, step: int) -> None:
        """The end of the run, after inner step ``step``: a last sync if one is due, then what is
        still in flight."""
        self.every.each(lambda s: (s.sync_now(step), s.finish()))

    @torch.no_grad()
    def _clip(self, max_norm: float) -> None:
        """torch.nn.utils.clip_grad_norm_ for each replica on its own: coefficient per slice."""
        grads = [self.stacked[n].grad for n in self.names if self.stacked[n].grad is not None]
        if not grads:
            return
        # clip_grad_norm_'s own formula, per slice: each tensor's norm, then the norm of those
        # (one read of each gradient, no squared copy of it).
        norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), 2, dim=1, dtype=torch.float32) for g in grads])
        coef = (max_norm / (torch.linalg.vector_norm(norms, 2, dim=0) + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))

    # -- replica 0 as a module, for evaluation ----------------------------------------------------

    @torch.no_grad()
    def lead_model(self) -> torch.nn.Module:
        """The module holding a copy of replica 0's current weights."""
        for n, p in self.model.named_parameters():
            p.copy_(self.stacked[n][0])
        return self.model

    def eval_model(self) -> torch.nn.Module:
        """The module holding the run's model as it stands: the lead sync's global copy, or
        replica 0's weights."""
        return load_eval_weights(self.model, self.syncs[0], [self.stacked[n].detach()[0] for n in self.names])

    @property
    def lead_sync(self) -> SyncAlgorithm:
        return self.syncs[0]


class _Trunk(torch.nn.Module):
    """The model up to its final norm (`Transformer.hidden_states`), for `functional_call`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.hidden_states(x)


def stacked_compile(device: torch.device) -> bool:
    """Whether the stacked step runs through torch.compile: MURMUR_COMPILE (`murmur sim --compile`)
    as for the model's own forward, `auto` meaning on CUDA. Under vmap the model never compiles
    itself (kernels.dispatch.compile_enabled), so this is the only compile of the stacked step."""
    choice = compile_requested()
    return choice == "on" or (choice == "auto" and device.type == "cuda")


class _EverySync:
    """The K replicas' sync algorithms as the one sync `InnerStep` calls: each hook runs for every
    replica at once (an exchange completes only when every member has submitted). DDP rewrites
    the gradients and DeMo steps from them, so for those each replica's parameter views get its
    slice of the stacked gradients before the hooks, and DDP's averages are copied back after."""

    def __init__(
        self, syncs: list[SyncAlgorithm], views: list[list[tuple[str, torch.Tensor]]],
        stacked: dict[str, torch.Tensor], group: InProcessGroup,
    ) -> None:
        self.syncs, self.views, self.stacked, self.group = syncs, views, stacked, group
        sync_cls = type(syncs[0])
        self.replaces_optimizer = sync_cls.replaces_optimizer
        self._lend_grads = sync_cls.replaces_optimizer or (
            sync_cls.before_optimizer_step is not SyncAlgorithm.before_optimizer_step
        )
        self._pool = ThreadPoolExecutor(len(syncs), thread_name_prefix="sim-sync")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def before_optimizer_step(self, step: int) -> None:
        if self._lend_grads:
            self._lend()
        self.each(lambda s: s.before_optimizer_step(step))
        if self._lend_grads and not self.replaces_optimizer:
            self._take_back()  # the stacked AdamW steps from the stacked gradients
            self._drop_lent()

    def optimizer_step(self, step: int, lr: float) -> None:
        self.each(lambda s: s.optimizer_step(step, lr))
        self._drop_lent()

    def after_optimizer_step(self, step: int) -> None:
        self.each(lambda s: s.after_optimizer_step(step))

    def _lend(self) -> None:
        for i, views in enumerate(self.views):
            for n, v in views:
                g = self.stacked[n].grad
                v.grad = None if g is None else g[i]

    def _take_back(self) -> None:
        """Copy gradients a sync replaced (DDP's average) back into the stacked gradients."""
        with torch.no_grad():
            for i, views in enumerate(self.views):
                for n, v in views:
                    g = self.stacked[n].grad
                    if g is not None and v.grad is not None and v.grad.data_ptr() != g[i].data_ptr():
                        g[i].copy_(v.grad)

    def _drop_lent(self) -> None:
        for views in self.views:
            for _, v in views:
                v.grad = None

    def each(self, fn: Callable[[SyncAlgorithm], object]) -> None:
        """Run a sync hook for every replica at once. If one fails, the group is aborted so the
        others' waits end too, and the first error is raised."""
        futures = [self._pool.submit(fn, s) for s in self.syncs]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f.done() and f.exception() is not None), None)
        if failed is not None:
            self.group.abort(f"a replica's sync failed: {failed.exception()}")
            wait(pending)
            raise failed.exception()

