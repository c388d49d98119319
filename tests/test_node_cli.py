"""`murmur node run` refuses bad input with one line and leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

STARTUP_TIMEOUT_S = 240  # python, torch and grpc imports on a loaded 2-core machine


def _node(tmp_path, *args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "murmur.cli", "node", "run", "--state-dir", str(tmp_path / "state"), *args],
        capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S, env=env,
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "--coordinator"),
        (["--coordinator", "127.0.0.1:9"], "--token"),
        (["--coordinator", "127.0.0.1:9", "--token", "not-a-token"], "not a murmur join token"),
        (["--coordinator", "127.0.0.1:1", "--token", "mrm1.abcdefgh." + "s" * 16 + "." + "0" * 64],
         "cannot reach the coordinator"),
        (["--coordinator", "127.0.0.1:9", "--threads", "-1"], "must not be negative"),
        (["--coordinator", "127.0.0.1:9", "--device", "gpu"], "use auto, cpu, cuda or cuda:N"),
        (["--coordinator", "127.0.0.1:9", "--name", "a/b"], "--name 'a/b': at most 40 characters"),
        (["--coordinator", "127.0.0.1:9", "--device", "cuda:1", "--gpus", "2"], "CUDA_VISIBLE_DEVICES"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, needle):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MURMUR_")}
    done = _node(tmp_path, *args, env=env)
    assert done.returncode == 1, done.stderr
    assert needle in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_second_daemon_on_one_state_dir_is_refused(tmp_path):
    from murmur.node.daemon.state_dir import StateDir, StateDirError

    first = StateDir(tmp_path / "s")
    first.lock()
    try:
        with pytest.raises(StateDirError, match="another murmur node is running"):
            StateDir(tmp_path / "s").lock()
    finally:
        first.unlock()
    StateDir(tmp_path / "s").lock()  # free again once the first let go


def test_a_node_sigtermed_while_it_imports_stops_cleanly(tmp_path):
    """SIGTERM before the node's event loop takes the signal over (it still imports torch and
    hivemind: a testnet stopped right after a chaos restart): exit 0 and one line, as a running
    node stops, not killed by the signal (-15, which the testnet reports as an unclean exit)."""
    import signal

    # -X importtime prints each import as it completes: the node's settings module is imported by
    # the node sub-app, after the CLI took SIGTERM over and before the node's stack (torch, grpc:
    # seconds of imports), which `node run` imports once its arguments hold up. A fixed sleep lost
    # that race on a loaded CI machine: the node got to its token error first.
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "murmur.cli", "node", "run", "--state-dir", str(tmp_path / "state"),
         "--coordinator", "127.0.0.1:9", "--token", "not-a-token"],
        stderr=subprocess.PIPE, text=True,
    )
    for line in proc.stderr:
        if line.rstrip().endswith("murmur.node.daemon.settings"):
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=STARTUP_TIMEOUT_S)
    err = "\n".join(line for line in rest.splitlines() if not line.startswith("import time:"))
    imported = {line.rpartition("|")[2].strip() for line in rest.splitlines() if line.startswith("import time:")}
    # The signal landed while the node's stack was still importing: its module never finished.
    assert "murmur.node.daemon.node" not in imported, err
    assert proc.returncode == 0, err
    assert err.strip() == "stopped (SIGTERM) while starting", err
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def test_device_names():
    from murmur.errors import MurmurError
    from murmur.gpu_choice import check_device_name

    assert [check_device_name(n) for n in ("auto", "CPU", "cuda", "cuda:1", "cuda:01")] == [
        "auto", "cpu", "cuda", "cuda:1", "cuda:1"]
    for bad in ("gpu", "cuda:", "cuda:-1", "cuda:x", "mps"):
        with pytest.raises(MurmurError, match="cuda:N"):
            check_device_name(bad)


def test_help_keeps_the_test_only_fault_flag_out():
    done = subprocess.run([sys.executable, "-m", "murmur.cli", "node", "run", "--help"],
                          capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert "--fault" not in done.stdout and "poison" not in done.stdout, done.stdout
    assert "cuda:N" in done.stdout and "CUDA_VISIBLE_DEVICES" in done.stdout


def test_a_bad_log_format_from_the_environment_is_one_line(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MURMUR_")} | {"MURMUR_LOG_FORMAT": "xml"}
    done = _node(tmp_path, "--coordinator", "127.0.0.1:9", env=env)
    assert done.returncode == 1 and done.stderr == "error: --log-format 'xml': use text or json\n", done.stderr


def test_node_names():
    from murmur.errors import MurmurError
    from murmur.protocol.node_name import check_node_name

    assert check_node_name("  alice's laptop ") == "alice's laptop" and check_node_name("") == ""
    assert check_node_name("gpu-box_2.lan@home") == "gpu-box_2.lan@home"
    for bad in ("x" * 41, "-dash", "tab\there", "<b>", "ünï"):
        with pytest.raises(MurmurError, match="at most 40 characters"):
            check_node_name(bad)
