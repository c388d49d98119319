"""The state a node publishes and a joiner takes: the run's replicated state, identical on every
member after a round.

It is the global copy of the weights (Streaming DiLoCo's fragments' globals, else the parameters),
the outer optimizer's momentum and the round counters (`shared_state`), flattened to named CPU
tensors in a fixed order for the wire and its hash (`shared_tensors`): what peers serve, what the
DHT and the coordinator name by its hash, and what a joiner or a re-syncing node loads. Not in
it: the inner optimizer and the codec's error-feedback residual, which are this node's alone
(node/daemon/checkpoint_state.py).

`SharedState` is one side of `NodeTrainer` (node/daemon/training.py).
"""

from __future__ import annotations

from typing import Any

import torch

from murmur.node.daemon import snapshot
from murmur.node.daemon.window_types import Carry, TrainingError
from murmur.optim.diloco import StreamingDiLoCo
from murmur.optim.sync import SyncAlgorithm
from murmur.protocol.wire import tensors_hash

GLOBAL_PREFIXES = ("global/", "param/")  # the names of the replicated tensors in `shared_tensors`


def shared_state_hash(shared: list[tuple[str, torch.Tensor]]) -> str:
    """`NodeTrainer.global_hash`, read from `shared_tensors`' copies instead of the live state."""
    return tensors_hash((n, t) for n, t in shared if n.startswith(GLOBAL_PREFIXES)).hex()


class SharedState:
    """The replicated state of a `NodeTrainer` (whose __init__ sets every attribute named here)."""

    model: torch.nn.Module
    sync: SyncAlgorithm
    h: int
    step: int
    round: int
    carry: Carry

    # -- the global state --------------------------------------------------------------------------

    def global_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The replicated state: identical on every member after a round (hashed, handed to joiners)."""
        if isinstance(self.sync, StreamingDiLoCo):
            out = []
            for frag in self.sync.fragments:
                for j, g in zip(frag.members, frag.globals_, strict=True):
                    out.append((f"global/{self.sync.names[j]}", g))
            return out
        return [(f"param/{n}", p.detach()) for n, p in self.model.named_parameters()]

    def global_hash(self) -> str:
        return tensors_hash((n, t.detach().cpu()) for n, t in self.global_tensors()).hex()

    def shared_state(self, *, on_device: bool = False) -> dict[str, Any]:
        """What a joiner needs to take part from the next round: global copy, outer momentum,
        counters. A copy, made once: the next window and outer step do not move it. On the CPU,
        or with ``on_device`` on the GPU for the round finisher to move (node/daemon/snapshot.py)."""
        state: dict[str, Any] = {
            "step": self.step,
            "round": self.round,
            "tensors": snapshot.take(dict(self.global_tensors()), on_device=on_device),
        }
        if isinstance(self.sync, StreamingDiLoCo):
            state["fragments"] = [
                {"rounds": f.rounds, "outer": snapshot.take(f.outer.state_dict(), on_device=on_device)}
                for f in self.sync.fragments
            ]
        return state

    @torch.no_grad()
    def load_shared_state(self, state: dict[str, Any]) -> None:
        tensors = state["tensors"]
        mine = dict(self.global_tensors())
        if set(tensors) != set(mine):
            raise TrainingError("the fetched state names other tensors than this node's model holds")
        for name, t in mine.items():
            src = tensors[name]
            if src.shape != t.shape:
                raise TrainingError(
                    f"fetched tensor {name} has shape {tuple(src.shape)}, expected {tuple(t.shape)}"
                )
            t.copy_(src.to(device=t.device, dtype=t.dtype))
        if isinstance(self.sync, StreamingDiLoCo):
            for frag, saved in zip(self.sync.fragments, state["fragments"], strict=True):
                frag.rounds = int(saved["rounds"])
                frag.outer.load_state_dict(saved["outer"])
            self.sync.locals_to_global()
            self.sync.in_flight.clear()
        self.carry = Carry()  # the local weights are the global copy again: nothing carried
        self.step, self.round = int(state["step"]), int(state["round"])

    def renumber(self, round_id: int) -> None:
        """Go on from this state as round ``round_id``: the run got that far, and every holder of
        the rounds between is gone (node/daemon/training_thread.py's restore). The counters move as if those
        rounds were trained here (steps for the schedule and DeMo's round ids, the fragments'
        exchange round ids), so no round number of the run is ever used for two states."""
        gap = round_id - self.round
        if gap <= 0:
            return
        self.round, self.step = round_id, self.step + gap * self.h
        if isinstance(self.sync, StreamingDiLoCo):
            for frag in self.sync.fragments:
                frag.rounds += gap

    # -- the shared state as named tensors (what peers publish and joiners fetch) ------------------

    def shared_tensors(self, state: dict[str, Any] | None = None) -> list[tuple[str, torch.Tensor]]:
        """The shared state (``state``, a `shared_state` just taken, or a new one) flattened to named
        CPU tensors, in a fixed order (its hash is the state's)."""
        if state is None:
            state = self.shared_state()
        out = list(state["tensors"].items())
        counters = [state["step"], state["round"]]
        for i, frag in enumerate(state.get("fragments", [])):
            counters.append(frag["rounds"])
            for j, entry in sorted(frag["outer"]["state"].items()):
                buf = entry.get("momentum_buffer")
                if buf is not None:
                    out.append((f"outer/{i}/{j}", buf))  # shared_state's copy, not the live buffer
        out.append(("counters", torch.tensor(counters, dtype=torch.int64)))
        return out

    def load_shared_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `shared_tensors` (fetched from peers, already verified by hash)."""
        if "counters" not in tensors:
            raise TrainingError("the fetched state has no counters")
        counters = [int(v) for v in tensors["counters"].tolist()]
        state: dict[str, Any] = {
            "step": counters[0],
            "round": counters[1],
            "tensors": {n: t for n, t in tensors.items() if n.startswith(GLOBAL_PREFIXES)},
        }
        if isinstance(self.sync, StreamingDiLoCo):
            if len(counters) != 2 + len(self.sync.fragments):
                raise TrainingError("the fetched state has another number of fragments than this run")
            frags = []
            for i, frag in enumerate(self.sync.fragments):
                outer = frag.outer.state_dict()
                outer["state"] = {}
                for j in range(len(frag.globals_)):
                    buf = tensors.get(f"outer/{i}/{j}")
                    if buf is not None:
                        outer["state"][j] = {"momentum_buffer": buf.clone()}
                frags.append({"rounds": counters[2 + i], "outer": outer})
            state["fragments"] = frags
        self.load_shared_state(state)
