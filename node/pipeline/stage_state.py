"""A stage's state between its peers: published after every optimizer step, fetched by a newcomer.

A stage peer publishes its stage's parameters (under the whole model's names) on its peer
server (node/net/server.py) as ``stage/<s>``, once at start and again after every optimizer
step: a hash and the live weights (`LiveState`), read tensor by tensor when a peer asks, not a
copy. A peer that joins a stage, or moves to it, fetches that state from the stage's peers
before it serves a call: node/net/state_transfer.py splits the tensors among the donors, fetches
them in parallel and refuses anything that does not hash to what the donors announced. Only the
parameters travel (the newcomer's AdamW starts fresh); see docs/pipeline.md.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Mapping

import torch

from murmur.node.model.stages import StageModule
from murmur.node.net.server import PublishedState
from murmur.node.net.state_transfer import StateError, StateFetchSettings, afetch
from murmur.protocol.identity import Identity
from murmur.protocol.wire import tensor_bytes, tensors_hash


def state_name(stage: int) -> str:
    return f"stage/{stage}"


def snapshot(module: StageModule) -> list[tuple[str, torch.Tensor]]:
    """A CPU copy of the stage's parameters (the peer server sends CPU tensors; on a GPU stage
    this is also the only copy that leaves the device)."""
    return [(n, p.detach().to("cpu", copy=True)) for n, p in module.named_stage_parameters()]


def state_hash(module: StageModule) -> str:
    return tensors_hash((n, p.detach().cpu()) for n, p in module.named_stage_parameters()).hex()


class StateChanged(RuntimeError):
    """The weights a published state names have changed since (an optimizer step, a sync round)."""


class LiveState:
    """The stage's parameters as `PeerServer` serves them (the ``PublishedState`` fields), read from
    the live weights instead of a copy kept after every step.

    A copy per step cost the stage's weights once more for good, and twice while the next step's
    copy replaced it; the state is read seldom (a joiner, a mover, a replica's refresh). So each
    call opens a `Reader` and reads the state one frame at a time (a slice of a tensor, under the
    worker's lock, off the event loop); a change of the weights (`LivePublisher.before_change`, in
    the compute thread, under the lock) first copies, for the calls still reading, the tensors they
    have not sent yet (``pin``): a transfer never mixes two steps, and the copy exists only while a
    step falls inside a transfer. A call that opens the state after the weights changed is refused
    (`StateChanged`): its caller asks again, for the newer state the peer publishes after every
    step.

    That copy goes to a file (an unnamed temporary file in ``spill_dir``, the system's temporary
    folder by default), not to memory: a replica's refresh or the coordinator's keeper reads a
    stage every few seconds, a step lands inside one of those transfers now and then, and a copy in
    memory then put the stage's weights once more on whichever peer it happened to, at the peak of
    its step (measured: the one stage over 1.5 x its training state in a run of
    benchmarks/peer_memory.py, by 81 MiB). Writing it costs the step a write of what the calls still
    need (into the page cache), not the process's memory."""

    def __init__(self, worker, name: str, state_hash: bytes | None = None, spill_dir: str | None = None) -> None:
        self.name, self.members = name, []
        self._hash = state_hash  # None: taken when first asked for (``state_hash``)
        self._worker = worker
        self.tensors = [(n, p.detach()) for n, p in worker.module.named_stage_parameters()]
        self._live = dict(self.tensors)
        self._guard = threading.Lock()
        self._readers: list[Reader] = []
        self._stale = False  # the live weights are not this state any more
        self._pinned: dict[str, int] = {}  # what the readers still needed when they changed: its offset in _spill
        self._spill = None  # the file those tensors were written to
        self._spill_dir = spill_dir
        self.pinned_bytes = 0

    @property
    def state_hash(self) -> bytes:
        """The hash of the weights this state names, taken the first time it is asked for (a
        heartbeat's report, a GetState's manifest) instead of after every step: a stage steps many
        times between two reports, and the hash read every byte of the stage each time (1.3-3 ms
        a step on the tiny stage of benchmarks/pipeline.py, in the compute thread). Taken with the
        guard held, so the weights cannot change under it: a step first pins the state (`pin`,
        which waits for the guard). StateChanged if they changed before anyone asked: nothing
        can hash them any more, and the newer state the peer publishes after the step has one."""
        with self._guard:
            if self._hash is None:
                if self._stale:
                    raise StateChanged(f"{self.name} changed before its hash was asked for; ask the newer state")
                self._hash = tensors_hash(self.tensors)
            return self._hash

    def open(self) -> Reader:
        with self._guard:
            if self._stale:
                raise StateChanged(f"{self.name} changed since it was published; ask again")
            if self._hash is None:  # the manifest carries it: taken while nothing can change the weights
                self._hash = tensors_hash(self.tensors)
            reader = Reader(self)
            self._readers.append(reader)
            return reader

    def _close(self, reader: Reader) -> None:
        with self._guard:
            self._readers.remove(reader)
            if not self._readers:
                self._pinned = {}  # the last call that needed the copies is done
                if self._spill is not None:
                    self._spill.close()  # an unnamed file: its blocks go with it
                    self._spill = None

    def _read(self, reader: Reader, name: str, start: int, end: int) -> bytes:
        with self._guard:
            at = self._pinned.get(name)
            if at is not None:  # the copy in the file, which no step changes: no need of the lock
                reader.started(name)
                return os.pread(self._spill.fileno(), end - start, at + start)
        with self._worker.lock, self._guard:
            at = self._pinned.get(name)
            if at is not None:
                reader.started(name)
                return os.pread(self._spill.fileno(), end - start, at + start)
            if self._stale:
                raise StateChanged(f"{self.name} changed while it was read; ask again")
            reader.started(name)
            return _byte_slice(self._live[name], start, end)

    def pin(self) -> None:
        """The weights are about to change (called with the worker's lock held): copy, for the
        calls reading now, the tensors they have not sent yet; the state is stale from here on."""
        with self._guard:
            if self._stale:
                return
            self._stale = True
            needed = {n for r in self._readers for n in r.remaining()}
            if not needed:
                return
            self._spill = tempfile.TemporaryFile(dir=self._spill_dir)  # noqa: SIM115 - closed with the last reader
            offset = 0
            for n, t in self.tensors:
                if n in needed:
                    # From the tensor's own memory (one tensor's CPU copy at a time on a GPU).
                    self._spill.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                    self._pinned[n] = offset
                    offset += t.numel() * t.element_size()
            self._spill.flush()
            self.pinned_bytes = offset


class Reader:
    """One call's reading of a `LiveState`, in the state's order (`PeerServer.GetState`)."""

    def __init__(self, state: LiveState) -> None:
        self._state = state
        self._names = [n for n, _ in state.tensors]
        self._at = 0  # index of the tensor being sent: those before it are sent

    def started(self, name: str) -> None:  # with the state's guard held
        while self._at < len(self._names) and self._names[self._at] != name:
            self._at += 1

    def remaining(self) -> list[str]:  # with the state's guard held
        return self._names[self._at:]

    def read(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of tensor ``name`` as the state was published (blocking: call it in
        a thread; tensors in the state's order)."""
        return self._state._read(self, name, start, end)

    def close(self) -> None:
        self._state._close(self)


def _byte_slice(t: torch.Tensor, start: int, end: int) -> bytes:
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":  # the elements of the slice only, one frame at a time
        size = flat.element_size()
        first, last = start // size, -(-end // size)
        chunk = flat[first:last].cpu()
        return tensor_bytes(chunk)[start - first * size:end - first * size]
    return flat.view(torch.uint8).numpy()[start:end].tobytes()


class LivePublisher:
    """A worker's `LiveState`s: a new one after every change of the weights (``state``), and the
    hook that pins the older ones before the weights change (``before_change``)."""

    def __init__(self, worker, spill_dir: str | None = None) -> None:
        self.worker = worker
        self.spill_dir = spill_dir  # where a step inside a transfer writes what the transfer still needs
        self._open: list[LiveState] = []
        self.copies = 0  # steps that landed inside a transfer and wrote what it still had to send to a file
        self.copied_bytes_max = 0

    def state(self) -> LiveState:
        """The state as the weights are now (with the worker's lock held, or before it serves); its
        hash is taken when first asked for (`LiveState.state_hash`)."""
        st = LiveState(self.worker, state_name(self.worker.span.index), spill_dir=self.spill_dir)
        self._open.append(st)
        return st

    def before_change(self) -> None:
        for st in self._open:
            st.pin()
            if st.pinned_bytes:
                self.copies += 1
                self.copied_bytes_max = max(self.copied_bytes_max, st.pinned_bytes)
        self._open = []


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
