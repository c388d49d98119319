"""--kernels and --compile on train, node run and sim: a bad value is one line naming the choices,
a good one reaches the environment the model reads (and children inherit)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from murmur.node.train.gpu_path import add_gpu_path_flags, apply_gpu_path_flags


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--kernels", "bogus", "--steps", "1"],
        ["sim", "--kernels", "rms_norm,nope"],
        ["node", "run", "--kernels", "fast", "--coordinator", "127.0.0.1:1", "--token", "t"],
    ],
)
def test_a_bad_kernel_choice_is_one_line_naming_the_choices(argv):
    proc = subprocess.run([sys.executable, "-m", "murmur.cli", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: MURMUR_KERNELS="), proc.stderr
    assert "auto|triton|torch" in lines[0] and "linear_cross_entropy" in lines[0]


def test_good_choices_reach_the_environment(monkeypatch):
    monkeypatch.delenv("MURMUR_KERNELS", raising=False)
    monkeypatch.delenv("MURMUR_COMPILE", raising=False)
    p = argparse.ArgumentParser()
    add_gpu_path_flags(p)
    apply_gpu_path_flags(p.parse_args(["--kernels", "rotary,swiglu", "--compile", "off"]))
    assert os.environ["MURMUR_KERNELS"] == "rotary,swiglu" and os.environ["MURMUR_COMPILE"] == "off"
    # Nothing given: the environment (or the default) stands.
    apply_gpu_path_flags(p.parse_args([]))
    assert os.environ["MURMUR_KERNELS"] == "rotary,swiglu"
