"""The coordinator's kept states on disk (coordinator/kept_state.py) and the operator's say over a
lost run (coordinator/recovery.py), on real files and a real SQLite ledger."""

from __future__ import annotations

import pytest

from murmur.coordinator import kept_state
from murmur.coordinator.kept_state import KeptStateError, KeptVersion
from murmur.coordinator.recovery import RecoverError, Recovery, TakeKept, WaitForOperator
from murmur.coordinator.store import Store
from murmur.protocol.state_client import RawState, RawTensor, raw_hash


def _version(round_id: int) -> KeptVersion:
    tensors = [RawTensor("global/w", "float32", [2, 3], bytes(range(round_id, round_id + 24))),
               RawTensor("counters", "int64", [2], (round_id).to_bytes(8, "little") * 2)]
    state = RawState(f"state/{round_id}", raw_hash(tensors), tensors)
    return KeptVersion(run_id="run", round=round_id, states=[state])


def test_versions_are_bounded_and_read_back_checked(tmp_path):
    db = tmp_path / "coord.db"
    for r in (3, 7, 12):
        kept_state.write(db, _version(r), keep=2)
    files = kept_state.listed(db, "run")
    assert [f.name for f in files] == ["round-000000000007.state", "round-000000000012.state"]
    back = kept_state.newest(db, "run")
    assert back is not None and back.round == 12 and back.states[0].tensors[0].data == bytes(range(12, 36))
    assert kept_state.disk_bytes(db, "run") == sum(f.stat().st_size for f in files)


def test_a_kept_file_corrupted_in_place_is_one_clear_line_and_the_older_version_is_used(tmp_path):
    db = tmp_path / "coord.db"
    for r in (7, 12):
        kept_state.write(db, _version(r), keep=2)
    newest = kept_state.listed(db, "run")[-1]
    data = bytearray(newest.read_bytes())
    data[-60] ^= 0xFF  # a byte of the tensors, size unchanged
    newest.write_bytes(bytes(data))
    with pytest.raises(KeptStateError) as err:
        kept_state.read(newest)
    assert str(newest) in str(err.value) and "corrupt" in str(err.value) and "\n" not in str(err.value)
    lines: list[str] = []
    back = kept_state.newest(db, "run", log=lines.append)
    assert back is not None and back.round == 7, back
    assert len(lines) == 1 and "corrupt" in lines[0], lines
    newest.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(KeptStateError, match="truncated|not one"):
        kept_state.read(newest)


def test_a_lost_run_waits_for_the_operator_and_the_kept_state_comes_first(tmp_path):
    store = Store(tmp_path / "coord.db")
    kept = {"run": -1}
    rec = Recovery(store, lambda run: kept[run])
    try:
        assert rec.judge("run", 9, 5, "n1") is False  # a node's own checkpoint, nothing newer kept: granted
        with pytest.raises(WaitForOperator, match="round 9"):
            rec.judge("run", 9, 0, "n2")  # a fresh model under a run that trained
        assert "admin runs recover run" in rec.waiting("run")
        assert [e["kind"] for e in store.events(run_id="run")] == ["state_lost"]
        with pytest.raises(WaitForOperator):  # asked again: refused again, no second event
            rec.judge("run", 9, 0, "n2")
        assert [e["kind"] for e in store.events(run_id="run")] == ["state_lost"]
        with pytest.raises(RecoverError, match="must be one of"):
            rec.recover("run", "yesterday")
        rec.recover("run", "scratch")
        assert rec.waiting("run") == ""
        assert rec.judge("run", 9, 0, "n2") is True  # from scratch, the operator said
        with pytest.raises(RecoverError, match="is not waiting"):
            rec.recover("run", "newest")
        kept["run"] = 20
        with pytest.raises(TakeKept, match="keeps round 20"):
            rec.judge("run", 25, 12, "n3")  # behind the kept state: restore it first
        assert rec.judge("run", 25, 20, "n3") is False  # from the kept state itself: granted
    finally:
        store.close()
