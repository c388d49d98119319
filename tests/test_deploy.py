"""deploy/: the compose file validates, and every command it runs is one the CLI accepts (the
tests elsewhere run those same entry points as local processes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from murmur.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "deploy" / "compose.yaml"
BINARY = REPO / ".venv" / "bin" / "docker-compose"


def _compose(tmp_path, *args, env=None):
    if not BINARY.exists():
        pytest.skip("the docker-compose binary of the dev extra is not installed")
    plugins = tmp_path / "cli-plugins"
    plugins.mkdir(exist_ok=True)
    shutil.copy(BINARY, plugins / "docker-compose")
    full_env = {**os.environ, "DOCKER_CONFIG": str(tmp_path), **(env or {})}
    if shutil.which("docker"):
        cmd = ["docker", "compose", "-f", str(COMPOSE), *args]
    else:
        cmd = [str(BINARY), "-f", str(COMPOSE), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=60)


def test_compose_file_validates(tmp_path):
    done = _compose(tmp_path, "config", "-q")
    assert done.returncode == 0, done.stderr


def test_compose_commands_are_real_cli_commands(tmp_path):
    done = _compose(
        tmp_path,
        "--profile",
        "admin",
        "config",
        "--format",
        "json",
        env={"MURMUR_TOKEN": "mrm1.x", "MURMUR_COORDINATOR": "c:7700"},
    )
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    assert {"coordinator", "node", "admin"} <= set(services)
    # The coordinator's entry script runs `murmur coordinator serve COMMAND...` (then creates the run).
    assert services["coordinator"]["entrypoint"] == ["murmur-compose-coordinator"]
    coord = ["coordinator", "serve", *services["coordinator"]["command"]]
    args = build_parser(coord).parse_args(coord)
    assert args.listen == "0.0.0.0:7700" and args.node_listen == "0.0.0.0:7701"
    assert 'murmur coordinator serve "$@"' in (REPO / "deploy" / "compose-coordinator.sh").read_text()
    node = services["node"]
    assert node["entrypoint"] == ["murmur-compose-node"] and not node.get("command")
    assert 'exec murmur node run "$@"' in (REPO / "deploy" / "compose-node.sh").read_text()
    env = node["environment"]
    assert env["MURMUR_COORDINATOR"] == "c:7700" and env["MURMUR_TOKEN"] == "mrm1.x"
    # The node reads its settings from these variables: parse as the container would.
    old = dict(os.environ)
    try:
        os.environ.update({k: str(v) for k, v in env.items()})
        parsed = build_parser(["node", "run"]).parse_args(["node", "run"])
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert parsed.coordinator == "c:7700" and parsed.listen == "0.0.0.0:7800"
    assert parsed.state_dir == "/state" and parsed.data == "/data/run"
    assert parsed.role == "auto"  # a pipelined run: the coordinator makes each replica a driver or a stage peer
    assert services["node"].get("stop_signal") == "SIGTERM"


def test_dockerfile_needs_no_registry_and_no_network():
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert "ARG BASE=murmur-base:bookworm" in text and "FROM ${BASE}" in text  # built by build-base.sh
    assert "ARG VARIANT=cpu" in text and "COPY build/wheels/${VARIANT}/deps/" in text
    assert "--no-index" in text and 'ENTRYPOINT ["murmur"]' in text
    base = (REPO / "deploy" / "build-base.sh").read_text()
    assert "debootstrap --variant=minbase" in base and "docker import" in base
    assert '"$PIP" wheel' in (REPO / "deploy" / "build-wheels.sh").read_text()


def test_loopback_override_keeps_every_socket_on_loopback(tmp_path):
    done = _compose(tmp_path, "-f", str(COMPOSE.parent / "compose.loopback.yaml"), "config", "--format", "json")
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    for name in ("coordinator", "node"):
        assert services[name]["network_mode"] == "host" and not services[name].get("ports")
    listens = [a for a in services["coordinator"]["command"] if "listen=" in a]
    assert listens and all("=127.0.0.1:" in a for a in listens), listens
    env = services["node"]["environment"]
    assert env["MURMUR_LISTEN"].startswith("127.0.0.1:") and env["MURMUR_METRICS_LISTEN"].startswith("127.0.0.1:")
