"""A stage peer's checkpoints of its stage, in its state folder: what a restart reloads and what
`murmur export` assembles into one model.

    STATE_DIR/stage-checkpoints/stage-<s>-of-<S>-v<version>.pt

One file per checkpoint (torch.save, fsynced) written into a temporary name and renamed into place,
and the folder fsynced, as the data-parallel node writes its own (node/daemon/checkpoint_file.py,
which the pipeline layer may not import: node/ layers pipeline below daemon), so a SIGKILL at any
instant leaves the old files or the new one, never a torn one. A stage's file is small next to the
node's whole-model checkpoint, and the peer writes it in a thread of its own, off the compute.
Kept: at most ``keep`` versions a stage (``pipeline.checkpoint_keep``, default 2): the newest
``keep - keep // 2`` versions and the newest ``keep // 2`` of those that are multiples of
``SPARSE``. Every peer keeps the same multiples (the versions are the clock's), so peers that stop
or die up to ``SPARSE x keep // 2`` periods apart still share a complete set (without the sparse
ones, a stop staggered by more than a period, peers stopped one after the other, left none). The
bound is what a volunteer's disk holds: a 2.06B model's 6 stages wrote 6.6 GB files every minute
and, with 6 kept a stage, filled a 64 GB disk. On the disk at once: ``keep`` files a stage and the
one being written; a write that fails (a full disk) removes its temporary file.

**What is copied.** Nothing: `live` hands `write` the stage's own parameters and AdamW's own
moments, and the peer calls it under the worker's lock (no step can change them halfway through).
torch.save streams each tensor into the file (a GPU tensor through one CPU copy at a time), so a
checkpoint costs no copy of the stage's weights and moments in memory; it used to cost three (a
CPU copy of the weights and of both moments, taken before the write). The price is that the stage
computes nothing while the file is written and fsynced. That is the CPU's rule; a stage on a GPU
copies its weights and moments to host memory under the lock (`take`, a second for gigabytes, none
of the GPU's memory) and writes the file from the copy while the stage computes on
(`for_write`).

**Versions are instants of the clock.** Every peer of every stage checkpoints at the multiples of
``pipeline.checkpoint_every_s`` of Unix time, and version ``v`` is the one taken at
``v * checkpoint_every_s``: the checkpoints of one version, one per stage, are a cut of the whole
model at one instant (give or take a microbatch in flight between the stages), a *complete set*.
A clean stop writes the version of the period it falls in again, with the weights at the stop.
The coordinator records each checkpoint (its `ReportCheckpoint`, location ``stage/<s>``) and the
newest complete set in the ledger (coordinator/stage_board.py); `murmur export` picks the newest
complete set among the files it is given (node/export/stage_set.py).

Every file ends with a checksum trailer (protocol/integrity.py: the sha256 of the torch.save bytes
before it), checked by `read` before anything is loaded from it.

A file holds the stage's parameters (the whole model's names), its AdamW state, the within-stage
sync's anchor, momentum and round (``outer``), the run's progress the peer had heard of
(``tokens_committed``), the model's shape and the run config, so that one file says all a restart
or an export needs.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from murmur.node.model.stages import StageModule
from murmur.protocol import integrity
from murmur.protocol.wire import tensors_hash

FORMAT = "murmur-stage-checkpoint-1"
FOLDER = "stage-checkpoints"
KEEP = 2  # versions kept per stage unless pipeline.checkpoint_keep says otherwise
SPARSE = 10  # half of them (rounded down) are the newest multiples of this
FIX = "move it aside (or delete it): the stage is then taken from its peers, or an older version is used"
_NAME = re.compile(r"^stage-(\d+)-of-(\d+)-v(\d+)\.pt$")


@dataclass(frozen=True, slots=True)
class CheckpointFile:
    """One checkpoint file, as its name tells it (its content is read only when needed)."""

    path: Path
    stage: int
    stages: int
    version: int


def version_at(now: float, every_s: float) -> int:
    """The version of the period ``now`` falls in (its checkpoint instant is ``version * every_s``)."""
    return int(now // every_s) if every_s > 0 else int(now)


def file_name(stage: int, stages: int, version: int) -> str:
    return f"stage-{stage}-of-{stages}-v{version}.pt"


def listed(state_dir: Path) -> list[CheckpointFile]:
    """The checkpoint files of a state folder, oldest version first (none: an empty list)."""
    folder = Path(state_dir) / FOLDER
    if not folder.is_dir():
        return []
    found = []
    for f in folder.iterdir():
        m = _NAME.match(f.name)
        if m is not None and f.is_file():
            found.append(CheckpointFile(f, int(m[1]), int(m[2]), int(m[3])))
    return sorted(found, key=lambda c: (c.version, c.stage))


def newest(state_dir: Path, stage: int | None = None) -> CheckpointFile | None:
    """The newest checkpoint of ``stage`` (None: of any stage) in the folder."""
    files = [c for c in listed(state_dir) if stage is None or c.stage == stage]
    return files[-1] if files else None


def params_hash(params: dict[str, torch.Tensor]) -> str:
    """The hash the stage peer publishes its state under (node/pipeline/stage_state.py)."""
    return tensors_hash(params.items()).hex()


def take(module: StageModule, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """CPU copies of the stage's parameters and of its AdamW state. Call it where the weights
    cannot change meanwhile (under the worker's lock)."""
    params = {n: p.detach().to("cpu", copy=True) for n, p in module.named_stage_parameters()}
    opt = optimizer.state_dict()
    opt_state = {
        k: {name: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v) for name, v in st.items()}
        for k, st in opt["state"].items()
    }
    return params, {"state": opt_state, "param_groups": opt["param_groups"]}


def live(module: StageModule, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """The stage's parameters and AdamW state themselves, for `write`, without a copy. Call both
    under the worker's lock: the optimizer must not step until the file is written."""
    return {n: p.detach() for n, p in module.named_stage_parameters()}, optimizer.state_dict()


def for_write(module: StageModule, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict, bool]:
    """(parameters, AdamW state, hold) for `write`, taken under the worker's lock; ``hold``: the
    lock must stay held until the file is written.

    On the CPU: the live tensors (`live`, hold): a copy would double the stage in the memory the
    stage computes in, and the stage computes nothing until the file is written. On a GPU that wait
    is the file's time on disk (a 2.06B model's stage: 5-6 GB torch.saved, hashed and fsynced, every
    stage at the same instant of the clock: the pipeline trained only in the gaps between
    checkpoints), while copies in host memory (`take`) cost a second and none of the GPU's memory,
    which is what a volunteer lacks: there the lock covers the copy alone."""
    if module.device.type == "cpu":
        return *live(module, optimizer), True
    return *take(module, optimizer), False


def write(
    state_dir: Path, *, run_id: str, stage: int, stages: int, version: int, model: Any, layers: list[int],
    params: dict[str, torch.Tensor], optimizer: dict | None, outer: dict[str, torch.Tensor] | None,
    tokens_committed: int, optimizer_steps: int, run_config: dict | None, keep: int = KEEP,
    state_hash: str | None = None,
) -> CheckpointFile:
    """Write one checkpoint atomically and drop this stage's versions beyond the ``keep`` kept.
    ``state_hash``: `params_hash` of ``params`` if the caller has it already (it costs a pass over
    the stage's weights)."""
    folder = Path(state_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(stage, stages, version)
    state = {
        "format": FORMAT, "run_id": run_id, "stage": stage, "stages": stages, "layers": list(layers),
        "version": version, "at": time.time(), "model": dataclasses.asdict(model), "params": params,
        "state_hash": state_hash or params_hash(params), "optimizer": optimizer, "outer": outer,
        "tokens_committed": int(tokens_committed), "optimizer_steps": int(optimizer_steps), "config": run_config,
    }
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
        integrity.seal(tmp)  # the checksum trailer (protocol/integrity.py), fsynced
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: no half-written file left to fill it further
        raise
    integrity.fsync_dir(folder)
    for old in dropped([c for c in listed(state_dir) if c.stage == stage], keep):
        old.path.unlink(missing_ok=True)
    return CheckpointFile(path, stage, stages, version)


def dropped(files: list[CheckpointFile], keep: int = KEEP) -> list[CheckpointFile]:
    """Of one stage's files (oldest first), those no longer kept: all but the newest
    ``keep - keep // 2`` and the newest ``keep // 2`` multiples of ``SPARSE`` (fewer multiples
    than that: the next newest instead), ``keep`` in all."""
    newest_n, sparse_n = keep - keep // 2, keep // 2
    sparse = [c for c in files if c.version % SPARSE == 0]
    kept = {c.version for c in files[-newest_n:]} if newest_n else set()
    for c in reversed(sparse):
        if sparse_n <= 0:
            break
        if c.version not in kept:
            kept.add(c.version)
            sparse_n -= 1
    for c in reversed(files):  # too few multiples yet: the next newest fill the bound
        if len(kept) >= keep:
            break
        kept.add(c.version)
    return [c for c in files if c.version not in kept]


def verify_folder(state_dir: Path) -> int:
    """Check every stage checkpoint of a state folder against its checksum (a streaming hash; no
    file is loaded), before the peer joins its run: IntegrityError, one line naming the first bad
    file and what to do. Returns how many files carry a checksum (the others predate checksums
    and are read unchecked)."""
    return sum(integrity.check(c.path, what="stage checkpoint", fix=FIX) for c in listed(state_dir))


def read(path: Path) -> dict[str, Any]:
    """A checkpoint file's content; ValueError if it is not one. IntegrityError (one line: the file
    and what to do) if its bytes do not match the checksum written with them; a file from before
    checksums (no trailer) is read unchecked."""
    integrity.check(path, what="stage checkpoint", fix=FIX)
    try:
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - truncated, corrupt or foreign: the same answer
        raise ValueError(f"{path} is not a readable stage checkpoint ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a murmur stage checkpoint (format {FORMAT!r})")
    return state

