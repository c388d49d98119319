"""The last sync round of a stage peer at a clean stop: stage-mates stopped together leave one state.

Within-stage rounds are on the clock (node/pipeline/stage_sync.py), so peers stopped between two
rounds each kept what they had trained since the last one: their final checkpoints differed, and
the export of the run (the state most folders hold, node/export/stage_set.py) was one mate's
weights. So at a clean stop (SIGTERM), once the peer's stage service takes no more microbatches,
and before its final checkpoint:

1. The peer publishes a stop mark, ``stage/<s>/stop``: the second it stopped at, and whether its
   last round is done (not yet).
2. It asks each stage-mate of the coordinator's view for its stop mark until every mate has one or
   does not answer (gone: skipped), for at most ``pipeline.stop_sync_s``. A mate that answers
   without a mark is still serving: it is waited for until then (a whole run stopped by hand, or
   by a testnet, stops its peers a moment apart), then left out.
3. The peers that stopped together run one round of the run's outer step under the key
   ``stage/<s>/final``, among themselves only, its id the latest of their marks: each of them sees
   every other's mark, so all pick the same id and the same members. It is the round the clock
   would have run, now; a round that fails (a mate died meanwhile) leaves each its own weights.
4. It marks its round done and keeps its peer server up (at most one round deadline) until every
   member of the round has marked its own done or is gone: a mate whose copy of the result is late
   fetches it from the others (node/exchange/catchup.py).

Stage-mates whose round completed then hold one state (no microbatch trains during it), so their
final checkpoints hash the same and an export gives the averaged model
(tests/test_pipeline_stop_sync.py, real processes). A peer alone in its stage, or with no mate that
stops, waits for nothing beyond step 2 and checkpoints what it holds. A mate that keeps serving
takes no part: it is the run going on, and its next clock round averages the stage as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import grpc
import torch

from murmur.node.net.server import PublishedState
from murmur.node.net.state_transfer import StateError, StateFetchSettings, get_parts
from murmur.node.pipeline.stage_sync import StageSync
from murmur.protocol.identity import BannedError
from murmur.protocol.reachability import dialable
from murmur.protocol.wire import WireError, WireLimits, bytes_to_tensor, tensors_hash

log = logging.getLogger(__name__)

MARK = "mark"  # the one tensor of a stop mark: [the second the peer stopped at, done (0 or 1)]
POLL_S = 0.2  # between two looks at the mates' marks


def stop_name(stage: int) -> str:
    return f"stage/{stage}/stop"


def final_key(stage: int) -> str:
    return f"stage/{stage}/final"


@dataclass(frozen=True, slots=True)
class Mark:
    at: int  # the second the peer stopped at
    done: bool  # its last round is over


@dataclass(slots=True)
class FinalRound:
    """What the last round did, for the peer's stopped line."""

    members: int = 0  # peers of the stage in the round, this one included (0: none was run)
    completed: bool = False
    error: str = ""
    seconds: float = 0.0


class _Gone(Exception):
    """The mate does not answer: it is skipped."""


async def final_round(sync: StageSync, wait_s: float) -> FinalRound:
    """Run the last round of ``sync``'s stage with the mates that stop too (module docstring);
    bounded by ``wait_s`` for the mates' marks, the round's own deadline and one more for the
    others to finish theirs."""
    t0 = time.monotonic()
    out = FinalRound()
    worker = sync.worker
    if worker is None or wait_s <= 0:
        return out
    stage = worker.span.index
    server = sync.server
    try:
        mates = await asyncio.wait_for(sync.mates(stage), wait_s)
    except Exception as err:  # noqa: BLE001 - the coordinator away: nobody to meet
        out.error = f"no view of the stage's peers: {err}"
        return out
    others = {n: a for n, a in dialable(mates).items() if n != server.node_id}
    if not others:
        return out
    mine = Mark(int(time.time()), False)
    _publish(sync, stage, mine)
    try:
        marks = await _marks_of(sync, stage, others, t0 + wait_s)
        if not marks:
            log.info("stage %d: no stage-mate stops too: no last sync round", stage)
            return out
        members = {server.node_id: server.address, **{n: others[n] for n in marks}}
        out.members = len(members)
        r = max([mine.at, *(m.at for m in marks.values())])
        try:
            out.completed = await asyncio.wait_for(sync.round(r, final_key(stage), members),
                                                    sync.probe_s + 2 * sync.deadline_s)
        except Exception as err:  # noqa: BLE001 - a mate died meanwhile: each keeps its weights
            out.error = str(err)[:300] or type(err).__name__
            log.warning("stage %d: the last sync round failed: %s", stage, out.error)
        _publish(sync, stage, Mark(mine.at, True))
        # Until every member is done (or gone): a late mate may still fetch the result from here.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(_all_done(sync, stage, {n: others[n] for n in marks}), sync.deadline_s)
    finally:
        out.seconds = round(time.monotonic() - t0, 3)
    log.info("stage %d: last sync round with %d peers: %s", stage, out.members,
             "completed" if out.completed else f"not completed ({out.error})")
    return out


def _publish(sync: StageSync, stage: int, mark: Mark) -> None:
    tensors = [(MARK, torch.tensor([mark.at, int(mark.done)], dtype=torch.int64))]
    sync.server.publish_state(PublishedState(stop_name(stage), tensors, tensors_hash(tensors)))


async def _marks_of(sync: StageSync, stage: int, others: dict[str, str], until: float) -> dict[str, Mark]:
    """The stop marks of the mates that stop too, once every mate has one or is gone, or at ``until``."""
    marks: dict[str, Mark] = {}
    waiting = dict(others)
    while waiting:
        looks = await asyncio.gather(*[_mark(sync, n, a, stage) for n, a in waiting.items()],
                                     return_exceptions=True)
        for n, got in zip(list(waiting), looks, strict=True):
            if isinstance(got, Mark):
                marks[n] = got
                del waiting[n]
            elif isinstance(got, _Gone):
                del waiting[n]
        if not waiting or time.monotonic() + POLL_S >= until:
            break
        await asyncio.sleep(POLL_S)
    if waiting:
        log.info("stage %d: %s still serving after the wait: left out of the last round", stage, sorted(waiting))
    return marks


async def _all_done(sync: StageSync, stage: int, members: dict[str, str]) -> None:
    waiting = dict(members)
    while waiting:
        looks = await asyncio.gather(*[_mark(sync, n, a, stage) for n, a in waiting.items()],
                                     return_exceptions=True)
        for n, got in zip(list(waiting), looks, strict=True):
            if isinstance(got, _Gone) or (isinstance(got, Mark) and got.done):
                del waiting[n]
        if waiting:
            await asyncio.sleep(POLL_S)


async def _mark(sync: StageSync, node_id: str, address: str, stage: int) -> Mark | None:
    """A mate's stop mark; None while it has none (it serves on); _Gone if it does not answer."""
    try:
        manifest, parts = await get_parts(
            sync.server.identity, node_id, address, stop_name(stage), [MARK],
            StateFetchSettings(call_timeout=max(1.0, sync.probe_s), max_state_bytes=64), sync.server.ban_list,
        )
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise _Gone(str(err)) from None
    except (StateError, BannedError, OSError) as err:
        raise _Gone(str(err)) from None
    info = next((t for t in manifest.tensors if t.name == MARK), None)
    try:
        t = bytes_to_tensor(parts.get(MARK, b""), info.dtype, list(info.shape), WireLimits(max_numel=2), MARK)
    except (WireError, AttributeError):
        raise _Gone(f"{node_id} published a stop mark that is not one") from None
    if t.numel() != 2:
        raise _Gone(f"{node_id} published a stop mark that is not one")
    return Mark(int(t[0]), bool(t[1]))
