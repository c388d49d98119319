"""`murmur admin`: operate a coordinator. Runs, join tokens, nodes, shards, events, one-screen status.

Every listing takes ``--output table|json``. Credentials: see protocol/admin_client.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from murmur.errors import MurmurError

from .settings import ADMIN_CALL_TIMEOUT_S

TIMEOUT_HELP = "seconds to wait for the coordinator (default %(default)s)"


def _common() -> argparse.ArgumentParser:
    # Shared by every leaf command so the options may follow the verb: `murmur admin status --output json`.
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--coordinator", help="public address HOST:PORT (default $MURMUR_COORDINATOR or 127.0.0.1:7700)")
    p.add_argument("--admin-key", metavar="FILE",
                   help="file with the admin secret, <db>.admin-key (default $MURMUR_ADMIN_KEY_FILE; "
                   "$MURMUR_ADMIN_KEY may hold the secret itself)")
    p.add_argument("--ca-cert", metavar="FILE",
                   help="the coordinator's CA certificate (default $MURMUR_CA_CERT, else <db>.ca.crt beside "
                   "the admin key file)")
    p.add_argument("--output", choices=("table", "json"), default="table", help="output format")
    p.add_argument("--timeout", type=float, default=ADMIN_CALL_TIMEOUT_S, help=TIMEOUT_HELP)
    return p


class _NounParser(argparse.ArgumentParser):
    """A noun with verbs (`murmur admin nodes`): a missing or unknown verb is one line that lists the
    verbs, not argparse's usage block (`nodes --output json` otherwise reads 'json' as the verb).
    A noun without verbs (`status`) keeps argparse's errors."""

    def error(self, message: str) -> NoReturn:
        verbs = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
        if not verbs:
            super().error(message)
        names = list(verbs)
        listed = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
        example = "list" if "list" in names else names[0]
        self.exit(2, f"error: `{self.prog}` needs a verb first: {listed} "
                     f"(e.g. `{self.prog} {example} --output json`)\n")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    common = _common()
    admin = subparsers.add_parser("admin", help="operate a coordinator: runs, tokens, nodes, status")
    nouns = admin.add_subparsers(dest="noun", metavar="NOUN", required=True, parser_class=_NounParser)

    def leaf(parent: Any, name: str, fn: Callable[[Any, argparse.Namespace], Any], help_text: str) -> Any:
        p = parent.add_parser(name, help=help_text, parents=[common])
        p.set_defaults(func=lambda args: _execute(fn, args))
        return p

    def verbs(noun: str, help_text: str) -> Any:
        return nouns.add_parser(noun, help=help_text).add_subparsers(
            dest="verb", metavar="VERB", required=True, parser_class=argparse.ArgumentParser
        )

    runs = verbs("runs", "create and manage runs")
    p = leaf(runs, "create", _runs_create, "create a run from a run TOML and a dataset manifest")
    p.add_argument("--config", required=True, type=Path, help="the run TOML")
    p.add_argument("--manifest", type=Path, help="the dataset's manifest.json (default: <data.path>/manifest.json)")
    p.add_argument("--run-id", default="", help="the run's id (default: the config's name)")
    leaf(runs, "list", _runs_list, "list runs")
    for verb, fn, text in (
        ("show", _runs_show, "show a run and its config"),
        ("pause", _runs_state("paused"), "stop handing out leases"),
        ("resume", _runs_state("active"), "hand out leases again"),
        ("finish", _runs_state("finished"), "end a run for good"),
    ):
        leaf(runs, verb, fn, text).add_argument("run", nargs="?", default="", metavar="RUN",
                                               help="run id (default: the only run)")
    p = leaf(runs, "recover", _runs_recover,
             "a run whose newest state exists nowhere waits for this: go on from the newest state that "
             "exists, or from scratch")
    p.add_argument("run", nargs="?", default="", metavar="RUN", help="run id (default: the only run)")
    p.add_argument("--from", dest="start_from", required=True, choices=("newest", "scratch"),
                   help="newest: the newest state any node or the coordinator holds; scratch: a fresh model")

    tokens = verbs("tokens", "join tokens")
    p = leaf(tokens, "create", _tokens_create, "make a join token (shown once)")
    p.add_argument("--run", default="", help="run id (default: the only run)")
    p.add_argument("--ttl", default="24h", help="lifetime, e.g. 3600, 90m, 24h, 7d (default %(default)s)")
    p.add_argument("--uses", type=int, default=1, help="how many nodes may join with it (default %(default)s)")
    p.add_argument("--note", default="", help="a note for the listing")
    leaf(tokens, "list", _tokens_list, "list tokens").add_argument("--run", default="")
    leaf(tokens, "revoke", _tokens_revoke, "revoke a token").add_argument("token_id", metavar="TOKEN_ID")

    nodes = verbs("nodes", "members")
    p = leaf(nodes, "list", _nodes_list, "list nodes")
    p.add_argument("--run", default="")
    p.add_argument("--status", default="", choices=("", "active", "lost", "left", "banned"))
    leaf(nodes, "show", _nodes_show, "show one node").add_argument("node_id", metavar="NODE_ID")
    p = leaf(nodes, "ban", _nodes_ban, "ban a node: its leases go back, peers refuse it")
    p.add_argument("node_id", metavar="NODE_ID")
    p.add_argument("--reason", default="banned by the run's admin")
    leaf(nodes, "unban", _nodes_unban, "lift a ban (the node rejoins with a token)").add_argument(
        "node_id", metavar="NODE_ID"
    )

    shards = verbs("shards", "dataset shards")
    leaf(shards, "list", _shards_list, "list shards, holders, offsets").add_argument("--run", default="")

    p = leaf(nouns, "stages", _stages, "a pipelined run's stages: blocks, peers, samples/s, queue, last move")
    p.add_argument("--run", default="")
    p.add_argument("--peers", action="store_true", help="one row per stage peer instead")

    p = leaf(nouns, "events", _events, "the event log (joins, leaves, losses, bans, admin actions)")
    p.add_argument("--run", default="")
    p.add_argument("--kind", default="")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--after", type=int, default=0, help="only events after this sequence number")
    leaf(nouns, "status", _status, "one screen: nodes, progress, loss, tokens/s, bytes").add_argument(
        "--run", default=""
    )


# --- plumbing ---------------------------------------------------------------------------------------


def _execute(fn: Callable[[Any, argparse.Namespace], Any], args: argparse.Namespace) -> int:
    from murmur.protocol.admin_client import AdminClient, resolve

    target = resolve(args.coordinator, args.admin_key, args.ca_cert)
    with AdminClient(target, timeout_s=args.timeout) as client:
        fn(client, args)
    return 0


def _pb():
    from murmur.protocol import coordinator_pb2

    return coordinator_pb2


def _to_json(message: Any) -> Any:
    from .message_json import message_json

    return message_json(message)


def _emit(args: argparse.Namespace, message: Any, table: Callable[[], str]) -> None:
    if args.output == "json":
        print(json.dumps(_to_json(message), indent=1, sort_keys=True))
    else:
        print(table())


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _ago(t: float) -> str:
    if not t:
        return "-"
    return _age(max(0.0, time.time() - t))


def _age(s: float) -> str:
    return f"{s:.1f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    if not rows:
        lines.append("(none)")
    return "\n".join(lines)


def parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    raw = text.strip().lower()
    try:
        value = float(raw[:-1]) * units[raw[-1]] if raw and raw[-1] in units else float(raw)
    except ValueError:
        raise MurmurError(f"--ttl {text!r} is not a duration; use seconds or 90m, 24h, 7d") from None
    if value <= 0:
        raise MurmurError(f"--ttl must be positive, got {text!r}")
    return value


# --- runs -------------------------------------------------------------------------------------------


def _run_rows(runs: Sequence[Any]) -> str:
    return table(
        ["RUN", "STATE", "SHARDS DONE", "TOKENS", "STEP", "NODES", "CREATED"],
        [
            [
                r.run_id,
                r.state,
                f"{r.shards_done}/{r.shards_total}",
                f"{r.tokens_committed}/{r.tokens_total}",
                r.outer_step,
                r.nodes_active,
                _when(r.created_at),
            ]
            for r in runs
        ],
    )


def _runs_create(client: Any, args: argparse.Namespace) -> None:
    try:
        config_toml = args.config.read_text()
    except OSError as err:
        raise MurmurError(f"cannot read --config {args.config}: {err.strerror}") from None
    manifest = args.manifest
    if manifest is None:
        try:
            data_path = tomllib.loads(config_toml).get("data", {}).get("path", "data/shakespeare-byte")
        except tomllib.TOMLDecodeError as err:
            raise MurmurError(f"{args.config} is not valid TOML: {err}") from None
        manifest = Path(str(data_path)) / "manifest.json"
        if not manifest.is_file():
            raise MurmurError(
                f"no --manifest given and {manifest} does not exist; run `murmur data prepare` or pass --manifest PATH"
            )
    try:
        manifest_json = manifest.read_text()
    except OSError as err:
        raise MurmurError(f"cannot read --manifest {manifest}: {err.strerror}") from None
    info = client.call(
        "CreateRun", _pb().CreateRunRequest(config_toml=config_toml, manifest_json=manifest_json, run_id=args.run_id)
    )
    _emit(
        args,
        info,
        lambda: (
            f"created run {info.run_id}: {info.shards_total} shards, {info.tokens_total} "
            f"tokens\nnext: murmur admin tokens create --run {info.run_id}"
        ),
    )


def _runs_list(client: Any, args: argparse.Namespace) -> None:
    reply = client.call("ListRuns", _pb().ListRunsRequest())
    _emit(args, reply, lambda: _run_rows(reply.runs))


def _runs_show(client: Any, args: argparse.Namespace) -> None:
    info = client.call("ShowRun", _pb().RunRef(run_id=args.run))
    _emit(args, info, lambda: _run_rows([info]) + "\n\n" + info.config_toml.rstrip())


def _runs_state(state: str) -> Callable[[Any, argparse.Namespace], None]:
    def fn(client: Any, args: argparse.Namespace) -> None:
        info = client.call("SetRunState", _pb().SetRunStateRequest(run_id=args.run, state=state))
        _emit(args, info, lambda: f"run {info.run_id} is {info.state}")

    return fn


def _runs_recover(client: Any, args: argparse.Namespace) -> None:
    info = client.call("RecoverRun", _pb().RecoverRunRequest(run_id=args.run, start_from=args.start_from))
    _emit(args, info, lambda: f"run {info.run_id} goes on from {args.start_from} "
                              f"{'state that exists' if args.start_from == 'newest' else '(a fresh model)'}")


# --- tokens -----------------------------------------------------------------------------------------


def _token_rows(tokens: Sequence[Any]) -> str:
    now = time.time()

    def state(t: Any) -> str:
        return (
            "revoked" if t.revoked else "expired" if t.expires_at < now else "used up" if not t.uses_left else "valid"
        )

    return table(
        ["TOKEN", "RUN", "STATE", "USES LEFT", "EXPIRES", "NOTE"],
        [[t.token_id, t.run_id, state(t), f"{t.uses_left}/{t.max_uses}", _when(t.expires_at), t.note] for t in tokens],
    )


def _tokens_create(client: Any, args: argparse.Namespace) -> None:
    if args.uses < 1:
        raise MurmurError("--uses must be at least 1")
    reply = client.call(
        "CreateToken",
        _pb().CreateTokenRequest(run_id=args.run, ttl_s=parse_duration(args.ttl), uses=args.uses, note=args.note),
    )
    _emit(
        args,
        reply,
        lambda: (
            f"{reply.token}\n(token {reply.info.token_id} for run {reply.info.run_id}: "
            f"{reply.info.max_uses} use(s), expires {_when(reply.info.expires_at)}; shown once)"
        ),
    )


def _tokens_list(client: Any, args: argparse.Namespace) -> None:
    reply = client.call("ListTokens", _pb().ListTokensRequest(run_id=args.run))
    _emit(args, reply, lambda: _token_rows(reply.tokens))


def _tokens_revoke(client: Any, args: argparse.Namespace) -> None:
    info = client.call("RevokeToken", _pb().RevokeTokenRequest(token_id=args.token_id))
    _emit(args, info, lambda: f"token {info.token_id} revoked")


# --- nodes, shards, events --------------------------------------------------------------------------


def _node_rows(nodes: Sequence[Any]) -> str:
    return table(
        ["NODE", "NAME", "STATUS", "HEARTBEAT", "TOK/S", "TOKENS", "SENT", "SHARDS", "REACH", "DEVICE"],
        [
            [
                n.node_id,
                n.name or "-",
                n.status,
                _ago(n.last_heartbeat),
                f"{n.tokens_per_s:.0f}",
                n.tokens_committed,
                _bytes(n.bytes_sent),
                ",".join(map(str, n.shards_held)) or "-",
                n.reachability or "-",
                n.hardware.device or "-",
            ]
            for n in nodes
        ],
    )


def _nodes_list(client: Any, args: argparse.Namespace) -> None:
    reply = client.call("ListNodes", _pb().ListNodesRequest(run_id=args.run, status=args.status))
    _emit(args, reply, lambda: _node_rows(reply.nodes))


def _nodes_show(client: Any, args: argparse.Namespace) -> None:
    n = client.call("ShowNode", _pb().NodeRef(node_id=args.node_id))
    hw = n.hardware
    _emit(
        args,
        n,
        lambda: "\n".join(
            [
                _node_rows([n]),
                "",
                f"run {n.run_id}, joined {_when(n.joined_at)}, peer address {n.peer_address or '-'}",
                f"hardware: {hw.device or '-'}, {hw.cpu_cores} cores, {_bytes(hw.memory_bytes)} memory, "
                f"{_bytes(hw.accelerator_memory_bytes)} accelerator memory",
                f"updates rejected: in {n.updates_rejected} round(s) an owner refused its update "
                "(see `murmur admin events --kind update_rejected`; banning is your call)",
                *([f"banned: {n.ban_reason}"] if n.status == "banned" else []),
            ]
        ),
    )


def _nodes_ban(client: Any, args: argparse.Namespace) -> None:
    n = client.call("BanNode", _pb().BanRequest(node_id=args.node_id, reason=args.reason))
    _emit(args, n, lambda: f"node {n.node_id} banned: {n.ban_reason}")


def _nodes_unban(client: Any, args: argparse.Namespace) -> None:
    n = client.call("UnbanNode", _pb().NodeRef(node_id=args.node_id))
    _emit(args, n, lambda: f"node {n.node_id} unbanned (it may rejoin with a token)")


def _shards_list(client: Any, args: argparse.Namespace) -> None:
    reply = client.call("ListShards", _pb().ListShardsRequest(run_id=args.run))
    _emit(
        args,
        reply,
        lambda: table(
            ["SHARD", "NAME", "COMMITTED", "TOKENS", "HOLDER", "LEASE EXPIRES", "DONE"],
            [
                [
                    s.shard_id,
                    s.name,
                    s.committed_offset,
                    s.tokens,
                    s.holder or "-",
                    _when(s.lease_expires_at) if s.holder else "-",
                    "yes" if s.done else "no",
                ]
                for s in reply.shards
            ],
        ),
    )


def _stages(client: Any, args: argparse.Namespace) -> None:
    reply = client.call("ListStages", _pb().GetStagesRequest(run_id=args.run))
    if not reply.stages:
        raise SystemExit(f"error: run {reply.run_id} is not pipelined (its config has no [pipeline] section)")

    def blocks(first: int, end: int) -> str:
        return f"{first}-{end - 1}" if end > first >= 0 else "-"

    def stage_rows() -> str:
        rows = [
            [s.stage, blocks(s.first_block, s.end_block), s.peers, f"{s.samples_per_s:.1f}", s.queue,
             f"{s.last_move} {_ago(s.last_move_at)}" if s.last_move else "-"]
            for s in reply.summary
        ]
        text = table(["STAGE", "BLOCKS", "PEERS", "SAMPLES/S", "QUEUE", "LAST MOVE"], rows)
        return text + (f"\nmoving: {reply.pending_move}" if reply.pending_move else "")

    def peer_rows() -> str:
        return table(
            ["NODE", "SERVES", "LEASE", "STATE", "SAMPLES/S", "QUEUE", "STEPS", "WEIGHTS FROM", "HEARD"],
            [
                [p.node_id, p.report.stage if p.report.stage >= 0 else "-", p.assigned_stage, p.assignment,
                 f"{p.report.samples_per_s:.1f}", p.report.queue, p.report.optimizer_steps,
                 p.report.state_source or "-", _ago(p.last_heartbeat)]
                for p in reply.peers
            ],
        )

    _emit(args, reply, peer_rows if args.peers else stage_rows)


def _events(client: Any, args: argparse.Namespace) -> None:
    reply = client.call(
        "ListEvents", _pb().ListEventsRequest(run_id=args.run, kind=args.kind, limit=args.limit, after_seq=args.after)
    )
    _emit(
        args,
        reply,
        lambda: table(
            ["SEQ", "TIME", "RUN", "EVENT", "NODE", "DETAIL"],
            [[e.seq, _when(e.at), e.run_id or "-", e.kind, e.node_id or "-", e.detail] for e in reply.events],
        ),
    )


def _status(client: Any, args: argparse.Namespace) -> None:
    st = client.call("Status", _pb().StatusRequest(run_id=args.run))

    def screen() -> str:
        r = st.run
        counts = ", ".join(f"{n} {s}" for s, n in sorted(st.nodes_by_status.items())) or "no nodes"
        pct = 100.0 * r.tokens_committed / r.tokens_total if r.tokens_total else 0.0
        return "\n".join(
            [
                f"run {r.run_id} ({r.state}{', STOPPED: no active node' if st.stopped else ''})   nodes: {counts}",
                f"progress: {r.tokens_committed}/{r.tokens_total} tokens ({pct:.1f}%), "
                f"{r.shards_done}/{r.shards_total} shards done, outer step {r.outer_step}, {st.rounds} rounds",
                f"loss {st.last_loss:.4f}   tokens/s {st.tokens_per_s:.1f}   bytes sent {_bytes(st.bytes_sent)}   "
                f"last round {_age(st.last_round_age_s) if st.last_round_at else 'none yet'}",
                *([f"STOPPED (no active node for over {st.stall_after_s:.0f}s): {st.stall_reason}"] if st.stopped
                  else [f"STALLED (no round for over {st.stall_after_s:.0f}s): {st.stall_reason}"] if st.stalled
                  else []),
                *([f"WAITING FOR THE OPERATOR: {st.waiting_for_operator}"] if st.waiting_for_operator else []),
                (f"kept state: round {st.kept.round}, {_ago(st.kept.kept_at)}" if st.HasField("kept")
                 else "kept state: none"),
                "",
                _node_rows(st.nodes),
            ]
        )

    _emit(args, st, screen)


if __name__ == "__main__":  # pragma: no cover - `murmur admin` is the entry point
    sys.exit(1)
