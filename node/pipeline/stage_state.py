"""A stage's state between its peers: published after every optimizer step, fetched by a newcomer.

A stage peer publishes its stage's parameters (under the whole model's names) on its peer
server (node/net/server.py) as ``stage/<s>``, once at start and again after every optimizer
step. A peer that joins a stage, or moves to it, fetches that state from the stage's peers
before it serves a call: node/net/state_transfer.py splits the tensors among the donors, fetches
them in parallel and refuses anything that does not hash to what the donors announced. Only the
parameters travel (the newcomer's AdamW starts fresh); see docs/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from murmur.node.model.stages import StageModule
from murmur.node.net.server import PublishedState
from murmur.node.net.state_transfer import StateError, StateFetchSettings, afetch
from murmur.protocol.identity import Identity
from murmur.protocol.wire import tensors_hash


def state_name(stage: int) -> str:
    return f"stage/{stage}"


def snapshot(module: StageModule) -> list[tuple[str, torch.Tensor]]:
    """A CPU copy of the stage's parameters (the peer server sends CPU tensors; on a GPU stage
    this is also the only copy that leaves the device)."""
    return [(n, p.detach().to("cpu", copy=True)) for n, p in module.named_stage_parameters()]


def state_hash(module: StageModule) -> str:
    return tensors_hash((n, p.detach().cpu()) for n, p in module.named_stage_parameters()).hex()


def published(module: StageModule) -> PublishedState:
    """A copy of the stage's parameters for `PeerServer.publish_state` (take it where the weights
    cannot change meanwhile: in the worker's compute thread, or before serving)."""
    tensors = snapshot(module)
    return PublishedState(state_name(module.span.index), tensors, tensors_hash(tensors))


async def fetch_into(
    module: StageModule, identity: Identity, donors: Mapping[str, str], settings: StateFetchSettings | None = None
) -> list[str]:
    """Load the stage's state from ``donors`` ({node id: peer server address}) into ``module``;
    raises StateError when no donor serves it or it does not fit this stage."""
    tensors, _ = await afetch(identity, donors, state_name(module.span.index), settings=settings)
    load_into(module, tensors)
    return sorted(donors)


def load_into(module: StageModule, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy a stage's state (from its peers, or a replica) into ``module``; StateError if it does not fit."""
    params = dict(module.named_stage_parameters())
    if list(tensors) != list(params):
        raise StateError(
            f"the donors' stage {module.span.index} holds {sorted(tensors)[:3]}..., "
            f"this peer's stage {sorted(params)[:3]}...: another layer split?"
        )
    for name, t in tensors.items():
        if t.shape != params[name].shape or t.dtype != params[name].dtype:
            raise StateError(f"{name}: the donors' {list(t.shape)} {t.dtype}, ours {list(params[name].shape)}")
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)
