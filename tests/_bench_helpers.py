"""Importing a script of benchmarks/ by name, as its own spawned row processes import it (and the
scripts beside it, quality.py and sparseloco_cpu.py), and forgetting it afterwards."""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@contextlib.contextmanager
def benchmark_module(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    before = set(sys.modules)
    try:
        yield importlib.import_module(name)
    finally:
        for added in set(sys.modules) - before:
            if getattr(sys.modules[added], "__file__", None) and Path(sys.modules[added].__file__).parent == BENCHMARKS:
                sys.modules.pop(added, None)
        sys.path.remove(str(BENCHMARKS))
