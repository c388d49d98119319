"""`murmur testnet up` reads and checks its config and every argument before it clears the previous
run's folder: a typo is one line and the old ledger, CA, keys, logs and summary stay as they were."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 120  # python and pydantic imports on a loaded 2-core machine; no torch on this path

PREVIOUS_RUN = {
    "coordinator.db": b"ledger",
    "coordinator.db.ca.key": b"ca key",
    "coordinator.db.admin-key": b"admin key",
    "coordinator.log": b"log",
    "loss.png": b"png",
    "summary.json": b"{}",
    "run.toml": b'name = "previous"\n',
    "nodes/node-0.log": b"node log",
}


def _previous_run(out):
    for name, data in PREVIOUS_RUN.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)


def _files(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--config", "{bad}"], "nope"),  # a misspelt key in the file
        (["--set", "train.stepz=5"], "stepz"),
        (["--config", "{tmp}/missing.toml"], "missing.toml"),
        (["--gpus", "0"], "--gpus"),
        (["--threads", "-1"], "--threads"),
        (["--stages", "3", "--nodes", "2"], "--stages 3"),
        (["--nodes", "3", "--speeds", "1,2"], "--speeds gives 2 factors"),
        (["--nodes", "2", "--speeds", "1,0.5"], "at least 1"),
        (["--nodes", "2", "--speeds", "1,fast"], "one slowdown factor per node"),
    ],
)
def test_a_mistake_leaves_the_previous_run_untouched(tmp_path, args, needle):
    out = tmp_path / "testnet"
    _previous_run(out)
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nnope = 1\n[model]\npreset = "tiny"\n')
    before = _files(out)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MURMUR_")}
    done = subprocess.run(
        [sys.executable, "-m", "murmur.cli", "testnet", "up", "--out", str(out),
         *[a.format(bad=bad, tmp=tmp_path) for a in args]],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=REPO,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert needle in done.stderr, done.stderr
    assert _files(out) == before
