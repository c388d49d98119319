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
    coord = services["coordinator"]["command"]
    assert coord[:2] == ["coordinator", "serve"]
    args = build_parser(coord).parse_args(coord)
    assert args.listen == "0.0.0.0:7700" and args.node_listen == "0.0.0.0:7701"
    node = services["node"]
    assert node["command"] == ["node", "run"]
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
    assert services["node"].get("stop_signal") == "SIGTERM"


def test_dockerfile_installs_both_variants_and_runs_murmur():
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert "ARG VARIANT=cpu" in text and '"$VARIANT" = "gpu"' in text
    assert 'ENTRYPOINT ["murmur"]' in text
    for folder in ("murmur", "protocol", "optim", "kernels", "node", "coordinator"):
        assert f"COPY {folder} ./{folder}" in text
