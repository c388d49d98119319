"""What a finished round hands over: its record, its commits and its checkpoint, then the loop's part.

On the training thread, a completed window becomes a round record (rounds.jsonl: loss, tokens,
speed, bytes, members), the commits of the leased spans it trained (nothing when the round went on
without this node's update) and the bookkeeping of the leases it ran out; the round finisher
(node/daemon/round_finish.py) hashes, publishes and checkpoints it beside the next window. On the
loop, once its checkpoint is on disk, the round updates the metrics, queues its commits and logs
its one line.

`RoundHandoff` is one side of `TrainingThread` (node/daemon/training_thread.py).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from murmur.node.daemon.metrics import NodeMetrics
from murmur.node.daemon.state_dir import PendingCommit
from murmur.node.daemon.thread_parts import ThreadParts
from murmur.node.daemon.window_types import WindowResult
from murmur.protocol.model_shape import ddp_bytes
from murmur.protocol.reachability import is_client


class RoundHandoff(ThreadParts):
    """The round hand-over of a `TrainingThread` (whose __init__ sets every attribute named here)."""

    metrics: NodeMetrics
    _ratio_base_step: int
    _committed_sent: int
    _window_exhausted: set[str]
    _exhausted_by_round: dict[int, set[str]]

    def _round_members(self) -> list[str]:
        """The group of the last completed round, which commits name (the coordinator's split check)."""
        return list(self.dataplane.last_round_members()) if self.session.in_rounds else []


    def _sent_since_commit(self) -> int:
        """Bytes sent since the previous commit (training thread), counted as committed from now."""
        total = self.trainer.sync.bytes.total_sent
        delta, self._committed_sent = max(0, total - self._committed_sent), total
        return delta

    def _forget_exhausted(self, keep: set[str], carried: set[str] = frozenset()) -> set[str]:
        """End the window's bookkeeping of the leases it ran out (training thread): those in
        ``carried`` (run out by the steps the next window carries) stay the next window's; the
        others not in ``keep`` are no longer named as exhausted (the coordinator hands them back);
        returns the rest, named until this window's commits are handed over. (A lease may be in
        both: the window committed a span of it and the carry runs it out.)"""
        ran_out = self._window_exhausted
        self._window_exhausted = ran_out & carried
        self.session.exhausted.difference_update(ran_out - keep - carried)
        return (ran_out & keep) - carried

    def _save_checkpoint(self, checkpoint: dict[str, Any], rounds: list[int]) -> None:
        """The round finisher's write (its thread) of a checkpoint that holds ``rounds``.
        ``--fault delay:checkpoint:S@R`` slows the write that holds round R: under load a round's
        own checkpoint may be replaced by a newer round's (node/daemon/round_finish.py), and the
        fault must strike all the same."""
        if self.faults is not None:
            for held in rounds:
                if self.faults.pause("checkpoint", self.session.info.node_id, held):
                    break
        self.state.save_checkpoint(checkpoint)

    def _window_commits(self, result: WindowResult, record: dict[str, Any]) -> list[PendingCommit]:
        """What a completed window commits: its spans of leased shards, or nothing when the round
        went on without this node's update (training thread)."""
        if not record["contributed"]:
            # Left out (it came late and caught up from the others): these tokens never reached
            # the model, so nothing is committed, and the next window trains them again from the
            # lease's committed offset (the coordinator hands the same lease back). Training on
            # past them would have the next window's commit refused too.
            self.trainer.lease, self.trainer.loader = None, None
            self.trainer.drop_carry()  # steps trained on that lease while the round was in flight
            self.loop.call_soon_threadsafe(
                self.log, f"round {result.round}: this node's update was left out; its tokens are trained again"
            )
            return []
        spans = [seg for seg in result.segments if seg.end > seg.start]
        sent = self._sent_since_commit() if spans else 0  # the first span carries the round's bytes
        members = self._round_members()
        return [
            PendingCommit(
                seg.lease.lease_id,
                seg.lease.shard_id,
                seg.start,
                seg.end,
                result.round,
                result.loss,
                sent if i == 0 else 0,
                result.seconds,
                members,
                record["val_loss"] if i == 0 else None,
            )
            for i, seg in enumerate(spans)
        ]


    def _round_record(self, result: WindowResult, val: float | None) -> dict[str, Any]:
        t = self.trainer
        sent = t.sync.bytes.total_sent
        peers = self.dataplane.last_round_members()
        k = max(2, len(peers))
        ddp = ddp_bytes(t.n_params, k, t.step - self._ratio_base_step)
        return {
            "round": result.round,
            "step": t.step,
            "time": time.time(),
            "node": self.session.info.node_id,
            "run": self.session.info.run_id,  # join.json goes with a clean leave; `murmur export` reads it here
            "loss": result.loss,
            "val_loss": val,
            "tokens": result.tokens,
            "steps": result.steps,  # this window's inner steps (sync.round_budget = "speed": its share)
            "tokens_per_s": result.tokens / result.seconds if result.seconds > 0 else 0.0,
            "seconds": result.seconds,
            "compute_seconds": result.compute_seconds,
            "rate": t.speed.rate,  # compute inner steps/s (EMA), announced to peers (sync.round_budget)
            "exchange_wait_seconds": result.exchange_wait_seconds,
            # Where a fast member's window went (benchmarks/heterogeneous.py): it started, its last
            # step had computed (it waits for the round from here), it ended (time - eval).
            "window_started": result.started,
            "arrived": result.arrived,
            "window_ended": result.started + result.seconds,
            # sync.fill_wait: steps trained while this round was in flight (the next window's), and
            # those of the last round's flight, committed with this one (in "tokens", not "steps")
            "filled": result.filled,
            "carried": result.carried,
            "carried_shards": result.carried_shards,  # (a fill that ran a shard out took the next one)
            "bytes_sent": sent,
            "bytes_received": t.sync.bytes.total_received,
            "compression": ddp / sent if sent else 0.0,
            "peers": len(peers),
            # False: the round completed without this node's update (it caught up from peers)
            "contributed": not self.session.in_rounds or self.session.info.node_id in peers,
            "hash": None,  # the global state's, set off the training thread (RoundFinisher)
            "shards": [s.lease.shard_id for s in result.segments],
        }


    def _record_start(self, val: float) -> None:
        self.state.append_round(
            {
                "round": 0,
                "step": 0,
                "time": time.time(),
                "val_loss": val,
                "node": self.session.info.node_id,
                "run": self.session.info.run_id,
                "hash": self.trainer.global_hash(),
            }
        )
        self.log(f"round    0 | val {val:.4f}")

    def _after_round(
        self,
        record: dict[str, Any],
        commits: list[PendingCommit],
        shared: list[tuple[str, torch.Tensor]],
        digest: bytes,
    ) -> None:
        m = self.metrics
        m.round, m.steps, m.loss = record["round"], record["step"], record["loss"]
        m.tokens_per_s, m.tokens_total = record["tokens_per_s"], m.tokens_total + record["tokens"]
        m.bytes_sent_total, m.bytes_received_total = record["bytes_sent"], record["bytes_received"]
        m.compression_ratio, m.peers = record["compression"], record["peers"]
        m.compute_seconds_total += record["compute_seconds"]
        m.exchange_wait_seconds_total += record["exchange_wait_seconds"]
        m.wall_seconds_total += record["seconds"]
        self.session.tokens_per_s = record["tokens_per_s"]
        self.dataplane.rate = record["rate"]  # announced with the round's state (publish, below)
        self.session.queue_commits(commits)
        # Their commits are pending now and go out before any lease request: no longer exhausted.
        self.session.exhausted.difference_update(self._exhausted_by_round.pop(record["round"], ()))
        self.session.queue_rejections(self.dataplane.take_rejections())
        self.state.append_round(record)  # (its state was published once hashed: RoundFinisher)
        ratio = f"{record['compression']:,.0f}x" if record["compression"] else "-"
        val = f" | val {record['val_loss']:.4f}" if record["val_loss"] is not None else ""
        # Which live trainers nobody can dial (the coordinator's view: their heartbeats' addresses).
        clients = sum(1 for m in self.session.view.trainers() if is_client(m.address))
        reach = f" ({clients} in client mode)" if clients else ""
        self.log(
            f"round {record['round']:4d} | loss {record['loss']:.4f}{val}"
            f" | {record['tokens_per_s']:,.0f} tok/s"
            f" | sent {record['bytes_sent'] / 1e6:.2f} MB | {ratio} less than ddp | peers {record['peers']}{reach}"
            f" | {'coordinator ok' if self.session.coordinator_up else 'coordinator DOWN'} | hash {record['hash'][:12]}"
        )
