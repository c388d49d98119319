"""A stage from the coordinator's kept set, when no live stage-mate can serve it.

Every peer of a pipelined run may be gone (all stopped, or killed, their folders lost). The
coordinator keeps the newest complete set of stage states (coordinator/keeper.py: every stage's
published state, pulled from a live peer and checked against the hash it was served under, all of
one version, the run's step as the ledger had it) and names it in the member call GetStages: the
address it serves it at, and each stage's GetState name and hash. A stage peer that no live peer
of its stage can serve, and whose own checkpoint is older than the kept set (or that has none),
fetches its stage from there as from a peer (node/net/state_transfer.py: mutual TLS with its run
certificate, every part checked, the whole checked against the kept hash) and says so in one line.

With no copy anywhere (no live peer, no replica, nothing kept, no checkpoint) under a run that
trained, the stage is not silently started from the seed's weights: the peer asks the coordinator
as a data-parallel node does (`ClaimRound` with ``lost_rounds`` from round 0,
coordinator/recovery.py), and the run waits for its operator (a ``state_lost`` event, `murmur
admin status`, the page) until `murmur admin runs recover RUN --from newest|scratch`; meanwhile it
looks again for a peer or a kept set. Only the parameters travel from the kept set: AdamW's
moments and the within-stage sync's state start fresh, as from a peer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from murmur.node.model.stages import StageModule
from murmur.node.net.state_transfer import StateFetchSettings, afetch
from murmur.node.pipeline.stage_state import load_into
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol.coordinator_client import CoordinatorError, MemberClient
from murmur.protocol.identity import Identity

log = logging.getLogger(__name__)

LOOK_AGAIN_S = 2.0  # while the run waits for its operator: how often the peer looks for a source again
FETCH_TIMEOUT_S = 600.0  # one GetState call from the coordinator, transfer included


def offered(view: pb.StageMap | None, stage: int) -> tuple[pb.KeptState, pb.StageState] | None:
    """The kept set's state of ``stage`` as the coordinator names it (None: it keeps none)."""
    if view is None or not view.HasField("kept") or not view.kept.address:
        return None
    for st in view.kept.stages:
        if st.stage == stage and st.name and st.state_hash:
            return view.kept, st
    return None


def behind(checkpoint: dict, kept: pb.KeptState, step_at: Callable[[int], int] | None) -> bool:
    """Whether a checkpoint holds an older state than the kept set: the run step of the ledger
    total its peer had heard when it wrote it, against the kept set's step."""
    if step_at is None:
        return False
    return step_at(int(checkpoint.get("tokens_committed") or 0)) < kept.round


async def restore(module: StageModule, ident: Identity, kept: pb.KeptState, st: pb.StageState) -> None:
    """Load the kept state ``st`` into ``module``; StateError when the coordinator cannot serve it
    whole, or it does not hash to the kept hash, or it does not fit the stage."""
    tensors, _ = await afetch(ident, {kept.server_name: kept.address}, st.name, bytes.fromhex(st.state_hash),
                              settings=StateFetchSettings(call_timeout=FETCH_TIMEOUT_S))
    load_into(module, tensors)
    log.info("stage %d: restored from the coordinator's kept set of run step %d (hash %s)",
             st.stage, kept.round, st.state_hash[:16])


async def seed_allowed(client: MemberClient, stage: int, step: int, wait: bool,
                       look: Callable[[], Awaitable[str]]) -> str:
    """The stage has no copy anywhere and the run trained to ``step``: may it go on from the seed's
    weights? The coordinator judges (coordinator/recovery.py). Returns "seed" once granted (the
    operator's call, or nothing trained), or the source ``look`` found meanwhile ("seed": none).
    Refused and ``wait`` false (a move): CoordinatorError, the peer keeps its stage."""
    said = False
    while True:
        try:
            reply = await client.claim_lost_rounds(step, 0)
        except CoordinatorError as err:
            if err.code != grpc.StatusCode.ABORTED:  # an outage: it decides alone, as a node does
                log.warning("stage %d: the coordinator could not judge a start from the seed (%s); starting so",
                            stage, err)
                return "seed"
            if not wait:
                raise
            if not said:
                log.warning("stage %d: not starting from the seed's weights (the run waits for its operator): %s",
                            stage, err)
                said = True
            found = await look()
            if found != "seed":
                return found
            await asyncio.sleep(LOOK_AGAIN_S)
            continue
        why = "the operator's call: from scratch" if reply.from_scratch else "the operator's call"
        log.warning("stage %d: no copy of it exists anywhere; going on from the seed's weights at run step %d (%s)",
                    stage, step, why)
        return "seed"
