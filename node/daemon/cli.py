"""`murmur node`: run a volunteer node.

    murmur node run --coordinator HOST:PORT --token TOKEN [--data DIR] [--device auto|cpu|cuda]
                    [--state-dir DIR] [--listen HOST:PORT] [--metrics-listen HOST:PORT|off]
                    [--role auto|stage|driver]

The node joins the run the token admits to (certificate, run config), meets its peers through
the DHT, takes the current global state (local checkpoint, or peers when the run has moved on),
leases a shard, and trains: H inner steps, an exchange round with the run's algorithm, codec and
aggregator, the outer step, a progress commit; again and again. SIGTERM or Ctrl+C: the node
finishes its step, commits, releases its lease, leaves and exits 0. Every flag also reads an
environment variable (MURMUR_COORDINATOR, MURMUR_TOKEN, ...), which is how deploy/compose.yaml
configures it. The device and the data folder are checked before the node joins: a mistake there
spends no use of the token and leaves no member behind. A pipelined run (a ``[pipeline]`` section
in its config) is not trained data parallel: the node serves one stage of it or drives
microbatches through the stages, as ``--role`` and the coordinator decide
(node/daemon/pipeline_role.py, docs/pipeline.md "Joining a pipelined run").

``--fault SPEC`` (repeatable, hidden from --help) arms a fault of the production injector
(node/net/faults.py) in the node's exchange: ``poison_sign@x*`` poisons every round's update,
``delay:rendezvous:5@3`` waits 5 s before round 3's rendezvous, ``slow:3@x*`` makes every inner
step take 3x as long (a slower volunteer; `murmur testnet --speeds`); tests and the chaos tool use it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from murmur.errors import MurmurError
from murmur.gpu_choice import check_device_name
from murmur.logline import FORMATS, line_writer
from murmur.node.daemon.settings import NodeSettings
from murmur.node.train.gpu_path import add_gpu_path_flags, apply_gpu_path_flags
from murmur.protocol.node_name import check_node_name

DEFAULT_STATE_DIR = "~/.murmur/node"
ROLES = ("auto", "stage", "driver")  # node/daemon/pipeline_role.py says what each does


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="run a volunteer node")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    r = verbs.add_parser(
        "run",
        help="join a run and train until it ends or you stop it",
        description=__doc__.split("\n\n")[2] if __doc__ else None,
    )
    r.add_argument(
        "--coordinator",
        default=_env("MURMUR_COORDINATOR"),
        help="the coordinator's public address HOST:PORT (env MURMUR_COORDINATOR)",
    )
    r.add_argument(
        "--token",
        default=_env("MURMUR_TOKEN"),
        help="join token from `murmur admin tokens create` (env MURMUR_TOKEN); "
        "not needed to restart a node that already joined",
    )
    r.add_argument(
        "--name",
        default=_env("MURMUR_NAME", ""),
        help="a name for this node, shown beside its id in `murmur admin` and on the status page "
        "(set when it joins; env MURMUR_NAME)",
    )
    r.add_argument(
        "--role",
        choices=("auto", "stage", "driver"),
        default=_env("MURMUR_ROLE", "auto"),
        help="in a pipelined run (a [pipeline] section in its config): serve a stage, drive, or auto: the "
        "coordinator decides (a driver while the run has fewer than pipeline.drivers, else a stage peer); "
        "a data-parallel run ignores auto (default %(default)s; env MURMUR_ROLE)",
    )
    r.add_argument(
        "--data",
        default=_env("MURMUR_DATA"),
        help="the run's prepared dataset (default: the run config's data.path; env MURMUR_DATA)",
    )
    r.add_argument(
        "--device",
        default=_env("MURMUR_DEVICE", "auto"),
        help="auto, cpu, cuda or cuda:N, one GPU of several (env MURMUR_DEVICE; "
        "CUDA_VISIBLE_DEVICES decides which GPUs this process sees)",
    )
    r.add_argument(
        "--state-dir",
        default=_env("MURMUR_STATE_DIR", DEFAULT_STATE_DIR),
        help="identity, checkpoint and commit journal (default %(default)s; env MURMUR_STATE_DIR)",
    )
    r.add_argument(
        "--listen",
        default=_env("MURMUR_LISTEN", "127.0.0.1:0"),
        help="the peer server's address (default %(default)s; env MURMUR_LISTEN)",
    )
    r.add_argument(
        "--advertise-host",
        default=_env("MURMUR_ADVERTISE_HOST", ""),
        help="the host peers should dial (default: the --listen host; env MURMUR_ADVERTISE_HOST)",
    )
    r.add_argument(
        "--client-mode",
        choices=("auto", "on", "off"),
        default=_env("MURMUR_CLIENT_MODE", "auto"),
        help="for a node nobody can dial (behind a NAT): own no span, serve no state. auto: the "
        "coordinator dials the peer server back and decides; off: fail if it cannot "
        "(default %(default)s; env MURMUR_CLIENT_MODE)",
    )
    r.add_argument(
        "--metrics-listen",
        default=_env("MURMUR_METRICS_LISTEN", "127.0.0.1:0"),
        help="Prometheus /metrics address, or 'off' (default %(default)s; env MURMUR_METRICS_LISTEN)",
    )
    r.add_argument(
        "--threads",
        type=int,
        default=int(_env("MURMUR_THREADS", "0") or 0),
        help="torch threads (0: torch's default; env MURMUR_THREADS)",
    )
    r.add_argument(
        "--gpus",
        type=int,
        default=int(_env("MURMUR_GPUS", "1") or 1),
        help="local ranks training data parallel inside this node: one GPU each on a CUDA machine "
        "(NCCL), CPU processes otherwise (gloo); one identity, lease and exchange (default 1; env MURMUR_GPUS)",
    )
    r.add_argument(
        "--max-rounds", type=int, default=0, help="stop after this many rounds (0: run to the end)"
    )
    r.add_argument("--solo", action="store_true", help="train alone: a one-member exchange, no peers")
    r.add_argument(
        "--dht-peer",
        action="append",
        default=(_env("MURMUR_DHT_PEERS", "") or "").split(),
        metavar="MULTIADDR",
        help="a DHT peer to bootstrap from, besides the coordinator's "
        "(repeatable; env MURMUR_DHT_PEERS, space-separated)",
    )
    r.add_argument(
        "--min-peers",
        type=int,
        default=int(_env("MURMUR_MIN_PEERS", "1") or 1),
        help="wait (up to 60 s) for this many peers (this one included) before the first round, "
        "and for as many members at its rendezvous (default 1)",
    )
    r.add_argument(
        "--log-format",
        choices=FORMATS,
        default=_env("MURMUR_LOG_FORMAT", "text"),
        help="each log line stamped with its time as text, or one JSON object a line "
        "(default %(default)s; env MURMUR_LOG_FORMAT)",
    )
    r.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help=argparse.SUPPRESS,  # tests and the chaos tool: a fault of node/net/faults.py, e.g. poison_sign@x*
    )
    d = NodeSettings()
    for name in NodeSettings.names():
        flag = "--" + name.removesuffix("_s").replace("_", "-")
        kind = type(getattr(d, name))
        r.add_argument(flag, dest=name, type=kind, default=getattr(d, name), help=argparse.SUPPRESS)
    add_gpu_path_flags(r)
    r.set_defaults(func=_run)


def _faults(specs: list[str]):
    """The production fault injector armed with ``specs`` (None without any): one-line errors."""
    if not specs:
        return None
    from murmur.node.net.faults import FaultError, FaultInjector  # torch: only when faults are asked for

    try:
        injector = FaultInjector.parse(specs)
    except FaultError as err:
        raise MurmurError(f"--fault: {err}") from None
    injector.release_on_signal()  # SIGUSR1 ends a delay early: tests hold a point until an event
    return injector


def _debug_log(level: str | None) -> None:
    """MURMUR_LOG_LEVEL=debug: the exchange's attempts (who met, who was left out and why) on
    stderr with timestamps, for reading a stalled round after the fact."""
    if not level:
        return
    name = level.upper()
    if name not in logging.getLevelNamesMapping():
        raise MurmurError(f"MURMUR_LOG_LEVEL={level!r} is not a logging level (debug, info, warning)")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    root = logging.getLogger("murmur")
    root.addHandler(handler)
    root.setLevel(name)


def _run(args: argparse.Namespace) -> int:
    apply_gpu_path_flags(args)
    if not args.coordinator:
        raise MurmurError("--coordinator HOST:PORT is required (or set MURMUR_COORDINATOR)")
    if args.threads < 0 or args.max_rounds < 0:
        raise MurmurError("--threads and --max-rounds must not be negative")
    if args.gpus < 1:
        raise MurmurError(f"--gpus must be at least 1, not {args.gpus}")
    args.device = check_device_name(args.device)
    args.name = check_node_name(args.name)
    if args.role not in ROLES:  # from MURMUR_ROLE, which argparse's choices do not check
        raise MurmurError(f"--role {args.role!r}: use {', '.join(ROLES)}")
    if args.log_format not in FORMATS:  # from MURMUR_LOG_FORMAT, which argparse's choices do not check
        raise MurmurError(f"--log-format {args.log_format!r}: use {' or '.join(FORMATS)}")
    if args.gpus > 1 and ":" in args.device:
        raise MurmurError(
            f"--device {args.device} picks one GPU but --gpus {args.gpus} uses cuda:0 to cuda:{args.gpus - 1}: "
            "choose the GPUs with CUDA_VISIBLE_DEVICES instead"
        )
    settings = NodeSettings(**{name: getattr(args, name) for name in NodeSettings.names()})
    faults = _faults(args.fault)
    _debug_log(_env("MURMUR_LOG_LEVEL"))

    log = line_writer(args.log_format)

    # grpc, torch and the node's stack: only once the command line holds up, so a usage error
    # answers at once. Still before the event loop takes SIGTERM over: a node stopped during these
    # seconds of imports stops "while starting" (murmur/cli.py).
    from murmur.node.daemon.node import NodeOptions
    from murmur.node.daemon.pipeline_role import run_volunteer

    options = NodeOptions(
        coordinator=args.coordinator,
        token=args.token or None,
        name=args.name,
        state_dir=Path(os.path.expanduser(args.state_dir)),
        data=Path(args.data) if args.data else None,
        device=args.device,
        listen=args.listen,
        advertise_host=args.advertise_host,
        metrics_listen=args.metrics_listen,
        threads=args.threads,
        max_rounds=args.max_rounds,
        solo=args.solo,
        dht_peers=list(args.dht_peer),
        min_peers=max(1, args.min_peers),
        client_mode=args.client_mode,
        gpus=args.gpus,
        settings=settings,
        faults=faults,
        log=log,
        role=args.role,
    )
    code = run_volunteer(options)  # a pipelined run: a stage or a driver; else the node
    sys.stdout.flush()
    return code
