"""Warm starts (node/testnet/warm.py): a process forked from the fork server behaves as a cold
`python -m murmur.cli` would, to the caller and to itself: its own argv, environment, folder,
session and output; its exit status; SIGTERM and SIGKILL land on it and on what it spawned; its
atexit handlers run. Real forked processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from murmur.node.testnet import warm
from murmur.node.testnet.procs import kill_group, run_murmur, start_module, start_murmur

pytestmark = pytest.mark.skipif(not warm.enabled(), reason="warm starts are off (MURMUR_WARM_START=0) or no fork")

# A module run as `python -m probe`: reports what it sees, spawns a grandchild on request, sleeps
# on request, exits with the code asked for.
PROBE = textwrap.dedent('''
    import atexit, json, os, signal, subprocess, sys, time
    mode = sys.argv[1]
    atexit.register(lambda: open(os.environ["PROBE_ATEXIT"], "w").write("ran"))
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
                      "absent": os.environ.get("PROBE_ABSENT"), "sid": os.getsid(0), "pid": os.getpid(),
                      "name": __name__}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if mode == "spawn":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(json.dumps({"grandchild": child.pid}), flush=True)
    if mode in ("spawn", "sleep"):
        time.sleep(600)
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
''')


@pytest.fixture
def probe(tmp_path, monkeypatch):
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PROBE_VALUE": "mine", "PROBE_ATEXIT": str(tmp_path / "atexit")}
    monkeypatch.setenv("PROBE_ABSENT", "the caller's, not the child's")
    return env


def start(env, *argv, cwd=None, stderr=subprocess.PIPE):
    return start_module("probe", list(argv), env=env, stdout=subprocess.PIPE, stderr=stderr, cwd=cwd, text=True)


def test_a_warm_child_has_its_own_argv_env_folder_session_and_output(probe, tmp_path):
    proc = start(probe, "exit", "7", cwd=tmp_path)
    assert isinstance(proc, warm.WarmProcess)
    out, err = proc.communicate(timeout=60)
    seen = json.loads(out.splitlines()[0])
    assert seen["argv"] == ["exit", "7"] and seen["name"] == "__main__"
    assert seen["cwd"] == str(tmp_path)
    assert seen["env"] == "mine" and seen["absent"] is None  # its environment, not the server's
    assert seen["sid"] == seen["pid"] == proc.pid  # a session of its own, like start_new_session
    assert err.strip() == "to stderr"
    assert proc.returncode == 7
    assert (tmp_path / "atexit").read_text() == "ran"


def test_stderr_can_join_stdout_and_a_traceback_exits_1(probe, tmp_path):
    proc = start(probe, "exit", "not-a-number", stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=60)
    assert "to stderr" in out and "ValueError" in out
    assert proc.returncode == 1


def test_sigterm_and_sigkill_land_on_the_child_and_its_group(probe):
    proc = start(probe, "sleep")
    assert json.loads(proc.stdout.readline())["argv"] == ["sleep"]
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM

    proc = start(probe, "spawn")
    proc.stdout.readline()
    grandchild = json.loads(proc.stdout.readline())["grandchild"]
    kill_group(proc)  # as the testnet kills a node: the node and everything in its session
    assert proc.wait(60) == -signal.SIGKILL
    psutil.wait_procs([psutil.Process(grandchild)], timeout=30)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    proc.stdout.close()
    proc.stderr.close()


def test_murmur_commands_run_warm_as_they_run_cold(tmp_path):
    env = dict(os.environ)
    warm_done = run_murmur(["node", "run"], env=env, timeout=120)
    cold = subprocess.run([sys.executable, "-m", "murmur.cli", "node", "run"], capture_output=True, text=True,
                          timeout=120)
    assert (warm_done.returncode, warm_done.stdout, warm_done.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert warm_done.returncode == 1 and "--coordinator" in warm_done.stderr
    assert run_murmur(["--version"], env=env, timeout=60).stdout.startswith("murmur ")


@pytest.mark.skipif(warm.gpu_here(), reason="this machine has a GPU: --device auto may use it, so it starts cold")
def test_a_testnets_nodes_start_warm_on_a_machine_without_a_gpu(tmp_path):
    """`murmur testnet up` and `chaos` give every node ``--device auto`` (node/testnet/cli.py). Where
    there is no GPU that is the CPU, and the node is forked warm: it was started cold, and every chaos
    restart paid the node's imports again (first rounds 21-31 s after a restart instead of 4-5 s)."""
    from murmur.node.testnet.cli import LOOPBACK_NODE

    with open(tmp_path / "out", "w") as out:  # no --coordinator: the node's one line, exit 1
        proc = start_murmur(["node", "run", *LOOPBACK_NODE, "--device", "auto"], env=dict(os.environ), stdout=out,
                            stderr=subprocess.STDOUT, text=True)
    assert isinstance(proc, warm.WarmProcess)  # forked from the fork server, not exec'd
    assert proc.wait(120) == 1 and "--coordinator" in (tmp_path / "out").read_text()
    assert warm.needs_gpu(["--device", "cuda"])  # a GPU asked for by name still starts cold


def test_warm_starts_can_be_turned_off(probe, monkeypatch):
    monkeypatch.setenv(warm.WARM_ENV, "0")
    assert not warm.enabled()
    proc = start(probe, "exit", "3")
    assert isinstance(proc, subprocess.Popen)
    out, _ = proc.communicate(timeout=120)
    assert json.loads(out.splitlines()[0])["sid"] == proc.pid and proc.returncode == 3
