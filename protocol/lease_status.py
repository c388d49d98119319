"""What a node does with an AcquireLease reply: train, stop or wait. Decided on the reply's typed
status (``LeaseStatus`` in coordinator.proto), never on its words: a test of the words stopped
every node of a run near its end, since "every unfinished shard is leased" contains "finished",
and left its last shards untrained.

A coordinator from before the status (the field absent, read as UNSPECIFIED) is understood as it
was meant: a grant trains, "every shard is done" and a finished run stop, the rest waits.
"""

from __future__ import annotations

import enum

from murmur.protocol import coordinator_pb2 as pb


class LeaseAction(enum.Enum):
    TRAIN = "train"
    STOP = "stop"  # nothing is left to train, for this node or anyone
    WAIT = "wait"  # ask again later: a shard may come free (a lease expires), or the run resumes


STOP_STATUSES = frozenset({pb.LEASE_ALL_DONE, pb.LEASE_RUN_FINISHED})
# The words of the coordinators from before the status that meant "stop" (coordinator/leases.py).
_OLD_STOP_REASONS = ("every shard is done",)


def action(reply: pb.AcquireLeaseReply) -> LeaseAction:
    if reply.granted:
        return LeaseAction.TRAIN
    if reply.status in STOP_STATUSES:
        return LeaseAction.STOP
    if reply.status != pb.LEASE_STATUS_UNSPECIFIED:
        return LeaseAction.WAIT
    reason = reply.reason.strip()
    if reason in _OLD_STOP_REASONS or (reason.startswith("run ") and reason.endswith(" is finished")):
        return LeaseAction.STOP
    return LeaseAction.WAIT


def status_name(reply: pb.AcquireLeaseReply) -> str:
    """The status's name for a log line (``LEASE_ALL_LEASED``), or ``unspecified``."""
    try:
        return pb.LeaseStatus.Name(reply.status) if reply.status else "unspecified"
    except ValueError:  # a status newer than this node: waiting is the safe reading
        return f"status {reply.status}"
