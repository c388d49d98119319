"""Shared checks for the kernel tests: per-dtype tolerances and a readable mismatch report."""

from __future__ import annotations

import pytest
import torch

# (atol, rtol) per dtype of the compared tensors; loose enough for one rounding of the output
# dtype plus fp32 reordering, tight enough to catch a wrong formula.
TOL = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, dtype: torch.dtype | None = None,
                 scale_atol: bool = True) -> None:
    """Elementwise |got - want| <= atol * max(1, max|want|) + rtol * |want|, with a report.

    `scale_atol` scales the absolute tolerance with the tensor's magnitude: gradients that sum
    over many rows (dw) grow with the row count, and so does their rounding.
    """
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    atol, rtol = TOL[dtype or want.dtype]
    if got.numel() == 0:
        return
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    mag = max(1.0, w.abs().max().item()) if scale_atol else 1.0
    err = (g - w).abs()
    bad = err > atol * mag + rtol * w.abs()
    bad |= torch.isnan(g) != torch.isnan(w)
    if bad.any():
        i = int(err.nan_to_num(float("inf")).argmax())
        where = tuple(int(c) for c in torch.unravel_index(torch.tensor(i), g.shape))
        rms = (err.nan_to_num(0).pow(2).mean().sqrt() / w.pow(2).mean().sqrt().clamp_min(1e-30)).item()
        pytest.fail(
            f"{what} ({dtype or want.dtype}, shape {tuple(g.shape)}): {int(bad.sum())} of {g.numel()} "
            f"elements off; worst at {where}: got {g.flatten()[i].item():.6g}, want "
            f"{w.flatten()[i].item():.6g} (|err| {err.flatten()[i].item():.3g}); relative rms error "
            f"{rms:.3g}; atol {atol} x {mag:.3g}, rtol {rtol}"
        )


def interpreter_subprocess(test_file: str) -> None:
    """Run `test_file` in a fresh interpreter with TRITON_INTERPRET=1 and fail on any failure.

    Used when triton was already imported in this pytest process without the interpreter (its
    own library functions are then compiled, not interpreted, and cannot run on the CPU).
    """
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"interpreter tests failed in a subprocess:\n{proc.stdout[-6000:]}"
