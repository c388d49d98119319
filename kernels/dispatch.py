"""Which implementation runs: Triton on CUDA tensors, the pure-torch reference on the CPU.

`MURMUR_KERNELS=triton|torch|auto` overrides the choice (read at every call, so tests can flip
it); a comma-separated list of model ops (`rms_norm,rotary,swiglu,linear_cross_entropy`) takes
Triton for those on CUDA tensors and the reference for the rest, compiled or not. `triton` on
CPU tensors only works under `TRITON_INTERPRET=1` (the CPU test suite). Under torch.compile,
`auto` takes Triton only for the ops in `COMPILED_TRITON_OPS`, those that made the compiled step
faster (benchmarks/results/train_throughput.json); for the others the reference is traced and
Inductor fuses it with its neighbours.

`MURMUR_COMPILE=auto|on|off` says whether the model compiles its own forward (`compile_enabled`):
`auto` compiles on CUDA tensors, the measured fastest GPU path (train_throughput.json), and never
on the CPU.

The training ops are `torch.library.triton_op`s (`training_op`): torch.compile traces into them
and Inductor calls the Triton kernels from its own generated code. Under the interpreter they are
plain `custom_op`s whose fake is the same function (launches skip fake tensors), so the CPU suite
runs the same code and opcheck sees the same shapes.

Triton kernels are declared with `lazy_jit` instead of `triton.jit`, and the kernel modules do
not import triton at all: triton is imported and the function handed to it on the first launch.
Triton decides between compiling and interpreting when a function is *defined*, its own
library (`tl.sum`, `tl.sigmoid`, ...) included, i.e. when triton is first imported. Keeping the
import lazy means importing `murmur.kernels` (by the model, by optim) neither needs a GPU driver
nor fixes the mode: `TRITON_INTERPRET=1` works if it is set before the first Triton launch of the
process (see `interpreter_ready`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

# MURMUR_KERNELS and MURMUR_COMPILE are read and checked by murmur.gpu_choice, which the commands'
# flags import without torch. KernelError and compile_requested are imported from here too.
from murmur.gpu_choice import CHOICES, KERNELS_ENV, KernelError, compile_requested, requested

INTERPRET_ENV = "TRITON_INTERPRET"
# Ops whose Triton kernel made the compiled training step faster than Inductor's code for the
# reference (train_throughput.json): under torch.compile with MURMUR_KERNELS=auto only these take
# Triton. On an H200 (torch 2.11, base preset) the fused cross-entropy gave +0.6% tokens/s and 8%
# less peak memory; the elementwise kernels made the compiled step slower (Inductor fuses the
# reference with its neighbours, which a kernel boundary prevents).
COMPILED_TRITON_OPS: frozenset[str] = frozenset({"linear_cross_entropy"})


def interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def under_vmap(*tensors: torch.Tensor) -> bool:
    """Whether any tensor is a functorch batched tensor (we are inside `torch.func.vmap`). The
    Triton custom ops have no batching rules, so vmapped callers (the simulator's stacked
    replicas) take the references, which vmap composes."""
    return any(torch._C._functorch.is_batchedtensor(t) for t in tensors)


def use_triton(*tensors: torch.Tensor, op: str | None = None) -> bool:
    """True when the Triton path should run for these tensors (all on one device). `op` names a
    model op: under torch.compile, `auto` keeps Triton only for the COMPILED_TRITON_OPS."""
    choice = requested()
    if choice == "torch" or under_vmap(*tensors):
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if choice not in CHOICES:   # a list of ops
        return on_cuda and op in choice.split(",")
    if choice == "triton":
        if not on_cuda and not interpreter_ready():
            raise KernelError(
                f"{KERNELS_ENV}=triton with CPU tensors needs {INTERPRET_ENV}=1, set before triton is "
                "first imported (or use a CUDA device)"
            )
        return True
    if op is not None and torch.compiler.is_compiling():
        return on_cuda and op in COMPILED_TRITON_OPS
    return on_cuda


def _functorch_active() -> bool:
    """Inside any torch.func transform (vmap, grad, ...), where torch.compile must not start."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def compile_enabled(x: torch.Tensor) -> bool:
    """Whether the model should run its forward through torch.compile for input `x`: `on`, or
    `auto` on a CUDA tensor. Never while already compiling (the caller compiled the whole model)
    or under vmap (the simulator's stacked replicas)."""
    choice = compile_requested()
    if choice == "off" or torch.compiler.is_compiling() or under_vmap(x) or _functorch_active():
        return False
    return choice == "on" or x.is_cuda


class LazyKernel:
    """A Triton kernel that is jitted (or wrapped by the interpreter) on its first launch.

    Triton reads the source from the module file and drops everything before `def`, so the
    `@lazy_jit` decorator line is invisible to it. Kernels declared this way must not call other
    Triton functions declared in this tree (keep helpers inline); `tl.*` is fine.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._jit: Any = None
        self._interpreted: bool | None = None

    def _get(self) -> Any:
        mode = interpreting()
        if self._jit is None or self._interpreted != mode:
            import triton
            import triton.language as tl

            # The kernel modules name `tl` only under TYPE_CHECKING; the kernel source needs it.
            self.fn.__globals__.setdefault("tl", tl)
            self._jit, self._interpreted = triton.jit(self.fn), mode
        return self._jit

    def __getitem__(self, grid: Any) -> Any:
        return self._get()[grid]

    def launch(self, grid: Any, *args: Any, **meta: Any) -> None:
        """Launch from inside a `training_op`: through `wrap_triton`, so torch.compile records the
        kernel itself; interpreted on the CPU, where fake tensors (shape propagation) skip it."""
        jit = self._get()
        if self._interpreted:
            from torch._subclasses.fake_tensor import is_fake

            if not any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
                jit[grid](*args, **meta)
            return
        from torch.library import wrap_triton

        wrap_triton(jit)[grid](*args, **meta)


def interpreter_ready() -> bool:
    """Whether Triton kernels can run on CPU tensors in this process: TRITON_INTERPRET=1 is set
    and triton was not already imported without it (its library functions would be compiled)."""
    if not interpreting():
        return False
    import sys

    if "triton.language" not in sys.modules:
        return True
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sys.modules["triton.language"].sum, InterpretedFunction)


def lazy_jit(fn: Callable[..., Any]) -> LazyKernel:
    return LazyKernel(fn)


class TrainingOp:
    """A training op: `torch.library.triton_op` over a function of torch ops and
    `LazyKernel.launch`es (its fake is the function itself, traced), or, under the interpreter, a
    `custom_op` with that same function as its fake.

    Where CUDA is available the op is made at import, so that it exists before torch.compile
    traces a call (dynamo cannot trace `triton_op` itself: on torch 2.11 that was a graph break at
    every op). Elsewhere it is made on the first call, because triton_op imports triton, which
    must not happen before the interpreter mode is known (see above). Calls go to the op's
    OpOverload, which dynamo puts in the graph as it is."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name, self.fn = name, fn
        self._op: Any = None
        self._overload: Any = None
        if torch.cuda.is_available() and not interpreting():
            self._make()

    def _make(self) -> None:
        if interpreting():
            op = torch.library.custom_op(self.name, self.fn, mutates_args=())
            op.register_fake(self.fn)
        else:
            op = torch.library.triton_op(self.name, self.fn, mutates_args=())
        self._op, self._overload = op, op._opoverload

    def register_autograd(self, backward: Callable[..., Any], *, setup_context: Callable[..., Any]) -> None:
        self._autograd = (backward, setup_context)
        if self._op is not None:
            self._op.register_autograd(backward, setup_context=setup_context)

    @property
    def op(self) -> Any:
        if self._op is None:
            self._make()
            if getattr(self, "_autograd", None):
                self._op.register_autograd(self._autograd[0], setup_context=self._autograd[1])
        return self._op

    def __call__(self, *args: Any) -> Any:
        if self._overload is None:
            self.op  # noqa: B018 - makes the op
        return self._overload(*args)


def training_op(name: str) -> Callable[[Callable[..., Any]], TrainingOp]:
    return lambda fn: TrainingOp(name, fn)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def write_out(vals: torch.Tensor, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
    """The references' shared ending: return ``vals``, or write it into ``out`` (adding when ``accumulate``)."""
    if out is None:
        return vals
    if accumulate:
        out += vals.to(out.dtype)
    else:
        out.copy_(vals)
    return out
