"""A local network as real processes: one coordinator and N nodes on loopback.

Used by `murmur testnet`, the node tests and the benchmarks, so all of them run the same entry
points a deployment runs (`murmur coordinator serve`, `murmur admin ...`, `murmur node run`).
Every process starts in its own session so that it can be killed with whatever it spawned
(hivemind's p2pd) and nothing outlives the network. Ports are all 0: the coordinator prints the
addresses it bound, and nodes bind their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from murmur.errors import MurmurError
from murmur.node.testnet import warm
from murmur.protocol.scratch_dirs import pid_running

COORDINATOR_START_TIMEOUT_S = 60.0  # the coordinator prints its listening line within this
ADMIN_TIMEOUT_S = 60.0  # one `murmur admin` call
STOP_TIMEOUT_S = 30.0  # a SIGTERMed process exits within this, else it is killed (with its group)

T = TypeVar("T")


class TestnetError(MurmurError):
    pass


def stop_like_ctrl_c() -> None:
    """From now on SIGTERM stops this testnet as Ctrl+C does: the KeyboardInterrupt lands in the
    run's loop, whose ``finally`` stops every node, the coordinator and its DHT. SIGTERM's default
    ended this process at once and left them all running, orphaned (a `timeout`, a service manager
    or a CI job's end sends it). Once stopping, a second SIGTERM or Ctrl+C is ignored with a line:
    cut half-way, the stop left the same orphans (SIGKILL still ends this process at once)."""
    if threading.current_thread() is not threading.main_thread():
        return  # a test's thread: its signals are the test's
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping:
            print(f"already stopping ({signal.Signals(signum).name} ignored): the nodes and the coordinator "
                  "are being stopped", file=sys.stderr, flush=True)
            return
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def murmur_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "murmur.cli", *args]


def run_murmur(args: list[str], *, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``murmur <args>`` to its end, output captured (text): forked warm unless warm starts are off."""
    if warm.enabled():
        return warm.run(args, env=env, timeout=timeout)
    return subprocess.run(murmur_cmd(*args), capture_output=True, text=True, timeout=timeout, env=env)


def start_module(module: str, args: list[str], *, env: dict[str, str], stdout, stderr, cwd=None, text: bool = False,
                 prefix: list[str] | None = None):
    """``python -m <module> <args>`` as a process of its own session: forked warm from the fork
    server (node/testnet/warm.py) unless warm starts are off or the command runs under a prefix
    (``ip netns exec NS``). Returns a `subprocess.Popen` or its warm stand-in (the same calls)."""
    if warm.enabled() and not prefix:
        return warm.popen(args, env=env, stdout=stdout, stderr=stderr, cwd=cwd, text=text, module=module)
    return subprocess.Popen([*(prefix or []), sys.executable, "-m", module, *args], stdout=stdout, stderr=stderr,
                            env=env, cwd=cwd, text=text, start_new_session=True)


def start_murmur(args: list[str], *, env: dict[str, str], stdout, stderr, text: bool = False,
                 prefix: list[str] | None = None):
    """``murmur <args>`` (see `start_module`)."""
    return start_module("murmur.cli", args, env=env, stdout=stdout, stderr=stderr, text=text, prefix=prefix)


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if threads:
        # Several nodes share the CPU: one BLAS/OpenMP thread each avoids oversubscription.
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a process and everything in its session (it was started with start_new_session).

    A process already reaped gave its pid back, and pids wrap within minutes on a busy machine (the
    suite on 2 cores went past 32,768 in 16 minutes): the number may be a new session leader's now,
    another test's coordinator, whose group this would kill. So a reaped process's group is
    signalled only while no process holds its number: its members are then what it left behind
    (Linux gives a number out again only once no process uses it as a pid, group or session id)."""
    if proc.poll() is not None and pid_running(proc.pid):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _kill_and_wait(proc: subprocess.Popen, name: str) -> None:
    """SIGKILL the process's group and the process itself, and wait for it. A chaos test once
    waited 11 minutes here for a node that trained on (the group's signal never reached it; not
    explained): the process is signalled by its own pid too, and a kill that does not end it
    within STOP_TIMEOUT_S fails the caller in one line instead of hanging it."""
    kill_group(proc)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise TestnetError(f"{name} (pid {proc.pid}) still runs {STOP_TIMEOUT_S:g} s after SIGKILL") from None


def stop_process(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM, wait, then SIGKILL the group; returns the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.wait()
    kill_group(proc)  # anything the process left in its session (it should have left nothing)
    return proc.returncode


@dataclass(slots=True)
class NodeProc:
    index: int
    state_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    kills: int = 0
    # What the command runs under, e.g. ["ip", "netns", "exec", NS]: a node on another host
    # (a network namespace), kept across restarts.
    prefix: list[str] = field(default_factory=list)
    # Arguments of this node alone, at every start (a restart too): e.g. `--speeds`' slow fault.
    args: list[str] = field(default_factory=list)
    _log: IO[bytes] | None = None

    @property
    def name(self) -> str:
        return f"node-{self.index}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass(slots=True)
class Testnet:
    """Coordinator + nodes under one folder. Use as a context manager: everything stops on exit."""

    root: Path
    config_path: Path
    data: Path
    threads: int = 1
    node_args: list[str] = field(default_factory=list)
    coordinator_args: list[str] = field(default_factory=list)
    coordinator: subprocess.Popen | None = None
    info: dict[str, Any] = field(default_factory=dict)
    token: str = ""
    nodes: list[NodeProc] = field(default_factory=list)
    run_id: str = ""
    _coord_log: IO[bytes] | None = None

    # -- the coordinator ----------------------------------------------------------------------------

    @property
    def db(self) -> Path:
        return self.root / "coordinator.db"

    def start_coordinator(self, listen: str = "127.0.0.1:0") -> dict[str, Any]:
        """Start (or restart, on the same ledger and, when given, the same address) the coordinator."""
        self.root.mkdir(parents=True, exist_ok=True)
        err = open(self.root / "coordinator.log", "ab")  # noqa: SIM115 - closed in stop()
        args = ["coordinator", "serve", "--db", str(self.db), "--listen", listen, *self.coordinator_args]
        if "--dht" not in self.coordinator_args:
            # The coordinator's DHT is on by default; a testnet has it only when coordinator_args
            # say --dht, else its nodes bootstrap from each other (dht_bootstrap below): both paths
            # are tested.
            args.append("--no-dht")
        if self.info.get("node_address") and listen != "127.0.0.1:0":
            # A restart keeps both addresses (nodes hold them); metrics may move.
            args += ["--node-listen", str(self.info["node_address"]), "--metrics-listen", "127.0.0.1:0"]
        self.coordinator = start_murmur(args, env=_env(0), stdout=subprocess.PIPE, stderr=err)
        self._coord_log = err
        line = self._read_line(self.coordinator, COORDINATOR_START_TIMEOUT_S)
        try:
            info = json.loads(line)
        except json.JSONDecodeError:
            raise TestnetError(
                f"the coordinator did not start: {self._tail(self.root / 'coordinator.log')}"
            ) from None
        self.info = info
        # Keep draining its stdout so it never blocks on a full pipe.
        threading.Thread(target=self._drain, args=(self.coordinator,), daemon=True).start()
        return info

    def restart_coordinator(self) -> dict[str, Any]:
        """Stop and start again on the same ledger and addresses (nodes keep their address)."""
        address = str(self.info["address"])
        self.stop_coordinator()
        return self.start_coordinator(address)

    def kill_coordinator(self) -> None:
        if self.coordinator is not None:
            _kill_and_wait(self.coordinator, "the coordinator")

    def stop_coordinator(self) -> int:
        code = stop_process(self.coordinator) if self.coordinator is not None else 0
        if self._coord_log is not None:
            self._coord_log.close()
            self._coord_log = None
        return code

    @staticmethod
    def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
        out: list[str] = []

        def read() -> None:
            assert proc.stdout is not None
            out.append(proc.stdout.readline().decode(errors="replace"))

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout_s)
        return out[0] if out else ""

    @staticmethod
    def _drain(proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for _ in proc.stdout:
            pass

    @staticmethod
    def _tail(path: Path, lines: int = 5) -> str:
        try:
            return " / ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- admin ------------------------------------------------------------------------------------

    def admin(self, *args: str) -> Any:
        """One `murmur admin` call with JSON output."""
        done = run_murmur(
            ["admin", *args, "--coordinator", str(self.info["address"]), "--admin-key",
             str(self.info["admin_key_file"]), "--output", "json"],
            env=_env(0), timeout=ADMIN_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise TestnetError(f"murmur admin {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
        return json.loads(done.stdout) if done.stdout.strip() else None

    def create_run(self, token_uses: int) -> str:
        run = self.admin(
            "runs",
            "create",
            "--config",
            str(self.config_path),
            "--manifest",
            str(self.data / "manifest.json"),
        )
        self.run_id = run["run_id"]
        tok = self.admin(
            "tokens", "create", "--run", self.run_id, "--uses", str(token_uses), "--note", "testnet"
        )
        self.token = tok["token"]
        return self.token

    # -- nodes ------------------------------------------------------------------------------------

    def add_node(
        self, start: bool = True, extra: list[str] | None = None, prefix: list[str] | None = None,
        args: list[str] | None = None,
    ) -> NodeProc:
        i = len(self.nodes)
        node = NodeProc(i, self.root / "nodes" / f"node-{i}", self.root / "nodes" / f"node-{i}.log")
        node.prefix = list(prefix or [])
        node.args = list(args or [])
        self.nodes.append(node)
        if start:
            self.start_node(node, extra)
        return node

    def dht_bootstrap(self) -> list[str]:
        """DHT multiaddrs a new node can join through: the coordinator's if it runs a DHT, else
        those of any running node (its peer.json), waiting for the first node's if need be."""
        if self.info.get("dht"):
            return []  # the coordinator hands them out in the join reply
        # Every live node's addresses, not just the first one's: one node killed a moment ago must
        # not leave a restart with nothing but a dead bootstrap address.
        found: list[str] = []
        for other in self.nodes:
            peer = other.state_dir / "peer.json"
            if other.alive() and peer.is_file():
                with contextlib.suppress(json.JSONDecodeError, OSError):
                    found += list(json.loads(peer.read_text()).get("dht", []))[:2]
        return found

    def wait_dht_bootstrap(self, timeout_s: float = COORDINATOR_START_TIMEOUT_S) -> list[str]:
        found: list[list[str]] = []
        wait_for(
            lambda: (
                bool(found.append(self.dht_bootstrap()) or found[-1])
                or not any(n.alive() for n in self.nodes)
            ),
            timeout_s,
            what="a node's DHT address",
        )
        return found[-1]

    def start_node(self, node: NodeProc, extra: list[str] | None = None) -> None:
        node.state_dir.mkdir(parents=True, exist_ok=True)
        # The previous incarnation's addresses are dead; until this one writes its own, no other
        # node may bootstrap from them.
        (node.state_dir / "peer.json").unlink(missing_ok=True)
        if "--solo" not in self.node_args and not self.info.get("dht"):
            extra = [*(extra or []), *[a for m in self.dht_bootstrap() for a in ("--dht-peer", m)]]
        if node._log is not None:
            node._log.close()
        node._log = open(node.log_path, "ab")  # noqa: SIM115 - closed when the node stops
        args = [
            "node",
            "run",
            "--coordinator",
            str(self.info["address"]),
            "--token",
            self.token,
            "--state-dir",
            str(node.state_dir),
            "--data",
            str(self.data),
            "--threads",
            str(self.threads),
            "--name",
            node.name,  # node-0, node-1, ...: the testnet's rows and the status page say the same
            *self.node_args,
            *node.args,
            *(extra or []),
        ]
        node.proc = start_murmur(args, env=_env(self.threads), stdout=node._log, stderr=subprocess.STDOUT,
                                 prefix=node.prefix)
        node.starts += 1

    def kill_node(self, node: NodeProc) -> None:
        """SIGKILL, as a crash or a pulled plug: the node and whatever it spawned."""
        if node.proc is not None:
            _kill_and_wait(node.proc, node.name)
            node.kills += 1

    def stop_node(self, node: NodeProc) -> int | None:
        if node.proc is None:
            return None
        code = stop_process(node.proc)
        if node._log is not None:
            node._log.close()
            node._log = None
        return code

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every node (in parallel), then the coordinator; returns exit codes by name."""
        codes = self.stop_nodes()
        codes["coordinator"] = self.stop_coordinator()
        return codes

    def stop_nodes(self) -> dict[str, int | None]:
        """SIGTERM every node (in parallel) and wait; the coordinator keeps running (its ledger
        can be read after). Exit codes by name."""
        codes: dict[str, int | None] = {}

        def one(n: NodeProc) -> None:
            codes[n.name] = self.stop_node(n)

        threads = [threading.Thread(target=one, args=(n,)) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return codes

    def __enter__(self) -> Testnet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for(predicate: Callable[[], T], timeout_s: float = 20.0, poll_s: float = 0.2, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy, and return that (files and processes of
    other programs have no event to await); TestnetError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TestnetError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(poll_s)
    return value
