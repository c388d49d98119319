"""Restore a run's state from what the coordinator keeps, when no live trainer serves it.

Every node that held the run's newest state may be gone (all stopped, or killed). The coordinator
keeps the newest state the trainers agreed on (coordinator/keeper.py) and serves it with the peer
protocol's GetState at its node address; heartbeat replies say which round it keeps
(``CoordinatorSession.kept``). This fetches it as any peer's state is fetched
(node/net/state_transfer.py): mutual TLS with the node's run certificate, every part checked, the
whole checked against the hash the trainers announced for that round.
"""

from __future__ import annotations

import torch

from murmur.node.net.state_transfer import StateError, StateFetchSettings, afetch
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol.identity import Identity


def kept_name(run_id: str, round_id: int) -> str:
    """The name the coordinator serves a run's kept global state under (coordinator/keeper.py)."""
    return f"kept/{run_id}/state/{round_id}"


async def fetch_kept(
    ident: Identity, kept: pb.KeptState, run_id: str, timeout_s: float
) -> dict[str, torch.Tensor]:
    """The kept state of ``kept.round``; StateError when the coordinator cannot serve it whole."""
    if kept.round < 0 or not kept.address or not kept.state_hash:
        raise StateError("the coordinator keeps no state of this run")
    tensors, _ = await afetch(
        ident,
        {kept.server_name: kept.address},
        kept_name(run_id, kept.round),
        bytes.fromhex(kept.state_hash),
        settings=StateFetchSettings(call_timeout=timeout_s),
    )
    return tensors
