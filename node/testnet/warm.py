"""Warm starts for the processes of a local network: a fork server that has already imported what a
node imports, and forks each node (or coordinator) from there.

A node process spends its first seconds importing torch, hivemind (and through it scipy), gRPC and
aiohttp, and its first optimizer imports torch._dynamo: about 4 s of CPU on an idle core, and 10 to
30 s when a testnet's processes start together on a loaded 2-core machine. The testnet, the chaos
runs (every restart) and the integration tests pay it for every process they start. Python's
`forkserver` start method is a zygote: started once, it imports the modules it is told to and forks
a child for each request. Here each child runs what `python -m murmur.cli ...` runs (`murmur.cli`
as ``__main__``, its SIGTERM-while-starting guard included; or another module's ``-m`` entry point,
such as a pipeline stage peer's) under its own argv, environment, working folder, session and
output files: a real process with its own pid, stopped by SIGTERM and killed by SIGKILL (with its
process group) like a cold one. What it skips is the imports.

Nothing in murmur reads the environment when it is imported (settings are read when a command
runs), so a child sees its own environment exactly as a cold process would. Triton is not
preloaded: it reads TRITON_INTERPRET when kernels are defined. The child's exit status is what the
module's ``sys.exit`` said, as for a cold process; atexit handlers run before it leaves (multiprocessing's
children skip them otherwise, and the DHT's shutdown is one). A traceback that ends a child is
printed under a ``Process <name>:`` line (multiprocessing's), with exit status 1 as for a cold one.

`MURMUR_WARM_START=0` turns it off (every process a cold `python -m murmur.cli`); a command with a
prefix (``ip netns exec NS``: a node on another host) always starts cold, and so does a command
that may use a GPU (``--device cuda``, or ``auto`` on a machine with a GPU): CUDA cannot be used in
a child forked from a process in which anything touched it ("Cannot re-initialize CUDA in forked
subprocess": every stage peer of ``murmur testnet up --stages 6 --device cuda`` died so on an H100),
and a GPU process pays the imports once for minutes of work anyway. `popen` starts those with exec (`needs_gpu`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
from multiprocessing import reduction
from pathlib import Path
from typing import IO

from murmur.library_logs import quiet_library_logs

WARM_ENV = "MURMUR_WARM_START"
# What the fork server imports before its first fork: the node's whole stack (the coordinator's is
# a part of it) and an optimizer's first-use imports (node/testnet/warm_preload.py).
PRELOAD = ["murmur.node.testnet.warm_preload"]

_lock = threading.Lock()
_context: multiprocessing.context.ForkServerContext | None = None


def enabled() -> bool:
    """Warm starts are on unless MURMUR_WARM_START is 0/false/off (and only where fork exists)."""
    value = os.environ.get(WARM_ENV, "1").strip().lower()
    return value not in ("0", "false", "off", "no") and "forkserver" in multiprocessing.get_all_start_methods()


def _server() -> multiprocessing.context.ForkServerContext:
    global _context
    with _lock:
        if _context is None:
            # The server imports grpc and hivemind for every child: their log settings must be in
            # its environment before it starts (murmur/library_logs.py).
            quiet_library_logs()
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _context = ctx
        return _context


def start_server() -> None:
    """Start the fork server now (it starts on the first warm process otherwise): a caller that
    watches its own children (the tests' leak check) can count it before anything else starts."""
    from multiprocessing import forkserver

    _server()
    forkserver.ensure_running()


class _Fd:
    """A file descriptor for the child, handed over through the fork server's own fd passing."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return (_Fd._rebuild, (reduction.DupFd(self.fd),))

    @staticmethod
    def _rebuild(dup) -> _Fd:
        return _Fd(dup.detach())


def _run_child(module: str, argv: list[str], env: dict[str, str], cwd: str | None, out: _Fd | None,
               err: _Fd | None, err_to_out: bool) -> None:
    """In the forked child: become a process of its own (session, output, folder, environment,
    argv) and run ``python -m <module> <argv>``'s code."""
    os.setsid()  # its own process group, so killing the group kills what it spawns (p2pd)
    if out is not None:
        os.dup2(out.fd, 1)
        os.close(out.fd)
    if err_to_out:
        os.dup2(1, 2)
    elif err is not None:
        os.dup2(err.fd, 2)
        os.close(err.fd)
    # Unbuffered text on the new descriptors, as PYTHONUNBUFFERED gives a cold process.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # A cold interpreter puts PYTHONPATH's folders at the front of sys.path; the server's sys.path
    # was made from the caller's at its start.
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[0:0] = extra
    sys.argv = [module, *argv]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # what `python -m` runs
    finally:
        atexit._run_exitfuncs()  # what a cold interpreter does on its way out


class WarmProcess:
    """The part of `subprocess.Popen` that the testnet and the tests use, for a forked child."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, args: list[str], stdout: IO | None,
                 stderr: IO | None) -> None:
        self._proc = proc
        self._wait_lock = threading.Lock()
        self.args = args
        self.pid: int = proc.pid
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None
        self._readers: list[threading.Thread] | None = None
        self._read: dict[str, object] = {}

    def poll(self) -> int | None:
        with self._wait_lock:
            if self.returncode is None:
                code = self._proc.exitcode
                if code is not None:
                    self.returncode = code
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._wait_lock:
            if self.returncode is None:
                self._proc.join(timeout)
                if self._proc.exitcode is None:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                self.returncode = self._proc.exitcode
            return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that may have been reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple:
        """Read the piped outputs to their end and wait: `Popen.communicate` without input. On a
        timeout the child keeps running (kill it, then call again), as with Popen."""
        if self._readers is None:  # once: a second call (after a timeout) waits on the same readers
            self._readers = [threading.Thread(target=lambda n=name, f=f: self._read.__setitem__(n, f.read()),
                                              daemon=True)
                             for name, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]
            for t in self._readers:
                t.start()
        self.wait(timeout)
        for t in self._readers:
            t.join()
        return self._read.get("out"), self._read.get("err")

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def needs_gpu(argv: list[str]) -> bool:
    """Whether the command may put work on a GPU: a ``--device`` other than ``cpu`` (``cuda``,
    ``cuda:N``), or ``auto`` on a machine that has a GPU (`gpu_here`). ``auto`` where there is none
    is the CPU: forked warm. It started cold too, and `murmur testnet up` and `chaos` pass every node
    ``--device auto`` by default: every node start and chaos restart paid the node's imports again
    (a restart's first round 21-31 s at load 3-18 against 4-5 s warm)."""
    for i, a in enumerate(argv):
        value = a.partition("=")[2] if a.startswith("--device=") else (
            argv[i + 1] if a == "--device" and i + 1 < len(argv) else None)
        if value is None:
            continue
        value = value.strip().lower()
        if value != "cpu" and (value != "auto" or gpu_here()):
            return True
    return False


@functools.cache
def gpu_here() -> bool:
    """Whether this machine shows a GPU device (an NVIDIA driver's, or ROCm's): asked of the
    kernel's device files, not of CUDA, so that nothing here touches CUDA (a fork from a process
    that did cannot use it). A GPU that a child's CUDA_VISIBLE_DEVICES hides still counts: such a
    child starts cold, which is only slower."""
    nvidia = Path("/proc/driver/nvidia/gpus")
    return bool(glob.glob("/dev/nvidia[0-9]*")) or (nvidia.is_dir() and any(nvidia.iterdir())) or \
        Path("/dev/kfd").exists()


def popen(argv: list[str], *, env: dict[str, str], stdout: IO | int | None = None, stderr: IO | int | None = None,
          cwd: str | Path | None = None, text: bool = False,
          module: str = "murmur.cli") -> WarmProcess | subprocess.Popen:
    """Start ``python -m <module> <argv>`` (``murmur <argv>`` by default) forked from the fork
    server, in a session of its own (as ``Popen(..., start_new_session=True)``). ``stdout`` and
    ``stderr``: a file, ``subprocess.PIPE`` (read it from ``.stdout``/``.stderr``: bytes, or str
    with ``text``) or None (the fork server's); ``stderr`` may also be ``subprocess.STDOUT``. A
    command that may use a GPU (`needs_gpu`) is not forked: it starts cold, with exec."""
    if needs_gpu(argv):
        return subprocess.Popen([sys.executable, "-m", module, *argv], stdout=stdout, stderr=stderr, env=env,
                                cwd=cwd, text=text, start_new_session=True)
    with contextlib.ExitStack() as closing:
        def target(stream) -> tuple[_Fd | None, IO | None]:
            if stream == subprocess.PIPE:
                read_fd, write_fd = os.pipe()
                closing.callback(os.close, write_fd)  # the child holds its own copy
                reader = open(read_fd, "rb")  # noqa: SIM115 - the caller reads and closes it
                return _Fd(write_fd), (io.TextIOWrapper(reader, errors="replace") if text else reader)
            return (None if stream is None else _Fd(stream.fileno())), None

        out, out_reader = target(stdout)
        err, err_reader = (None, None) if stderr == subprocess.STDOUT else target(stderr)
        folder = str(cwd) if cwd is not None else None
        proc = _server().Process(
            target=_run_child,
            args=(module, list(argv), dict(env), folder, out, err, stderr == subprocess.STDOUT),
            name=f"{module} " + " ".join(argv[:2]),
        )
        proc.start()
    return WarmProcess(proc, ["python", "-m", module, *argv], out_reader, err_reader)


def run(argv: list[str], *, env: dict[str, str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(..., capture_output=True, text=True, timeout=...)`` for ``murmur <argv>``,
    forked warm."""
    proc = popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # with anything it spawned, which may hold the pipes
        proc.communicate()
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
