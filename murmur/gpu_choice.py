"""The GPU path the environment asks for: ``MURMUR_KERNELS`` and ``MURMUR_COMPILE``, read and checked.

The kernels' dispatch (kernels/dispatch.py) reads these at every call; the commands' `--kernels`
and `--compile` flags (node/train/gpu_path.py) write and check them before anything runs. This
module holds the names, the choices and the two readers apart from the kernels so that the flags
can be declared and a bad value refused without importing torch: `murmur node run --help` and a
usage error answer in a fraction of a second, not after seconds of torch imports. Importing any
module of murmur.kernels imports torch (its package imports every kernel), so this lives beside
murmur.errors, below the kernels.
"""

from __future__ import annotations

import os

from murmur.errors import MurmurError

KERNELS_ENV = "MURMUR_KERNELS"
COMPILE_ENV = "MURMUR_COMPILE"
CHOICES = ("auto", "triton", "torch")
COMPILE_CHOICES = ("auto", "on", "off")
MODEL_OPS = ("rms_norm", "rotary", "swiglu", "linear_cross_entropy")


class KernelError(MurmurError):
    """Bad arguments to a kernel entry point, or an impossible implementation choice."""


def requested() -> str:
    choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES and not set(choice.split(",")) <= set(MODEL_OPS):
        raise KernelError(f"{KERNELS_ENV}={choice!r} is not one of {'|'.join(CHOICES)} nor a comma-separated "
                          f"list of {','.join(MODEL_OPS)}")
    return choice


def compile_requested() -> str:
    choice = os.environ.get(COMPILE_ENV, "auto").strip().lower() or "auto"
    if choice not in COMPILE_CHOICES:
        raise KernelError(f"{COMPILE_ENV}={choice!r} is not one of {'|'.join(COMPILE_CHOICES)}")
    return choice


def check_device_name(name: str) -> str:
    """``--device`` as written: auto, cpu, cuda or cuda:N (one GPU of several), else a one-line
    error. Whether that GPU exists is node/train/build.py's resolve_device (it needs torch)."""
    name = name.strip().lower()
    if name in ("auto", "cpu", "cuda"):
        return name
    kind, _, index = name.partition(":")
    if kind == "cuda" and index.isdigit():
        return f"cuda:{int(index)}"
    raise MurmurError(f"--device {name!r}: use auto, cpu, cuda or cuda:N (N: a GPU's index, from 0)")
