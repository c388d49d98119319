"""How many intra-op threads `murmur eval` and `murmur generate` give torch (`--threads`).

One on the CPU unless asked: a model small enough to sample on a CPU has ops too small to split, and
on a machine whose cores are busy (a volunteer's own node training beside it, anything else)
torch's threads spend their time waiting on each other. Measured on 2 cores with two busy loops
(benchmarks/generate_busy.py): torch's default threads sampled at 1.7-2.1 tokens/s against 110 for
one (58x), and evaluated 5.7x slower. The demo's sampler (node/export/demo.py) forces one thread
for the same reason. On a GPU the threads only feed the kernel launches, so torch's default stays.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from murmur.errors import MurmurError

if TYPE_CHECKING:
    import torch

TORCH_DEFAULT = 0  # --threads 0: leave torch's own choice (one a core, or OMP_NUM_THREADS)


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op threads (default: 1 on the CPU, which stays fast when the cores are busy; "
        "torch's own default on a GPU; 0: torch's default)",
    )


def check_threads(threads: int | None) -> None:
    """A negative --threads is one line, before anything loads."""
    if threads is not None and threads < 0:
        raise MurmurError(f"--threads must not be negative, not {threads} (0: torch's default)")


def use_threads(threads: int | None, device: torch.device) -> int:
    """Set torch's intra-op threads for ``device`` as --threads asks; returns the number in use."""
    import torch  # here, not at the top: the CLIs import this module before their arguments hold up

    if threads is None:
        threads = 1 if device.type == "cpu" else TORCH_DEFAULT
    if threads != TORCH_DEFAULT:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
