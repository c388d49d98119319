"""`murmur coordinator serve`: run a coordinator on one SQLite file."""

from __future__ import annotations

import argparse
from pathlib import Path

from murmur.logline import FORMATS

from .settings import CoordinatorSettings


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("coordinator", help="serve a run's coordinator")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    serve = verbs.add_parser(
        "serve",
        help="serve the control plane on one SQLite ledger",
        description="Serve the run's control plane. Prints one JSON line with the bound addresses, the CA "
        "fingerprint and the admin credential's file, then serves until SIGINT/SIGTERM.",
    )
    serve.add_argument("--db", required=True, type=Path, help="the ledger (created on first start)")
    serve.add_argument(
        "--listen",
        default="127.0.0.1:7700",
        help="public address: join and admin calls, server TLS (default %(default)s)",
    )
    serve.add_argument(
        "--node-listen",
        default="",
        help="members' address, mutual TLS (default: the --listen host, port + 1)",
    )
    serve.add_argument(
        "--metrics-listen",
        default="",
        help="Prometheus /metrics (default: the --listen host, port + 2; 'off' disables it)",
    )
    serve.add_argument("--advertise-host", default="", help="the host nodes should dial (default: --listen's)")
    serve.add_argument(
        "--dht",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="be the run's DHT bootstrap peer, handed to every node in its join reply, and publish this "
        "address there (default on). --no-dht: nodes find each other only through --dht-peer addresses "
        "their operators pass (every node but the first of a run)",
    )
    serve.add_argument(
        "--dht-listen",
        default="",
        help="HOST:PORT of the DHT (default: the --listen host, the port it had last time or a free one)",
    )
    d = CoordinatorSettings()
    for name, help_text in (
        ("heartbeat_interval_s", "how often nodes heartbeat"),
        ("heartbeat_ttl_s", "a node silent this long is marked lost"),
        ("lease_ttl_s", "a lease not renewed this long expires"),
        ("sweep_interval_s", "how often lost nodes and expired leases are looked for"),
        ("join_grace_s", "a node that just joined, or restarted and is starting, has this long to heartbeat"),
        ("restart_grace_s", "deadlines are pushed this far out after a restart"),
        ("token_ttl_s", "default lifetime of a join token"),
        ("stall_after_s", "active nodes that complete no round for this long show as stalled"),
    ):
        flag = "--" + name.removesuffix("_s").replace("_", "-")
        serve.add_argument(
            flag,
            dest=name,
            type=float,
            default=getattr(d, name),
            help=f"{help_text}, seconds (default %(default)s)",
        )
    serve.add_argument(
        "--heartbeat-fronts",
        type=int,
        default=d.heartbeat_fronts,
        help="processes beside this one that carry the nodes' heartbeat streams: about one per 4,000 nodes "
        "at 1 Hz (default %(default)s: none, every stream at the node address)",
    )
    serve.add_argument(
        "--heartbeat-udp",
        default=d.heartbeat_udp,
        metavar="node-port|PORT|off",
        help="heartbeats as signed UDP datagrams on the node address's host: node-port (the default) the node "
        "port's number, PORT that UDP port (0 a free one), off gRPC only",
    )
    serve.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="stderr lines: text with a timestamp, or one JSON object per line (default %(default)s)",
    )
    serve.add_argument("--wal-checkpoint-pages", type=int, default=d.wal_checkpoint_pages, help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from .server import ServeOptions, run  # grpc is imported only when serving

    settings = CoordinatorSettings(
        heartbeat_interval_s=args.heartbeat_interval_s,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        lease_ttl_s=args.lease_ttl_s,
        sweep_interval_s=args.sweep_interval_s,
        join_grace_s=args.join_grace_s,
        restart_grace_s=args.restart_grace_s,
        token_ttl_s=args.token_ttl_s,
        stall_after_s=args.stall_after_s,
        wal_checkpoint_pages=args.wal_checkpoint_pages,
        heartbeat_fronts=args.heartbeat_fronts,
        heartbeat_udp=args.heartbeat_udp,
    )
    return run(
        ServeOptions(
            db=args.db,
            listen=args.listen,
            node_listen=args.node_listen,
            metrics_listen=args.metrics_listen,
            advertise_host=args.advertise_host,
            dht=args.dht,
            dht_listen=args.dht_listen,
            settings=settings,
            log_format=args.log_format,
        )
    )
