"""Stage peers and drivers as real processes on loopback, for the pipeline tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _net_helpers import REPO, python_env
from _node_helpers import ledger, make_testnet

from murmur.node.testnet.procs import Testnet, start_module
from murmur.protocol.coordinator_client import join_run
from murmur.protocol.identity import CertificateAuthority, Identity, generate_key

RUN = "pipe-test"
# A model small enough that a microbatch takes milliseconds on one CPU core.
MODEL = ["--stages", "2", "--preset", "tiny", "--n-layers", "2", "--dim", "64", "--hidden-dim", "160",
         "--seq-len", "64", "--seed", "3"]
MICROBATCH = 4
TOKENS_PER_MB = MICROBATCH * 64
START_TIMEOUT = 120  # torch import on a loaded 2-core machine
RUN_TIMEOUT = 240
# A clean stop (SIGTERM) is bounded by the peer's own deadlines at the shipped 30 s sync period:
# the round in flight (22.5 s), the mates' stop marks (stop_sync_s, 10 s), the last round (7.5 s +
# 2 x 22.5 s), waiting for the mates to finish theirs (22.5 s), then the final checkpoint: about
# 110 s before the load of a 2-core CI machine. A peer still running past this is a hung stop.
STOP_TIMEOUT = 240
# Shards of 32 microbatches (the `small_shards` fixture of tests/conftest.py): a schedule of 40 or
# more spans several leases.
SMALL_SHARD_TOKENS = 1 << 13


def wait_until(what: str, ok, timeout_s: float = RUN_TIMEOUT, every_s: float = 0.2):
    """Poll ``ok`` until it returns something truthy, and return that; AssertionError naming
    ``what`` after ``timeout_s`` (processes and files have no event to await)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = ok()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


class LoggedProc:
    """A process whose stdout goes to a file, not a pipe: a driver prints a JSON line a
    microbatch, and a pipe the test reads only at the end held about 150 of them (64 KiB) before
    the driver's event loop blocked on a write, heartbeats and all (a fast machine got there
    before a test's restart was over). Everything else is the process's own; ``communicate``
    waits and returns what it printed."""

    def __init__(self, proc, out: Path) -> None:
        self._proc, self.out = proc, out

    def __getattr__(self, name: str):
        return getattr(self._proc, name)

    def printed(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def records(self) -> list[dict]:
        """The JSON lines it printed so far (a line still being written is left out)."""
        text = self.printed()
        return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self._proc.wait(timeout)
        return self.printed(), None


def start_logged(module: str, args: list[str], out_stem: Path, **kw) -> LoggedProc:
    """``python -m module args`` with its stdout in a new file beside ``out_stem`` (a restart
    under the same name gets the next one)."""
    n = 0
    while (out := out_stem.with_name(f"{out_stem.name}.{n}.out")).exists():
        n += 1
    with open(out, "w") as f:  # the child holds its own descriptor
        proc = start_module(module, args, stdout=f, text=True, env=python_env(), cwd=REPO, **kw)
    return LoggedProc(proc, out)


def _records_until(proc: LoggedProc, last, what: str) -> list[dict]:
    """Its records up to the first for which ``last(record)`` holds; RuntimeError naming ``what``
    if it exits first."""
    while True:
        exited = proc.poll() is not None  # asked first: all it printed before exiting is in the file
        got = proc.records()
        for i, record in enumerate(got):
            if last(record):
                return got[: i + 1]
        if exited:
            raise RuntimeError(f"{what} (rc {proc.returncode})")
        time.sleep(0.05)


@dataclass
class PeerProc:
    proc: LoggedProc
    ready: dict
    stopped: dict = field(default_factory=dict)
    lines: list[dict] = field(default_factory=list)  # everything it printed, "ready" aside
    stop_error: str = ""  # why `stop_all` found no "stopped" line, if it did not

    @property
    def node_id(self) -> str:
        return self.ready["node_id"]

    def record(self) -> dict:
        return {k: self.ready[k] for k in ("node_id", "address", "stage", "state_address")}


def membership(ca: CertificateAuthority, folder: Path, join: tuple[str, str] | None) -> list[str]:
    """How a process gets its certificate: joining the coordinator with a token, or from ``ca``."""
    if join is not None:
        return ["--coordinator", join[0], "--token", join[1]]
    ca.issue().save(folder)
    return ["--identity", str(folder), "--run", RUN]


def start_peer(ca: CertificateAuthority, folder: Path, stage: int, *extra: str,
               join: tuple[str, str] | None = None) -> PeerProc:
    args = [*membership(ca, folder, join), "--stage", str(stage), *MODEL, "--target-samples", "8", "--lr", "3e-3",
            *extra]
    proc = start_logged("murmur.node.pipeline.stage_peer_process", args, folder, stderr=None)
    (ready,) = _records_until(proc, lambda r: True, "stage peer exited before it was ready")
    return PeerProc(proc, ready)


def start_run_peer(folder: Path, join: tuple[str, str], *extra: str) -> PeerProc:
    """A stage peer of a pipelined run: the model, the pipeline and (without --stage) its stage
    come from the coordinator."""
    log = folder.with_suffix(".log")
    with open(log, "ab") as err:  # the child holds its own descriptor
        proc = start_logged("murmur.node.pipeline.stage_peer_process",
                            ["--coordinator", join[0], "--token", join[1], *extra], folder, stderr=err)
    # the stage it was assigned comes first
    got = _records_until(proc, lambda r: r.get("event") == "ready", f"stage peer exited before it was ready; see {log}")
    return PeerProc(proc, got[-1], lines=got[:-1])


def stop_peer(p: PeerProc) -> None:
    """SIGTERM it (unless it is gone already) and read what it printed to the end."""
    _terminate(p)
    _read_to_end(p)


def _terminate(p: PeerProc) -> None:
    if p.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.proc.send_signal(signal.SIGTERM)


def _read_to_end(p: PeerProc) -> None:
    try:
        p.proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:  # what it printed before it hung still counts
        p.proc.kill()
        p.proc.wait()
        p.stop_error = f"still running {STOP_TIMEOUT} s after its SIGTERM: killed"
    p.lines += p.proc.records()[len(p.lines) + 1 :]  # those it printed since: "ready" is not in lines
    p.stopped = next((r for r in p.lines if r.get("event") == "stopped"), {})
    if not p.stopped and not p.stop_error:
        p.stop_error = f"exited with {p.proc.returncode} and no stopped line"


def write_peers(path: Path, peers: list[PeerProc]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"peers": [p.record() for p in peers]}))
    tmp.replace(path)  # the driver re-reads it: never a half-written file


@contextlib.contextmanager
def stage_peers(
    tmp_path: Path, stages: list[list[list[str]]], join: tuple[str, str] | None = None
) -> Iterator[tuple[CertificateAuthority, list[PeerProc]]]:
    """``stages[s]`` lists the extra arguments of each peer of stage s; ``join``: (coordinator
    address, token) to join a run with, else identities of a fresh CA."""
    ca = CertificateAuthority.create("pipe-test")
    peers: list[PeerProc] = []
    try:
        for s, extras in enumerate(stages):
            for j, extra in enumerate(extras):
                peers.append(start_peer(ca, tmp_path / f"peer-{s}-{j}", s, *extra, join=join))
        write_peers(tmp_path / "peers.json", peers)
        yield ca, peers
    finally:
        stop_all(peers)


def stop_all(peers: list[PeerProc]) -> None:
    """SIGTERM every peer at once, then read what each printed; SIGKILL any that does not stop.
    At once: a peer stopped while the others still serve empties its stage, and the coordinator
    moves one of them there before its own SIGTERM comes."""
    for p in peers:
        _terminate(p)
    for p in peers:
        with contextlib.suppress(Exception):
            _read_to_end(p)
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


def start_driver(ca: CertificateAuthority | None, tmp_path: Path, data: Path, name: str, *extra: str,
                 join: tuple[str, str] | None = None) -> LoggedProc:
    """A driver; with ``ca`` None it drives a pipelined run (the run config and the coordinator
    name the model, the pipeline and the peers)."""
    if ca is None:
        assert join is not None
        shape = ["--coordinator", join[0], "--token", join[1]]
    else:
        shape = [*membership(ca, tmp_path / name, join), "--peers", str(tmp_path / "peers.json"), *MODEL,
                 "--microbatch-size", str(MICROBATCH)]
    args = [*shape, "--data", str(data), "--commit-log", str(tmp_path / f"{name}.commits"), *extra]
    return start_logged("murmur.node.pipeline.driver_process", args, tmp_path / name, stderr=None)


def finish(driver: LoggedProc) -> str:
    """The driver's output once it exits (killed if it runs past RUN_TIMEOUT)."""
    try:
        out, _ = driver.communicate(timeout=RUN_TIMEOUT)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    return out


def records(out: str, event: str) -> list[dict]:
    return [r for r in map(json.loads, out.splitlines()) if r.get("event") == event]


def check_commits(commits: list[dict], total: int) -> None:
    """Contiguous, non-overlapping ranges from 0 that cover exactly ``total`` microbatches."""
    end = 0
    for c in commits:
        assert c["start"] == end and c["end"] > c["start"], commits
        assert c["tokens"] == (c["end"] - c["start"]) * TOKENS_PER_MB
        if "ledger_end" in c:  # what the coordinator's ledger was told
            assert c["ledger_end"] == c["end"] * TOKENS_PER_MB
        end = c["end"]
    assert end == total, (end, total)


@contextlib.contextmanager
def coordinator(
    tmp_path: Path, data: Path, joins: int, overrides: list[str] = (), coordinator_args: list[str] = ()
) -> Iterator[tuple[Testnet, tuple[str, str]]]:
    """A real coordinator with a run on ``data`` (the tiny testnet config with ``overrides``) and
    a token for ``joins`` members."""
    net = make_testnet(tmp_path / "net", data, overrides=list(overrides))
    net.coordinator_args = list(coordinator_args)
    try:
        net.start_coordinator()
        token = net.create_run(joins)
        yield net, (str(net.info["address"]), token)
    finally:
        net.stop_coordinator()


def ledger_tokens(net: Testnet) -> tuple[int, dict[int, int]]:
    """Tokens the run's ledger holds, and each shard's committed offset."""
    tokens, offsets, _ = ledger(net)
    return tokens, offsets


def watcher_identity(join: tuple[str, str]) -> Identity:
    """A member identity of the run, for a test that calls the stage peers itself."""
    ident, _ = asyncio.run(join_run(join[0], join[1], generate_key()))
    return ident


def val_through_stages(join: tuple[str, str], run_id: str, peers: list[PeerProc], batches) -> float:
    """The validation loss through the stage peers of a 2-stage run now (forward only, fp32
    activations): a member of the run calls them as a driver's evaluation does."""
    from murmur.node.pipeline.client import StageClient
    from murmur.node.pipeline.driver import Driver
    from murmur.node.pipeline.router import Router, StageEndpoint
    from murmur.protocol.runconfig import PipelineSection

    ident = watcher_identity(join)

    async def run() -> float:
        client = StageClient(ident, run_id=run_id)
        cfg = PipelineSection(stages=2, activation_codec="fp32", hop_timeout_s=60.0)
        router = Router(cfg)
        for s in (0, 1):
            router.set_peers(s, [StageEndpoint(p.node_id, p.ready["address"], s) for p in peers
                                 if p.ready["stage"] == s])
        try:
            driver = Driver(client, router, cfg, dim=64)
            losses = [await driver.evaluate(f"v{k}", x, y) for k, (x, y) in enumerate(batches)]
        finally:
            await client.aclose()
        return sum(losses) / len(losses)

    return asyncio.run(run())


def free_port_pair() -> int:
    """A port P with P and P + 1 free on loopback: a stage peer's fixed stage and peer-server ports."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two adjacent free ports")
