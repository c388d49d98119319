"""Copies of the training state that the next window cannot reach, taken between windows.

After every round the node keeps the shared state (hashed, published to joiners, the state a failed
round is undone from) and, every few rounds, a checkpoint (model, AdamW, shared state): ~2 GB for
the base preset. The training thread must take them before the next window's in-place updates, and
on a GPU every millisecond it spends there is a millisecond the GPU idles.

Copying to the CPU on the training thread cost a base-preset node 0.55 s a round on the H200
(benchmarks/results/node_gpu.json, ``snapshot_s``): 0.05 s for the transfers themselves and up to
2 s for page-locked memory whenever torch's host allocator had no free block of a size. So when the
GPU has room, a snapshot is first a copy on the GPU itself (`take` with ``on_device``: queued on the
training stream, a few milliseconds of device time, no wait), and the round finisher's thread moves
it to page-locked host memory on a stream of its own (`to_host`) while the next window trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from murmur.node.daemon.tree import leaves, map_leaves

# A snapshot is taken on the GPU only where this many copies of it fit in the free memory: the
# round finisher can hold a few rounds (node/daemon/round_finish.py's MAX_WAITING) and the
# activations of the next steps need their room too.
DEVICE_HEADROOM = 6


def take(obj: Any, *, on_device: bool = False) -> Any:
    """``obj`` with every tensor in it copied once: a value the next window's in-place updates
    cannot reach. Dicts, lists and tuples are rebuilt; other values are kept as they are.

    ``on_device=False``: a CPU copy (GPU tensors go to page-locked memory, all transfers queued at
    once and waited for together). ``on_device=True``: GPU tensors are cloned on their device and
    nothing waits; whoever reads the copy off the device waits for the training stream first (an
    event recorded after `take`, as node/daemon/training_thread.py does, and `to_host`)."""
    devices: set[torch.device] = set()

    def copy(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        t = v.detach()
        if t.device.type != "cuda":
            return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
        if on_device:
            return t.clone()
        dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        dst.copy_(t, non_blocking=True)
        devices.add(t.device)
        return dst

    out = map_leaves(obj, copy)
    for device in devices:
        torch.cuda.synchronize(device)
    return out


def nbytes(obj: Any) -> int:
    """The bytes of the GPU tensors in ``obj`` (what `take` with ``on_device`` would allocate)."""
    return sum(
        t.numel() * t.element_size() for t in leaves(obj) if isinstance(t, torch.Tensor) and t.device.type == "cuda"
    )


def room_on_device(device: torch.device, size: int) -> bool:
    """Whether snapshots of ``size`` bytes may be taken on ``device`` (DEVICE_HEADROOM of them fit
    in the memory that neither torch's allocator nor anyone else holds)."""
    if device.type != "cuda" or size == 0:
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return DEVICE_HEADROOM * size <= free


@dataclass(frozen=True, slots=True)
class Taken:
    """Marks the end of the GPU snapshots a training thread queued: what `to_host` waits for."""

    device: torch.device
    event: torch.cuda.Event

    @classmethod
    def now(cls, device: torch.device) -> Taken:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return cls(device, event)


class HostMover:
    """Moves GPU snapshots to the CPU off the training thread, on a stream of its own, so the
    copies run beside the next window's kernels instead of queueing behind or before them."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def to_host(self, obj: dict | list, taken: Taken) -> None:
        """Replace, in place, every GPU tensor in the dicts and lists of ``obj`` by a page-locked
        CPU copy, made once ``taken`` has passed, and wait for the copies. The same tensor reached
        twice (the shared state inside a checkpoint, and its flattened list) becomes one CPU
        tensor. Tuples inside a list or dict are rebuilt in place of the old ones."""
        stream = self._streams.get(taken.device)
        if stream is None:
            stream = self._streams[taken.device] = torch.cuda.Stream(device=taken.device)
        with torch.cuda.stream(stream):
            stream.wait_event(taken.event)
            _replace(obj, {})
        stream.synchronize()  # the caller may drop the GPU copies once this returns


def _host(t: torch.Tensor, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    dst = memo.get(id(t))
    if dst is None:
        dst = memo[id(t)] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        dst.copy_(t, non_blocking=True)
    return dst


def _moved(v: Any, memo: dict[int, torch.Tensor]) -> Any:
    if isinstance(v, torch.Tensor):
        return _host(v, memo)
    if isinstance(v, dict | list):
        _replace(v, memo)
        return v
    if isinstance(v, tuple):
        return tuple(_moved(x, memo) for x in v)
    return v


def _replace(obj: dict | list, memo: dict[int, torch.Tensor]) -> None:
    keys = obj.keys() if isinstance(obj, dict) else range(len(obj))
    for k in list(keys):
        obj[k] = _moved(obj[k], memo)
