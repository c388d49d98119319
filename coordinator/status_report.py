"""The run's status, built from the ledger in one place: the admin Status call (`murmur admin
status`) and the status page's /api/status both come from `status_reply`, so they always agree.

`page_status` wraps that reply (as the same JSON the admin CLI prints) with what only the page
shows: the run's algorithm and codec, per-node round, re-joins and refused commits, the loss
history, shard progress and the last events.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol.reachability import is_client

from .membership import Membership
from .message_json import message_json
from .runs import NotFound, RunError, Runs, ddp_equivalent_bytes, shape_of, sync_of
from .settings import CoordinatorSettings
from .store import Store

EVENTS_SHOWN = 20  # the page's event list
ROUNDS_SHOWN = 500  # points of the loss chart
# Stalled: no round for stall_after_s, or for this many of the recent rounds' median gap if that is
# longer (a run of 10-minute rounds is not stalled 3 minutes into one), the gap over this many rounds.
STALL_GAPS = 3
GAP_ROUNDS = 10


class StatusSource:
    """What a status is built from: the ledger, plus the live heartbeats membership holds in memory."""

    def __init__(self, store: Store, membership: Membership, runs: Runs, settings: CoordinatorSettings) -> None:
        self.store, self.membership, self.runs, self.settings = store, membership, runs, settings
        self.annotate: Callable[[pb.StatusReply], None] | None = None  # set by the service

    def default_run(self, run_id: str) -> str:
        if run_id:
            return run_id
        runs = self.store.runs()
        if len(runs) == 1:
            return str(runs[0]["run_id"])
        if not runs:
            raise NotFound("there is no run yet; create one with `murmur admin runs create --config FILE`")
        raise RunError(f"there are {len(runs)} runs; name one with --run")

    def run_info(self, run_id: str) -> pb.RunInfo:
        row = self.runs.get(run_id)
        totals = self.store.run_totals(run_id)
        last = self.store.last_round(run_id)
        return pb.RunInfo(
            run_id=row["run_id"],
            name=row["name"],
            state=row["state"],
            created_at=row["created_at"],
            config_toml=row["config_toml"],
            shards_total=totals["shards_total"],
            shards_done=totals["shards_done"],
            tokens_total=totals["tokens_total"],
            tokens_committed=totals["tokens_committed"],
            outer_step=last["outer_step"] if last else 0,
            nodes_active=self.store.nodes_by_status(run_id).get("active", 0),
        )

    def node_info(self, row: Any, full: bool = False) -> pb.NodeInfo:
        hw = json.loads(row["hardware_json"] or "{}")
        tokens, sent = self.store.node_totals(row["node_id"])
        seen = self.membership.last_seen(row["node_id"])
        live = self.membership.peer_address(row["node_id"])
        # A node that is not active trains nothing: its last reported rate is not shown as if it did.
        rate = 0.0
        if row["status"] == "active":
            rate = self.membership.tokens_per_s(row["node_id"]) or row["tokens_per_s"]
        info = pb.NodeInfo(
            node_id=row["node_id"],
            name=row["name"],
            run_id=row["run_id"],
            status=row["status"],
            joined_at=row["joined_at"],
            last_heartbeat=max(row["last_heartbeat"], seen or 0.0),
            tokens_per_s=rate,
            peer_address=live or row["peer_address"],
            reachability=("client mode" if is_client(live) else "direct") if live else "",
            tokens_committed=tokens,
            bytes_sent=sent,
            shards_held=[s.shard_id for s in self.store.shards_held(row["node_id"])],
            ban_reason=row["ban_reason"],
            updates_rejected=self.store.updates_rejected(row["node_id"]),
            hardware=pb.Hardware(
                device=str(hw.get("device", "")),
                cpu_cores=int(hw.get("cpu_cores", 0)),
                memory_bytes=int(hw.get("memory_bytes", 0)),
                accelerator_memory_bytes=int(hw.get("accelerator_memory_bytes", 0)),
            ),
        )
        if full:
            info.certificate_pem = row["cert_pem"]
        return info

    def status_reply(self, run_id: str, now: float | None = None) -> pb.StatusReply:
        run_id = self.default_run(run_id)
        info = self.run_info(run_id)
        now = time.time() if now is None else now
        tokens, first = self.store.committed_since(run_id, now - self.settings.tokens_per_s_window_s)
        last = self.store.last_round(run_id)
        rows = self.store.nodes(run_id)
        active = [r for r in rows if r["status"] == "active"]
        reply = pb.StatusReply(
            run=info,
            nodes=[self.node_info(r) for r in rows],
            last_loss=(last["loss_sum"] / last["commits"]) if last else 0.0,
            # No active node: nothing trains, whatever the window's commits say (27 s after a run's
            # last node died the page still showed its last minute's 4,917 tokens/s).
            tokens_per_s=tokens / max(now - first, 1.0) if first is not None and active else 0.0,
            bytes_sent=self.store.bytes_sent(run_id),
            rounds=self.store.round_count(run_id),
            nodes_by_status=self.store.nodes_by_status(run_id),
        )
        self._progress(reply, [r["joined_at"] for r in active], now, self._last_seen(rows))
        if self.annotate is not None:  # the kept state and a wait for the operator (coordinator/service.py)
            self.annotate(reply)
        return reply

    def _last_seen(self, rows: list[Any]) -> float:
        """When a node of the run was last heard from (0: the run never had one)."""
        return max((max(r["last_heartbeat"], self.membership.last_seen(r["node_id"]) or 0.0) for r in rows),
                   default=0.0)

    def progress(self, now: float | None = None) -> list[pb.StatusReply]:
        """Each run's progress fields alone (round, last round, stalled), for the metrics: the same
        rules as `status_reply` without a row per node."""
        now = time.time() if now is None else now
        replies = []
        for row in self.store.runs():
            last = self.store.last_round(row["run_id"])
            reply = pb.StatusReply(run=pb.RunInfo(run_id=row["run_id"], state=row["state"],
                                                  outer_step=last["outer_step"] if last else 0))
            nodes = self.store.nodes(row["run_id"])
            active = [n["joined_at"] for n in nodes if n["status"] == "active"]
            self._progress(reply, active, now, self._last_seen(nodes))
            replies.append(reply)
        return replies

    def _progress(self, reply: pb.StatusReply, active_joined: list[float], now: float, last_seen: float) -> None:
        """The last round's time and age, and whether the run looks stalled or stopped, and why.
        ``last_seen``: when a node of the run was last heard from (0: never one)."""
        times = self.store.round_times(reply.run.run_id, GAP_ROUNDS + 1)
        gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
        reply.stall_after_s = max(self.settings.stall_after_s, STALL_GAPS * gaps[len(gaps) // 2] if gaps else 0.0)
        reply.last_round_at = times[-1] if times else 0.0
        reply.last_round_age_s = max(0.0, now - reply.last_round_at) if times else 0.0
        if reply.run.state != "active":
            return  # paused or finished: idle, not stalled
        if not active_joined:
            # Every node left or was lost: the run is stopped once that lasts past the threshold
            # (from the last node heard of, or the last round if later). A run no node joined yet
            # is waiting for its first, not stopped.
            gone_for = now - max(reply.last_round_at, last_seen)
            if last_seen and gone_for > reply.stall_after_s:
                reply.stalled = reply.stopped = True
                reply.stall_reason = (
                    f"no active node for {gone_for:.0f}s (every node left or was lost): nothing trains "
                    f"at round {reply.run.outer_step}; start a node (murmur node run) to go on"
                )
            return
        # Waiting since the last round, or since the first of today's active nodes joined if later
        # (a run picked up again after everyone had left is not stalled the moment one joins).
        since = max(reply.last_round_at, min(active_joined))
        waited = now - since
        if waited <= reply.stall_after_s:
            return
        reply.stalled = True
        what = f"round {reply.run.outer_step}" if times else "any round"
        why = [f"no round completed for {waited:.0f}s after {what} with {len(active_joined)} active node(s)"]
        for row in self.store.refusals_since(reply.run.run_id, since):
            detail = json.loads(row["detail_json"] or "{}")
            label = "rounds refused as a split" if row["kind"] == "round_refused" else "commits refused"
            why.append(f"{row['n']} {label} (last: {str(detail.get('why', '')) or row['kind']})")
        if len(why) == 1:
            why.append("none refused: the nodes may be waiting for peers or failing their exchange (see their logs)")
        reply.stall_reason = "; ".join(why)

    def page_status(self, run_id: str = "") -> dict[str, Any]:
        """Everything the status page draws, read in one pass over the ledger."""
        now = time.time()
        if not self.store.runs() and not run_id:
            return {"now": now, "run": None, "status": None, "nodes": [], "rounds": [], "node_losses": {}, "shards": [],
                    "events": []}
        reply = self.status_reply(run_id, now)
        rid = reply.run.run_id
        ttl = self.settings.heartbeat_ttl_s
        extras = {r["node_id"]: r for r in self.store.node_summaries(rid)}
        # The state hash each live trainer's last heartbeat named: what its round line logs and its
        # rounds.jsonl records, so an operator can see at a glance that the nodes agree.
        hashes = {node_id: t.state_hash for node_id, t in self.membership.live_trainers(rid)}
        nodes = []
        for n in reply.nodes:
            e = extras.get(n.node_id)
            age = max(0.0, now - n.last_heartbeat)
            nodes.append(
                {
                    "node_id": n.node_id,
                    "name": n.name,
                    "status": n.status,
                    "heartbeat_age_s": age,
                    # Red past the TTL: an active node about to be declared lost, or a lost one
                    # (a node that left or was banned is not expected to heartbeat).
                    "heartbeat_late": n.status in ("active", "lost") and age > ttl,
                    "round": int(e["round"]) if e else 0,
                    "state_hash": hashes.get(n.node_id, ""),
                    "tokens_per_s": n.tokens_per_s,
                    "tokens_committed": n.tokens_committed,
                    "bytes_sent": n.bytes_sent,
                    "restarts": max(0, int(e["joins"]) - 1) if e else 0,
                    "commits_refused": int(e["commits_refused"]) if e else 0,
                    "updates_rejected": self.store.updates_rejected(n.node_id),  # rounds peers refused its update
                    "shards_held": list(n.shards_held),
                    "device": n.hardware.device,
                    "reachability": n.reachability,
                }
            )
        # Each worker-step of DDP sends 2 (k - 1) / k of the fp32 gradient, k the workers that
        # trained together: here, the nodes that committed tokens (a lower bound on the group).
        workers = sum(1 for n in nodes if n["tokens_committed"] > 0)
        ddp = ddp_equivalent_bytes(shape_of(reply.run.config_toml), reply.run.tokens_committed, workers)
        history = self.store.round_history(rid, ROUNDS_SHOWN)
        # Each node's own line over the rounds shown: {node id: [[round, mean loss of its commits]]}.
        node_losses: dict[str, list[list[float]]] = {}
        if history:
            for r in self.store.node_round_losses(rid, history[0]["outer_step"]):
                node_losses.setdefault(r["node_id"], []).append([r["outer_step"], r["loss"]])
        return {
            "now": now,
            "heartbeat_ttl_s": ttl,
            "run": {
                **sync_of(reply.run.config_toml),
                "run_id": rid,
                "state": reply.run.state,
                "ddp_bytes": ddp,
                "reduction_vs_ddp": ddp / reply.bytes_sent if reply.bytes_sent and ddp else 0.0,
            },
            # The very JSON `murmur admin status --output json` prints, for the same moment.
            "status": message_json(reply),
            "nodes": nodes,
            "rounds": [
                {"round": r["outer_step"], "loss": r["loss"], "val_loss": r["val_loss"], "tokens": r["tokens"],
                 "bytes_sent": r["bytes_sent"]}
                for r in history
            ],
            "node_losses": node_losses,
            "shards": [
                {"shard_id": s.shard_id, "tokens": s.tokens, "committed": s.committed_offset,
                 "holder": s.holder or "", "done": s.done}
                for s in self.store.shards(rid)
            ],
            "events": [
                {"seq": r["seq"], "at": r["at"], "kind": r["kind"], "node_id": r["node_id"], "detail": r["detail_json"]}
                for r in self.store.events(run_id=rid, limit=EVENTS_SHOWN)
            ],
        }
