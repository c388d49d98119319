"""What a stage peer computes, free of any transport: forward, backward by recomputation, steps.

SWARM's rule: a peer keeps nothing between a forward and its backward. The backward call brings
the stage's inputs back with the gradient of its outputs; the peer recomputes the forward with
autograd on and differentiates, so a backward may go to any peer of the stage (the one that ran
the forward may be gone). The last stage takes the targets instead of an output gradient and
returns the loss.

Gradients are sums over samples (the last stage differentiates loss x rows), accumulated per
parameter; once ``target_samples`` samples are in, the accumulated sum is divided by the samples
it holds and the inner optimizer (AdamW, `optim.inner`) steps. So a stage fed the microbatches of
one batch steps exactly as the single-process model does on that batch (tests/test_pipeline_stages).

A backward is computed first and accumulated only if ``keep()`` still says yes: the service asks
whether the caller is still waiting, so a hop the driver gave up on (and retries elsewhere) is
not also counted here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from murmur.node.model.stages import StageModule
from murmur.optim.inner import make_inner_optimizer, set_lr


@dataclass(slots=True)
class BackwardResult:
    grad_inputs: torch.Tensor | None  # None on the first stage (token ids have no gradient)
    loss: float | None  # the microbatch's mean loss, last stage only
    kept: bool  # accumulated (False: the caller had gone, nothing changed)
    stepped: bool  # this backward completed a batch and the optimizer stepped


@dataclass(slots=True)
class WorkerStats:
    samples_accumulated: int = 0
    optimizer_steps: int = 0
    samples_total: int = 0  # accumulated over the worker's life
    compute_seconds: float = 0.0  # wall time in forward and backward (other processes' load included)
    cpu_seconds: float = 0.0  # CPU time of the computing thread: what the work costs, load or not
    forwards: int = 0
    backwards: int = 0


class StageWorker:
    def __init__(
        self, module: StageModule, optim_cfg, *, target_samples: int, grad_clip: float = 0.0
    ) -> None:
        if target_samples < 1:
            raise ValueError(f"target_samples must be at least 1, not {target_samples}")
        self.module = module
        self.target_samples = target_samples
        self.grad_clip = grad_clip  # per stage: a global norm would need every stage's gradients
        self.optimizer = make_inner_optimizer(module, optim_cfg)
        if not any(p.is_cuda for p in module.parameters()):
            # One tensor at a time on the CPU: foreach's temporaries (the square roots of the second
            # moments, and more) held twice the stage's weights at every step's peak; the fused
            # GPU AdamW has none. Same arithmetic, tensor by tensor.
            for group in self.optimizer.param_groups:
                group["foreach"] = False
        self.params = [p for _, p in module.named_stage_parameters()]
        self.grad_sums = [torch.zeros_like(p) for p in self.params]
        self.stats = WorkerStats()
        # One computation at a time: the module's weights change under a step, and a CPU peer
        # gains nothing from running two microbatches at once.
        self.lock = threading.Lock()
        # Called after every optimizer step, in the compute thread, with the lock held: the
        # place to take a consistent copy of the weights (stage_state.published).
        self.on_step: Callable[[], None] | None = None
        # Called before the weights change (a step here, a sync round's rebase), in the compute
        # thread with the lock held: a state published from the live weights is copied there for
        # the calls still reading it (node/pipeline/stage_state.py, LiveState).
        self.before_step: Callable[[], None] | None = None
        # The lr of the next step (the run's schedule); None keeps the optimizer's own lr.
        self.lr_now: Callable[[], float] | None = None

    @property
    def span(self):
        return self.module.span

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock, torch.no_grad():
            t0, c0 = time.perf_counter(), time.thread_time()
            out = self.module(x.to(self.module.device)).cpu()  # the wire's codecs read CPU tensors
            self.stats.compute_seconds += time.perf_counter() - t0
            self.stats.cpu_seconds += time.thread_time() - c0
            self.stats.forwards += 1
            return out

    def evaluate(self, x: torch.Tensor, targets: torch.Tensor) -> float:
        """The last stage's mean loss of ``targets``, without gradients: nothing changes."""
        with self.lock, torch.no_grad():
            dev = self.module.device  # a GPU stage: the wire's tensors arrive on the CPU
            return float(self.module(x.to(dev), targets.to(dev)))

    def backward(
        self,
        x: torch.Tensor,
        grad_outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        keep: Callable[[], bool] = lambda: True,
    ) -> BackwardResult:
        last = self.span.is_last
        if last == (targets is None) or (not last) == (grad_outputs is None):
            raise ValueError("the last stage takes targets, the others an output gradient")
        with self.lock:
            t0, c0 = time.perf_counter(), time.thread_time()
            rows = x.shape[0]
            dev = self.module.device
            x, grad_outputs, targets = (None if t is None else t.to(dev) for t in (x, grad_outputs, targets))
            # Each parameter's gradient is added into its sum as autograd produces it (the sums
            # are the parameters' .grad for the call): all of them at once before the sum held a
            # copy of the stage's weights more at every backward's peak.
            for p, acc in zip(self.params, self.grad_sums, strict=True):
                p.grad = acc
            try:
                loss, grad_inputs = self._differentiate(x, grad_outputs, targets, rows, sign=1.0)
            finally:
                for p in self.params:
                    p.grad = None
            self.stats.backwards += 1
            kept = keep()
            stepped = False
            if not kept:
                # The caller gave up meanwhile (and retries elsewhere): take this microbatch out of
                # the sums again, by differentiating it once more with the opposite sign. Rare (a
                # hop past its deadline), and cheaper than holding every backward's gradients
                # apart until keep() answers.
                for p, acc in zip(self.params, self.grad_sums, strict=True):
                    p.grad = acc
                try:
                    self._differentiate(x, grad_outputs, targets, rows, sign=-1.0)
                finally:
                    for p in self.params:
                        p.grad = None
            if kept:
                self.stats.samples_accumulated += rows
                self.stats.samples_total += rows
                stepped = self.stats.samples_accumulated >= self.target_samples
                if stepped:
                    self._step()
            # The accumulation and the optimizer step are training work that one process training
            # the whole model does too: counted as compute, not as the pipeline's overhead.
            self.stats.compute_seconds += time.perf_counter() - t0
            self.stats.cpu_seconds += time.thread_time() - c0
            if stepped and self.on_step is not None:
                self.on_step()
            return BackwardResult(grad_inputs, _item(loss), kept=kept, stepped=stepped)

    def _differentiate(self, x, grad_outputs, targets, rows: int, sign: float) -> tuple[torch.Tensor | None,
                                                                                      torch.Tensor | None]:
        """Recompute the forward with autograd on and add ``sign`` x the parameters' gradients into
        their ``.grad`` (the sums); (the loss on the last stage, the inputs' gradient on the CPU)."""
        inputs = x if self.span.is_first else x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = self.module(inputs, targets)
            if self.span.is_last:
                loss = out.detach()
                torch.autograd.backward(out * (rows * sign), inputs=self.params if self.span.is_first else
                                        [inputs, *self.params])
            else:
                loss = None
                torch.autograd.backward(out, grad_outputs if sign > 0 else -grad_outputs,
                                        inputs=self.params if self.span.is_first else [inputs, *self.params])
        return loss, None if self.span.is_first else inputs.grad.cpu()

    def _step(self) -> None:
        """Mean gradient over the samples accumulated, one optimizer step, a fresh accumulator
        (``on_step`` is the caller's to call, once the step's time is counted)."""
        n = self.stats.samples_accumulated
        if self.before_step is not None:
            self.before_step()
        if self.lr_now is not None:  # the run's schedule at its global progress (node/pipeline/schedule.py)
            set_lr(self.optimizer, self.lr_now())
        for p, acc in zip(self.params, self.grad_sums, strict=True):
            p.grad = acc.div_(n)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Zeroed in place: fresh zeros would hold a second copy of the gradients until the list
        # is replaced (a stage's weights more at every step's peak).
        for acc in self.grad_sums:
            acc.zero_()
        self.stats.samples_accumulated = 0
        self.stats.optimizer_steps += 1


def _item(loss: torch.Tensor | None) -> float | None:
    return None if loss is None else float(loss)
