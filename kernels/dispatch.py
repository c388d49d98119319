"""Which implementation runs: Triton on CUDA tensors, the pure-torch reference on the CPU.

`MURMUR_KERNELS=triton|torch|auto` overrides the choice (read at every call, so tests can flip
it). `triton` on CPU tensors only works under `TRITON_INTERPRET=1` (the CPU test suite).

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

from murmur.errors import MurmurError

KERNELS_ENV = "MURMUR_KERNELS"
INTERPRET_ENV = "TRITON_INTERPRET"
CHOICES = ("auto", "triton", "torch")


class KernelError(MurmurError):
    """Bad arguments to a kernel entry point, or an impossible implementation choice."""


def interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def requested() -> str:
    choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise KernelError(f"{KERNELS_ENV}={choice!r} is not one of {'|'.join(CHOICES)}")
    return choice


def under_vmap(*tensors: torch.Tensor) -> bool:
    """Whether any tensor is a functorch batched tensor (we are inside `torch.func.vmap`). The
    Triton custom ops have no batching rules, so vmapped callers (the simulator's stacked
    replicas) take the references, which vmap composes."""
    return any(torch._C._functorch.is_batchedtensor(t) for t in tensors)


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton path should run for these tensors (all on one device)."""
    choice = requested()
    if choice == "torch" or under_vmap(*tensors):
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if choice == "triton":
        if not on_cuda and not interpreter_ready():
            raise KernelError(
                f"{KERNELS_ENV}=triton with CPU tensors needs {INTERPRET_ENV}=1, set before triton is "
                "first imported (or use a CUDA device)"
            )
        return True
    return on_cuda


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
