"""Stage checkpoints without processes: the file round trip (weights and AdamW), the newest complete
set (the export's pick and the coordinator's record on a real SQLite ledger), and the export of a
pipelined model's stages: `transformers` loads it, untied, with the stages' own logits (fp32)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_export import transformers_module
from test_stage_board import World

from murmur.cli import main
from murmur.node.export.source import SourceError
from murmur.node.export.stage_set import load_sources
from murmur.node.export.write import export
from murmur.node.model.stages import build_stage, split_layers
from murmur.node.model.transformer import ModelConfig
from murmur.node.pipeline import stage_checkpoint
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol.runconfig import OptimSection

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = ModelConfig(vocab_size=256, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=64, seq_len=16,
                    tie_embeddings=False)
STAGES = 2
CONFIG = {"name": "pipe-ckpt-test", "data": {"tokenizer": "byte"}}


def trained_stages(steps: int = 3, seed: int = 5) -> list[StageWorker]:
    """The stages of a seeded model, each stepped a few times through its worker (so their
    weights and AdamW moments are not the seed's)."""
    spans = split_layers(MODEL.n_layers, STAGES, None)
    workers = [StageWorker(build_stage(MODEL, seed, sp), OptimSection(lr=1e-2, warmup_steps=0), target_samples=2)
               for sp in spans]
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, MODEL.seq_len), generator=g)
        y = torch.randint(0, 256, (2, MODEL.seq_len), generator=g)
        h = workers[0].forward(x)
        res = workers[1].backward(h, targets=y)
        workers[0].backward(x, grad_outputs=res.grad_inputs)
    return workers


def save(folder, worker: StageWorker, version: int, run_id: str = "run-1",
         keep: int = stage_checkpoint.KEEP) -> stage_checkpoint.CheckpointFile:
    with worker.lock:  # as the stage peer writes it: the live tensors, no copy
        params, opt = stage_checkpoint.live(worker.module, worker.optimizer)
        return stage_checkpoint.write(
            folder, run_id=run_id, stage=worker.span.index, stages=STAGES, version=version, model=MODEL,
            layers=[2, 1], params=params, optimizer=opt, outer=None, tokens_committed=100 * version,
            optimizer_steps=version, run_config=CONFIG, keep=keep)


def test_the_versions_on_disk_are_bounded_by_checkpoint_keep(tmp_path):
    worker = trained_stages()[1]
    for keep, early, late in ((2, [4, 5], [40, 45]), (6, [1, 2, 3, 4, 5], [20, 30, 40, 43, 44, 45])):
        folder = tmp_path / f"keep-{keep}"
        for v in range(1, 6):
            save(folder, worker, v, keep=keep)
        assert [c.version for c in stage_checkpoint.listed(folder)] == early
        for v in range(6, 46):
            save(folder, worker, v, keep=keep)
        # the newest, and the newest multiples of SPARSE: peers stopped minutes apart share a version
        assert [c.version for c in stage_checkpoint.listed(folder)] == late
        assert not list((folder / stage_checkpoint.FOLDER).glob(".*tmp"))  # nothing half-written left


def test_a_write_that_fails_leaves_no_file_behind(tmp_path, monkeypatch):
    """A full disk (here: torch.save raising as it would on ENOSPC) leaves the older checkpoints
    and no temporary file: a stop on a full disk never leaves a broken checkpoint."""
    worker = trained_stages()[1]
    save(tmp_path, worker, 1)

    def no_space(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stage_checkpoint.torch, "save", no_space)
    with pytest.raises(OSError, match="No space"):
        save(tmp_path, worker, 2)
    assert [c.version for c in stage_checkpoint.listed(tmp_path)] == [1]
    assert not list((tmp_path / stage_checkpoint.FOLDER).glob(".*tmp"))
    stage_checkpoint.read(stage_checkpoint.newest(tmp_path).path)  # the old one is whole


def test_a_checkpoint_restores_weights_and_adamw(tmp_path):
    worker = trained_stages()[1]
    for v in range(1, 6):
        save(tmp_path, worker, v)
    state = stage_checkpoint.read(stage_checkpoint.newest(tmp_path, 1).path)
    fresh = StageWorker(build_stage(MODEL, 99, worker.span), OptimSection(lr=1e-2, warmup_steps=0), target_samples=2)
    with torch.no_grad():
        for name, p in fresh.module.named_stage_parameters():
            p.copy_(state["params"][name])
    fresh.optimizer.load_state_dict(state["optimizer"])
    for (_, a), (_, b) in zip(fresh.module.named_stage_parameters(), worker.module.named_stage_parameters(),
                              strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fresh.params, worker.params, strict=True):
        assert torch.equal(fresh.optimizer.state[a]["exp_avg"], worker.optimizer.state[b]["exp_avg"])
        assert fresh.optimizer.state[a]["step"] == worker.optimizer.state[b]["step"] > 0


def test_a_cpu_stage_checkpoints_its_live_tensors_under_the_lock():
    """No copy of the stage in the memory it computes in: the file is written from the parameters
    and moments themselves, and the lock stays held until it is."""
    worker = trained_stages()[1]
    params, opt, hold = stage_checkpoint.for_write(worker.module, worker.optimizer)
    assert hold
    live = dict(worker.module.named_stage_parameters())
    assert all(params[n].data_ptr() == p.data_ptr() for n, p in live.items())
    moments = [st["exp_avg"] for st in opt["state"].values()]
    assert {m.data_ptr() for m in moments} == {worker.optimizer.state[p]["exp_avg"].data_ptr() for p in worker.params}


def test_a_truncated_checkpoint_is_one_clear_error(tmp_path):
    c = save(tmp_path, trained_stages(1)[0], 1)
    c.path.write_bytes(c.path.read_bytes()[:200])
    with pytest.raises(ValueError, match="not a readable stage checkpoint"):
        stage_checkpoint.read(c.path)


def test_a_stage_checkpoint_overwritten_in_place_is_refused_in_one_line(tmp_path):
    """Same size, bytes changed inside its tensors: torch.load reads such a file; its checksum
    trailer (protocol/integrity.py) refuses it before anything is loaded, and `murmur export` (a
    process of its own) says so in one line and writes nothing."""
    import subprocess

    from murmur.node.testnet.procs import murmur_cmd
    from murmur.protocol.integrity import IntegrityError

    workers = trained_stages(1)
    a, b = tmp_path / "peer-a", tmp_path / "peer-b"
    save(a, workers[0], 2)
    c = save(b, workers[1], 2)
    assert stage_checkpoint.read(c.path)["version"] == 2
    data = bytearray(c.path.read_bytes())
    at = len(data) // 2
    data[at : at + 16] = bytes(x ^ 0x5A for x in data[at : at + 16])
    c.path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"stage checkpoint .*stage-1-of-2-v2\.pt is corrupt .*move it aside"):
        stage_checkpoint.read(c.path)
    assert stage_checkpoint.verify_folder(a) == 1  # what a peer checks before it joins
    with pytest.raises(IntegrityError, match=r"stage-1-of-2-v2\.pt is corrupt"):
        stage_checkpoint.verify_folder(b)
    result = subprocess.run(murmur_cmd("export", str(a), str(b), "--out", str(tmp_path / "out")),
                            capture_output=True, text=True, timeout=180)
    err = result.stderr.strip()
    assert result.returncode == 1 and "\n" not in err and "stage-1-of-2-v2.pt is corrupt" in err, err[-2000:]
    assert not (tmp_path / "out").exists()


def test_export_of_the_stages_loads_in_transformers_untied_with_the_stages_logits(tmp_path):
    workers = trained_stages()
    a, b = tmp_path / "peer-a", tmp_path / "peer-b"
    save(a, workers[0], 7)
    save(b, workers[1], 7)
    out = export(load_sources([a, b]), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # the pipeline unties them (docs/pipeline.md)
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["source_kind"] == "pipeline stages" and prov["round"] == 7 and prov["run_id"] == "run-1"
    assert [s["stage"] for s in prov["stages"]] == [0, 1]
    tf = transformers_module()
    hf = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(0, 256, (2, MODEL.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = workers[1].module(workers[0].module(x))  # the pipeline's own forward, fp32
        theirs = hf(x).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)


def test_export_takes_the_newest_version_that_every_stage_has(tmp_path, capsys):
    workers = trained_stages()
    a, b = tmp_path / "nodes" / "peer-0", tmp_path / "nodes" / "peer-1"
    for v in (3, 4):
        save(a, workers[0], v)
    save(b, workers[1], 3)  # stage 1's peer died before version 4
    source = load_sources([tmp_path])  # a testnet folder: nodes/peer-*/
    assert source.provenance["round"] == 3 and source.provenance["tokens_trained"] == 300
    assert main(["export", str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    assert "checkpoint version 3 of 2 stages" in capsys.readouterr().out


def test_export_refuses_an_incomplete_set_or_a_mixed_source_in_one_line(tmp_path):
    workers = trained_stages(1)
    save(tmp_path / "a", workers[0], 1)
    with pytest.raises(SourceError, match=r"no version of all 2 stages .*stages found: \[0\]"):
        load_sources([tmp_path / "a"])
    (tmp_path / "other").mkdir()
    with pytest.raises(SourceError, match="holds no stage checkpoints"):
        load_sources([tmp_path / "a", tmp_path / "other"])
    assert not (tmp_path / "out").exists()


def test_the_coordinator_records_the_newest_complete_set(tmp_path):
    w = World(tmp_path / "ledger.db")
    try:
        def report(node: str, version: int, stage: int, digest: str) -> dict | None:
            with w.store.write():
                w.store.insert_checkpoint("pipe", version, f"stage/{stage}", digest, node, w.now)
            return w.board.checkpoint_reported("pipe")

        assert report("n0", 1, 0, "aa") is None  # stage 1 has none yet
        assert report("n1", 1, 1, "bb")["version"] == 1
        report("n2", 1, 1, "bb")
        assert report("n0", 2, 0, "cc")["version"] == 1  # version 2 lacks stage 1
        got = report("n1", 2, 1, "dd")
        assert got == {"version": 2, "stages": [{"stage": 0, "state_hash": "cc", "holders": ["n0"]},
                                                 {"stage": 1, "state_hash": "dd", "holders": ["n1"]}]}
        sets = w.events("stage_checkpoint_set")
        assert [e["version"] for e in sets] == [1, 2]  # each advance once
        assert sets[0]["stages"][1]["holders"] == ["n1"]
        # a data-parallel node's checkpoint is not a stage's
        with w.store.write():
            w.store.insert_checkpoint("pipe", 9, "/some/checkpoint.pt", "ee", "n9", w.now)
        assert w.board.checkpoint_set("pipe")["version"] == 2
        assert w.open().checkpoint_reported("pipe")["version"] == 2  # a restarted coordinator: no new event
        assert len(w.events("stage_checkpoint_set")) == 2
    finally:
        w.store.close()


def test_model_config_round_trips_through_a_checkpoint(tmp_path):
    c = save(tmp_path, trained_stages(1)[0], 1)
    assert ModelConfig(**stage_checkpoint.read(c.path)["model"]) == MODEL
    assert dataclasses.asdict(MODEL)["tie_embeddings"] is False
