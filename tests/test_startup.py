"""Start-up stays light: help, version and usage errors answer without torch, hivemind or scipy,
and a coordinator without a DHT serves without them.

Those imports take 2-3 s on an idle 2-core machine and up to 10 s under load. Each command runs in
a fresh interpreter (a subprocess each), which reports the heavy packages in sys.modules after the
command returned: what a person typing `murmur node run` would have paid for.
"""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys

import pytest

HEAVY = ("torch", "hivemind", "scipy")
MARK = "startup-probe "
# Runs one command in-process as the `murmur` program does, then says which heavy packages it
# imported and its exit code (argparse's --help, --version and usage errors exit through SystemExit).
PROBE = f"""
import json, sys
from murmur.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as stop:
    rc = stop.code
print({MARK!r} + json.dumps([sorted(m for m in {HEAVY!r} if m in sys.modules), rc]))
"""


def _probe(argv: list[str]) -> tuple[list[str], int, str, str]:
    """(heavy packages imported, exit code, stdout without the probe's line, stderr)."""
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    out, _, line = done.stdout.rpartition(MARK)
    assert line, f"the probe did not finish: {done.stderr[-2000:]}"
    heavy, rc = json.loads(line)
    return heavy, rc, out, done.stderr


HELP = [
    ["--help"],
    ["--version"],
    ["data", "--help"],
    ["data", "prepare", "--help"],
    ["data", "info", "--help"],
    ["train", "--help"],
    ["export", "--help"],
    ["eval", "--help"],
    ["generate", "--help"],
    ["sim", "--help"],
    ["node", "--help"],
    ["node", "run", "--help"],
    ["testnet", "--help"],
    ["testnet", "up", "--help"],
    ["testnet", "chaos", "--help"],
    ["coordinator", "--help"],
    ["coordinator", "serve", "--help"],
    ["admin", "--help"],
    ["admin", "runs", "create", "--help"],
    ["admin", "tokens", "create", "--help"],
    ["admin", "status", "--help"],
]


@pytest.mark.parametrize("argv", HELP, ids=" ".join)
def test_help_and_version_import_no_heavy_package(argv):
    heavy, rc, out, err = _probe(argv)
    assert rc == 0, err
    assert "usage: murmur" in out or out.startswith("murmur "), out
    assert heavy == [], f"murmur {' '.join(argv)} imported {heavy}"


def test_node_run_without_a_coordinator_is_a_usage_error_without_heavy_imports(monkeypatch):
    monkeypatch.delenv("MURMUR_COORDINATOR", raising=False)
    heavy, rc, _, err = _probe(["node", "run"])
    assert rc == 1
    assert err == "error: --coordinator HOST:PORT is required (or set MURMUR_COORDINATOR)\n", err
    assert heavy == [], f"murmur node run imported {heavy}"


@pytest.mark.parametrize(
    ("argv", "rc", "needle"),
    [
        (["node"], 2, "the following arguments are required: VERB"),
        (["node", "run", "--coordinator", "127.0.0.1:9", "--threads", "-1"], 1, "must not be negative"),
        (["node", "run", "--coordinator", "127.0.0.1:9", "--kernels", "fast"], 1, "MURMUR_KERNELS='fast'"),
        (["train", "--steps", "many"], 2, "invalid int value: 'many'"),
        (["train", "--compile", "maybe"], 2, "invalid choice: 'maybe'"),
        (["export", "run"], 2, "the following arguments are required: --out"),
        (["eval", "run", "--data", "d", "--batches", "0"], 1, "--batches must be at least 1"),
        (["generate", "run", "--max-new-tokens", "-1"], 1, "--max-new-tokens must not be negative"),
        (["sim", "--workers", "0"], 1, "--workers must be at least 1"),
        (["sim", "--engine", "gpu"], 2, "invalid choice: 'gpu'"),
        (["sim", "--seeds", "0,0", "--set", "nope=1"], 1, "nope"),
        (["testnet", "up", "--nodes", "0"], 1, "--nodes"),
        (["coordinator", "serve"], 2, "the following arguments are required: --db"),
        (["admin", "tokens", "create", "--uses", "x"], 2, "invalid int value: 'x'"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_bad_input_is_refused_without_heavy_imports(monkeypatch, argv, rc, needle):
    monkeypatch.delenv("MURMUR_KERNELS", raising=False)
    monkeypatch.delenv("MURMUR_COMPILE", raising=False)
    heavy, code, _, err = _probe(argv)
    assert code == rc and needle in err, err
    assert heavy == [], f"murmur {' '.join(argv)} imported {heavy}"


def test_the_sim_commands_engine_names_are_the_engines():
    """`murmur sim --engine` lists its choices without importing the engines (which import torch)."""
    from murmur.node.sim.cli import ENGINE_NAMES
    from murmur.node.sim.run import ENGINES

    assert list(ENGINE_NAMES) == list(ENGINES)


def test_a_coordinator_without_a_dht_serves_without_torch_hivemind_or_scipy(tmp_path):
    """`coordinator serve --no-dht` imports no hivemind (nor, through it, torch and scipy): the
    DHT (on by default) is the only part of the coordinator that needs them."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "murmur.cli", "coordinator", "serve", "--db",
         str(tmp_path / "c.db"), "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--no-dht"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()  # the listening line: every import of serving is done by then
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert json.loads(line)["event"] == "listening", err[-2000:]
    imported = {row.rpartition("|")[2].strip() for row in err.splitlines() if row.startswith("import time:")}
    assert "murmur.coordinator.server" in imported  # the report covers serving
    assert not {m for m in imported if m.split(".")[0] in HEAVY}, sorted(imported)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_coordinator_s_stderr_lines_carry_the_time(tmp_path, fmt):
    """The coordinator's own lines (its serving banner, its warnings) are stamped as a node's are, or
    one JSON object each with --log-format json."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "murmur.cli", "coordinator", "serve", "--db", str(tmp_path / "c.db"),
         "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--no-dht", "--log-format", fmt],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert json.loads(proc.stdout.readline())["event"] == "listening"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    banner = [line for line in err.splitlines() if "murmur coordinator: serving" in line]
    assert len(banner) == 1, err[-2000:]
    if fmt == "json":
        record = json.loads(banner[0])
        assert record["msg"].startswith("murmur coordinator: serving") and record["at"] > 0
    else:
        stamp = banner[0].split(" ", 1)[0]
        assert datetime.datetime.fromisoformat(stamp).tzinfo is not None, banner[0]
