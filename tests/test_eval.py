"""`murmur eval`: the loss of a checkpoint, or of its export, equals the val loss the run computed."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _model_helpers import trained_tiny

from murmur.cli import main
from murmur.node.export.source import load_source
from murmur.node.export.write import export
from murmur.node.model.data import prepare
from murmur.node.model.transformer import Transformer
from murmur.node.train.build import resolve_model_config
from murmur.protocol import integrity
from murmur.protocol.runconfig import config_from_dict

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_eval_equals_the_runs_validation_for_checkpoint_and_export(byte_dataset, tmp_path, capsys):
    trainer = trained_tiny(byte_dataset, tmp_path / "run", 5, eval_batches=3, seq_len=64)
    reported = trainer.validate()  # what `murmur train` prints as the final val loss
    export(load_source(tmp_path / "run"), tmp_path / "export")
    for source in (tmp_path / "run", tmp_path / "export"):
        argv = ["eval", str(source), "--data", str(byte_dataset.root), "--device", "cpu", "--output", "json"]
        assert main(argv) == 0
        got = json.loads(capsys.readouterr().out)
        assert abs(got["loss"] - reported) <= 1e-4, (source.name, got["loss"], reported)
        assert math.isclose(got["perplexity"], math.exp(got["loss"]))
        assert got["tokens"] == 3 * 4 * 64 and got["tokens_per_s"] > 0
        assert got["threads"] == 1  # on the CPU unless --threads says otherwise (node/export/threads.py)


def test_eval_takes_one_thread_on_the_cpu_and_threads_sets_it(byte_dataset, tmp_path, capsys):
    trained_tiny(byte_dataset, tmp_path / "run", 1, eval_batches=1, seq_len=32)
    argv = ["eval", str(tmp_path / "run"), "--data", str(byte_dataset.root), "--device", "cpu", "--batches", "1"]
    torch.set_num_threads(2)  # torch's default on 2 cores; the module fixture restores its own
    assert main(argv) == 0
    assert torch.get_num_threads() == 1 and capsys.readouterr().out.rstrip().endswith("on cpu, 1 thread")
    assert main([*argv, "--threads", "2", "--output", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["threads"] == 2 == torch.get_num_threads()


def test_eval_refuses_data_of_another_tokenizer(tmp_path, capsys):
    prepare(tmp_path / "gpt2", tokenizer="gpt2", shard_tokens=1 << 16)
    cfg = config_from_dict({"model": {"preset": "tiny", "seq_len": 32}, "data": {"path": str(tmp_path / "gpt2")}})
    (tmp_path / "run").mkdir()
    model = Transformer(resolve_model_config(cfg, 256))  # a byte-vocabulary model
    torch.save({"config": cfg.to_dict(), "model": model.state_dict(), "step": 0}, tmp_path / "run" / "checkpoint.pt")
    integrity.seal(tmp_path / "run" / "checkpoint.pt")  # as `murmur train` writes it (no warning line)
    assert main(["eval", str(tmp_path / "run"), "--data", str(tmp_path / "gpt2"), "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert "prepared with the 'gpt2' tokenizer" in err and "\n" not in err
