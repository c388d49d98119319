"""The local checkpoint's contents: everything a node needs to go on where it stopped.

The shared state (node/daemon/shared_state.py) plus what is this node's alone: its model's local
weights, the inner optimizer (AdamW or Muon), DeMo's momentum, the codec's error-feedback residual
and the byte counters; with the run's configuration, so a checkpoint of another run is refused.
The file itself (its checksum, its atomic write) is node/daemon/checkpoint_file.py's; when it is
written is the round finisher's (node/daemon/round_finish.py).

`CheckpointState` is one side of `NodeTrainer` (node/daemon/training.py).
"""

from __future__ import annotations

from typing import Any

import torch

from murmur.node.daemon import snapshot
from murmur.node.daemon.wait_meter import WaitMeter
from murmur.node.daemon.window_types import TrainingError
from murmur.optim.codecs import Codec
from murmur.optim.demo import DeMo
from murmur.optim.diloco import StreamingDiLoCo
from murmur.optim.sync import SyncAlgorithm
from murmur.protocol.runconfig import RunConfig


class CheckpointState:
    """The local checkpoint of a `NodeTrainer` (whose __init__ sets every attribute named here)."""

    cfg: RunConfig
    device: torch.device
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    meter: WaitMeter
    sync: SyncAlgorithm

    def snapshot_on_device(self) -> bool:
        """Whether the GPU has room for the snapshots between windows (a checkpoint's worth:
        model, optimizer, global copy and outer momentum), so the training thread need not wait
        for their copies to the CPU."""
        if self.device.type != "cuda":
            return False
        size = snapshot.nbytes([self.model.state_dict(), self.opt.state_dict(), self.global_tensors()])
        if isinstance(self.sync, StreamingDiLoCo):
            size += snapshot.nbytes([f.outer.state_dict() for f in self.sync.fragments])
        return snapshot.room_on_device(self.device, size)


    # -- local checkpoint --------------------------------------------------------------------------

    def state_dict(self, shared: dict[str, Any] | None = None, *, on_device: bool = False) -> dict[str, Any]:
        """The local checkpoint, a copy the next window does not move (``shared``: a
        `shared_state` just taken, so the global state is copied once; ``on_device`` as there)."""
        state = {
            "config": self.cfg.to_dict(),
            "model": snapshot.take(self.model.state_dict(), on_device=on_device),
            "optimizer": snapshot.take(self.opt.state_dict(), on_device=on_device),
            "shared": shared if shared is not None else self.shared_state(on_device=on_device),
            "bytes": self.sync.bytes.to_dict(),
        }
        if isinstance(self.sync, DeMo):
            state["demo_momentum"] = snapshot.take(list(self.sync.momentum), on_device=on_device)
        codec = self.codec()
        if codec is not None:  # error feedback: what the codec has not sent yet is this node's alone
            state["codec"] = snapshot.take(codec.state_dict(), on_device=on_device)
        return state

    def codec(self) -> Codec | None:
        """The exchange's codec (its error-feedback residuals are this node's state), found through
        the wrappers around the exchange (`WaitMeter`, the data plane's member tracker)."""
        ex: Any = self.meter
        while ex is not None and not isinstance(getattr(ex, "codec", None), Codec):
            ex = getattr(ex, "inner", None)
        return ex.codec if ex is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("config") != self.cfg.to_dict():
            raise TrainingError("the local checkpoint belongs to another run configuration")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.load_shared_state(state["shared"])
        # load_shared_state copied the global copy into the model; the checkpoint was written
        # right after a round, when the local weights equal the global ones (DiLoCo) or hold the
        # mix (Streaming, alpha > 0), so restore the saved local weights on top.
        self.model.load_state_dict(state["model"])
        if isinstance(self.sync, DeMo) and "demo_momentum" in state:
            for m, saved in zip(self.sync.momentum, state["demo_momentum"], strict=True):
                m.copy_(saved.to(m.device))
        codec = self.codec()
        if codec is not None and "codec" in state:
            codec.load_state_dict({k: v.to("cpu") for k, v in state["codec"].items()})
        b = state.get("bytes") or {}
        self.sync.bytes.sent.update(b.get("sent", {}))
        self.sync.bytes.received.update(b.get("received", {}))
        self.sync.bytes.rounds = int(b.get("rounds", 0))
