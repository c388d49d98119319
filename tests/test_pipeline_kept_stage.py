"""Which kept stage a stage peer is offered, and when its own checkpoint loses to the kept set
(node/pipeline/kept_stage.py): the coordinator's GetStages reply as it is built
(coordinator/keeper.py's `kept_info` on a real kept file) and the run's schedule."""

from __future__ import annotations

from murmur.coordinator import kept_state
from murmur.coordinator.keeper import stage_states
from murmur.coordinator.kept_state import KeptVersion
from murmur.node.pipeline import kept_stage
from murmur.node.pipeline.schedule import RunSchedule
from murmur.protocol import coordinator_pb2 as pb
from murmur.protocol.runconfig import OptimSection
from murmur.protocol.state_client import RawState, RawTensor, raw_hash


def _stage_set(round_id: int) -> KeptVersion:
    states = []
    for s in (0, 1):
        tensors = [RawTensor(f"layers.{s}.w", "float32", [2, 2], bytes([s + 1]) * 16)]
        states.append(RawState(f"stage/{s}", raw_hash(tensors), tensors))
    return KeptVersion(run_id="run", round=round_id, states=states, kind="stages", stages=[0, 1], kept_at=1.0)


def _view(kept: KeptVersion) -> pb.StageMap:
    """A StageMap naming ``kept`` as the coordinator's GetStages does."""
    info = pb.KeptState(round=kept.round, address="127.0.0.1:1", server_name="coordinator", kept_at=kept.kept_at)
    info.stages.extend(stage_states("run", kept))
    return pb.StageMap(run_id="run", stages=2, kept=info)


def test_each_stage_is_offered_its_own_kept_state_and_nothing_without_a_kept_set(tmp_path):
    db = tmp_path / "coordinator.db"
    kept_state.write(db, _stage_set(16), keep=2)
    back = kept_state.newest(db, "run")  # read back and checked, as the keeper serves it
    assert back is not None
    view = _view(back)
    for s in (0, 1):
        got = kept_stage.offered(view, s)
        assert got is not None
        info, st = got
        assert info.round == 16 and st.name == f"kept/run/stage/{s}"
        assert st.state_hash == back.states[s].state_hash.hex()
    assert kept_stage.offered(view, 2) is None
    assert kept_stage.offered(pb.StageMap(run_id="run", stages=2), 0) is None  # the coordinator keeps none
    assert kept_stage.offered(None, 0) is None  # the coordinator was not asked


def test_a_checkpoint_older_than_the_kept_set_loses_to_it():
    # 4 sequences of 64 tokens a run step: 256 tokens a step
    schedule = RunSchedule(steps=100, batch_size=4, seq_len=64, eval_every=10, optim=OptimSection())
    kept = pb.KeptState(round=16)
    assert kept_stage.behind({"tokens_committed": 15 * 256}, kept, schedule.step_at)  # step 15 < 16
    assert not kept_stage.behind({"tokens_committed": 16 * 256}, kept, schedule.step_at)  # the same step: its own
    assert not kept_stage.behind({"tokens_committed": 20 * 256 + 10}, kept, schedule.step_at)
    assert kept_stage.behind({}, kept, schedule.step_at)  # a checkpoint that heard of no progress
    assert not kept_stage.behind({"tokens_committed": 0}, kept, None)  # no schedule: no judgement
