"""The umbrella `murmur` command: one sub-app per noun, each mounted from the package that owns it.

Sub-apps are imported lazily so `murmur data ...` does not pay for gRPC or hivemind imports.
Each module named below exposes ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed arguments, returning an exit code). Those modules stay light:
torch, hivemind and scipy (seconds of imports) are imported by ``func`` once the arguments hold
up, never to declare them, so --help, --version and usage errors answer at once
(tests/test_startup.py).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import os
import signal
import sys

from murmur import __version__
from murmur.errors import MurmurError
from murmur.library_logs import quiet_library_logs

EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # what a shell reports for a tool that SIGPIPE ended

# noun -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "data": ("murmur.node.model.data_cli", "prepare and inspect token datasets"),
    "train": ("murmur.node.train.train_cli", "train one model on this machine"),
    "sim": ("murmur.node.sim.cli", "simulate K workers of a low-communication run in one process"),
    "node": ("murmur.node.daemon.cli", "run a volunteer node"),
    "testnet": ("murmur.node.testnet.cli", "a local network: coordinator and nodes on loopback"),
    "coordinator": ("murmur.coordinator.cli", "serve a run's coordinator"),
    "admin": ("murmur.coordinator.admin", "operate a coordinator: runs, tokens, nodes, status"),
    "export": ("murmur.node.export.export_cli", "write a run's model as a Llama folder that transformers loads"),
    "eval": ("murmur.node.export.eval_cli", "validation loss and perplexity of a checkpoint or export"),
    "generate": ("murmur.node.export.generate_cli", "sample text from a checkpoint or export"),
}


def _noun(argv: list[str]) -> str | None:
    """The sub-app asked for: the first argument that names one."""
    return next((a for a in argv if a in SUBCOMMANDS), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="murmur", description="Train language models on lent machines.")
    parser.add_argument("--version", action="version", version=f"murmur {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only import the sub-app that is asked for; list the others by name for --help.
    wanted = _noun(argv)
    for noun, (module, help_text) in SUBCOMMANDS.items():
        if noun == wanted:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(noun, help=help_text, add_help=False)
    return parser


STOPPED_WHILE_STARTING = b"stopped (SIGTERM) while starting\n"


def _stop_while_starting(signum: int, frame: object) -> None:
    """SIGTERM came before the node's event loop took the signal over: the process ends here, at
    once, with exit 0 and one line, wherever its main thread is. Until then a node has joined
    nothing and holds nothing (no lock, lease, socket or child; the loop takes SIGTERM over before
    any), so there is nothing to clean up. Raising from here instead unwound whatever the main
    thread ran, an import most of the time, and a C extension interrupted half-way through its
    import (numpy's) failed on the next one with a traceback and exit 1 (issue 37). Deferring the
    stop to a safe point would leave the node importing torch for seconds after it was told to go."""
    try:
        sys.stdout.flush()  # what the node printed so far (a flush this interrupted is not redone)
    except Exception:  # noqa: BLE001, S110 - a reentrant flush, a closed pipe: nothing to keep then
        pass
    os.write(2, STOPPED_WHILE_STARTING)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    as_program = argv is None  # not called from a test's process, whose signals are its own
    argv = list(sys.argv[1:] if argv is None else argv)
    if as_program:  # before any sub-app imports grpc or hivemind, which read their settings then
        quiet_library_logs()
        # A crash in native code (gRPC's core, torch) ends the process without a Python word: the
        # coordinator under 10,000 simulated nodes died so, its log ending at "serving", and only
        # the kernel's log said "segfault ... in cygrpc". Every thread's Python stack goes to
        # stderr (the log) instead.
        faulthandler.enable()
    if as_program and _noun(argv) == "node":
        # A node SIGTERMed while it still imports torch and grpc (a testnet stopped right after a
        # chaos restart; node/daemon/cli.py imports them once its arguments hold up) has joined
        # nothing and holds nothing: it stops as cleanly as a running node (exit 0), not killed by
        # the signal (-15), nor with a traceback from an import cut short. The node's loop takes
        # SIGTERM over later.
        signal.signal(signal.SIGTERM, _stop_while_starting)
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # what is still buffered: a reader that went away shows here, not at exit
    except BrokenPipeError:
        # The reader went away (`murmur admin events | head -1`): stop quietly, as `cat` does.
        # Whatever is still buffered for stdout goes nowhere, so the interpreter's last flush
        # cannot raise again on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: list[str]) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except MurmurError as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
