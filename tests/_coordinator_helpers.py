"""A real coordinator process for tests, the real `murmur admin` CLI, and a joined member client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from murmur.node.testnet.procs import run_murmur, start_murmur
from murmur.protocol import identity
from murmur.protocol.coordinator_client import MemberClient, join_run

# A ledger's run config and a clock that moves only when a test sets ``t`` (in-process ledger tests).
CONFIG = 'name = "r"\n[model]\npreset = "tiny"\n'


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


START_TIMEOUT_S = 30.0
CLI_TIMEOUT_S = 60.0
FAST = [
    "--heartbeat-interval",
    "0.2",
    "--heartbeat-ttl",
    "1.5",
    "--lease-ttl",
    "1.5",
    "--sweep-interval",
    "0.1",
    "--restart-grace",
    "5",
]

CONFIG_TOML = """
name = "test-run"
[model]
preset = "tiny"
[train]
steps = 10
batch_size = 2
[sync]
inner_steps = 10
overlap_steps = 1
"""


def write_run_files(folder: Path, shard_tokens: list[int]) -> tuple[Path, Path]:
    config = folder / "run.toml"
    config.write_text(CONFIG_TOML)
    manifest = folder / "manifest.json"
    manifest.write_text(
        json.dumps(
            {
                "format_version": 1,
                "shards": [{"id": i, "file": f"shard_{i:05d}.bin", "tokens": n} for i, n in enumerate(shard_tokens)],
            }
        )
    )
    return config, manifest


@dataclass
class CoordinatorProc:
    db: Path
    proc: subprocess.Popen[str]
    info: dict[str, Any]
    extra: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return str(self.info["address"])

    @property
    def admin_args(self) -> list[str]:
        return ["--coordinator", self.address, "--admin-key", str(self.info["admin_key_file"])]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


def start_coordinator(db: Path, *extra: str, listen: str = "127.0.0.1:0", dht: bool = False) -> CoordinatorProc:
    args = [
        "coordinator",
        "serve",
        "--db",
        str(db),
        "--listen",
        listen,
        "--node-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        *([] if dht else ["--no-dht"]),
        *extra,
    ]
    proc = start_murmur(args, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the one JSON line, or EOF if it died
    if not line or time.monotonic() > deadline:
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        proc.wait()
        raise RuntimeError(f"coordinator did not start: {err}")
    return CoordinatorProc(db, proc, json.loads(line), list(extra))


def admin(
    coord: CoordinatorProc | None,
    *args: str,
    creds: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    base = coord.admin_args if (coord is not None and creds) else []
    if coord is not None and not creds:
        base = ["--coordinator", coord.address, "--ca-cert", str(coord.info["ca_cert_file"])]
    # The common options belong to the leaf command: put them after the verb(s).
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MURMUR_ADMIN")}
    full_env.update(env or {})
    return run_murmur(["admin", *args, *base], env=full_env, timeout=CLI_TIMEOUT_S)


def admin_json(coord: CoordinatorProc, *args: str) -> Any:
    result = admin(coord, *args, "--output", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def new_token(coord: CoordinatorProc, *args: str) -> str:
    return str(admin_json(coord, "tokens", "create", *args)["token"])


async def join(coord: CoordinatorProc, token: str, name: str = "") -> tuple[MemberClient, str]:
    key = identity.generate_key()
    ident, info = await join_run(coord.address, token, key, name=name)
    return MemberClient(info.node_address, ident, server_name=info.tls_server_name), info.node_id


def closed_pipe_run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``murmur <args>`` writing into a pipe whose reader has already gone (`| head -1` after its
    line): every write fails with EPIPE, with no race about who finishes first."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "murmur.cli", *args], stdout=write, stderr=subprocess.PIPE,
                                text=True)
    finally:
        os.close(write)
    _, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


@contextmanager
def stalled_run(tmp_path: Path) -> Iterator[CoordinatorProc]:
    """A coordinator (`--stall-after 1`) whose run has one active member that completes no round,
    once the run shows as stalled: what the admin table, /api/status, /metrics and the page say."""
    import asyncio

    from murmur.node.testnet.procs import wait_for

    coord = start_coordinator(tmp_path / "coord.db", "--heartbeat-ttl", "120", "--lease-ttl", "120",
                              "--stall-after", "1")
    try:
        config, manifest = write_run_files(tmp_path, [1000])
        assert admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
        token = new_token(coord)

        async def member() -> None:
            client, _ = await join(coord, token)
            async with client:
                await client.heartbeat(tokens_per_s=10.0)

        asyncio.run(member())
        wait_for(lambda: admin_json(coord, "status")["stalled"], timeout_s=60, what="the run to stall")
        yield coord
    finally:
        coord.stop()
