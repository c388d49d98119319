"""`murmur export`: the folder loads in `transformers` as LlamaForCausalLM with murmur's logits and
tokenization; a node's checkpoint exports the global state with its published hash; bad input is
one line and leaves nothing written."""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from _model_helpers import trained_tiny
from _node_helpers import TINY, small_dataset

from murmur.cli import main
from murmur.node.export.hf_tokenizer import write_tokenizer
from murmur.node.export.source import load_source
from murmur.node.export.write import export
from murmur.node.model.tokenizer import get_tokenizer
from murmur.protocol.runconfig import load_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[1]
TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"
# Text the tokenizers must agree on: runs of spaces and newlines, contractions, digits, non-ASCII.
TRICKY = [TEXT, "Hello  world!\n\n  x \t y  ", "héllo wörld — ünïcödé 日本語 🙂 's 've 123 4567", "   trailing   "]


def transformers_module():
    """`transformers`, imported with the repository root off sys.path: `python -m pytest` puts the
    root first, where murmur's kernels/ folder would shadow the `kernels` distribution that
    transformers imports. murmur itself is installed, so it does not need the root there."""
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
    try:
        importlib.import_module("kernels")  # the distribution, cached before the root comes back
        return importlib.import_module("transformers")
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def trained(tmp_path_factory, byte_dataset):
    """A `murmur train` run folder: the tiny preset with grouped-query attention, a few steps."""
    run = tmp_path_factory.mktemp("run")
    trainer = trained_tiny(byte_dataset, run, 6, seq_len=64, n_kv_heads=2)
    return run, trainer


def test_export_loads_in_transformers_with_murmurs_logits_and_tokens(trained, tmp_path):
    run, trainer = trained
    out = export(load_source(run), tmp_path / "export")
    tf = transformers_module()
    hf = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(out)
    assert type(hf).__name__ == "LlamaForCausalLM"
    ours = get_tokenizer("byte")
    for text in TRICKY:
        assert tok(text)["input_ids"] == ours.encode(text)
    ids = torch.tensor([ours.encode(TEXT)[:64]])
    with torch.no_grad():
        diff = (hf(ids).logits - trainer.model.eval()(ids)).abs().max().item()
    assert diff <= 1e-4, diff
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["inner_steps"] == 6 and prov["tokens_trained"] == 6 * 4 * 64
    assert prov["run_config"]["model"]["n_kv_heads"] == 2 and prov["dtype"] == "float32"
    # An export reads back as a source: the same weights.
    back = load_source(out)
    assert back.kind == "export" and back.provenance["state_hash"] == prov["state_hash"]
    for name, t in trainer.model.state_dict().items():
        assert torch.equal(back.weights[name], t)


def test_bf16_export_halves_the_file(trained, tmp_path):
    run, _ = trained
    src = load_source(run)
    fp32 = export(src, tmp_path / "fp32")
    assert main(["export", str(run), "--out", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    size = (tmp_path / "bf16" / "model.safetensors").stat().st_size
    assert size < 0.55 * (fp32 / "model.safetensors").stat().st_size


def test_gpt2_tokenizer_files_reproduce_murmurs_ids(tmp_path):
    eot = write_tokenizer("gpt2", tmp_path, max_length=1024)
    tok = transformers_module().AutoTokenizer.from_pretrained(tmp_path)
    ours = get_tokenizer("gpt2")
    corpus = next((REPO / "murmur" / "assets" / "corpus").glob("*.txt")).read_text()[:20000]
    for text in [*TRICKY, corpus]:
        ids = ours.encode(text)
        assert tok(text)["input_ids"] == ids
        assert tok.decode(ids) == text
    assert tok.eos_token_id == eot == ours.eot


def test_node_checkpoint_exports_the_global_state_with_its_hash(tmp_path):
    from murmur.node.daemon.state_dir import StateDir
    from murmur.node.daemon.training import NodeTrainer
    from murmur.node.daemon.window_types import LeaseView
    from murmur.node.model.data import Dataset
    from murmur.optim.factory import make_aggregator_for, make_codec_for
    from murmur.optim.inprocess import InProcessGroup

    dataset = Dataset.open(small_dataset(tmp_path))
    cfg = load_config(TINY, [f'data.path="{dataset.root}"', 'sync.algorithm="diloco"'])
    group = InProcessGroup(["p0"], lambda: make_codec_for(cfg.sync), make_aggregator_for(cfg.sync))
    node = NodeTrainer(cfg, dataset, torch.device("cpu"), group.exchange("p0"), round_timeout_s=60)
    leases = [LeaseView(f"l{s}", s, 0, dataset.shard_size(s)) for s in range(4)]
    result = node.run_window(lambda done: leases.pop(0) if leases else None, lambda: False)
    state = StateDir(tmp_path / "state")
    state.save_checkpoint(node.state_dict())
    state.append_round({"round": result.round, "tokens": result.tokens, "hash": node.global_hash()})
    (state.root / "join.json").write_text(json.dumps({"run_id": "run-abc"}))

    assert main(["export", str(state.root), "--out", str(tmp_path / "out")]) == 0
    prov = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert prov["state_hash"] == node.global_hash() and prov["round"] == 1 and prov["run_id"] == "run-abc"
    assert prov["tokens_trained"] == result.tokens and prov["source_kind"] == "node checkpoint"
    # Published: no file names the writer's folders (the data path was absolute, under tmp_path).
    for f in (tmp_path / "out").iterdir():
        assert str(tmp_path) not in f.read_bytes().decode("utf-8", "replace"), f.name
    assert prov["source"] == ".../state/checkpoint.pt" and prov["run_config"]["data"]["path"] == dataset.root.name
    manifest = hashlib.sha256((dataset.root / "manifest.json").read_bytes()).hexdigest()
    assert prov["dataset"] == {"name": dataset.root.name, "manifest_sha256": manifest}
    back = load_source(tmp_path / "out")
    for name, p in node.global_tensors():
        assert torch.equal(back.weights[name.split("/", 1)[1]], p)  # param/ or global/ (fragments)


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_bad_input_is_one_line_and_writes_nothing(trained, tmp_path, capsys):
    run, _ = trained
    data = (run / "checkpoint.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all" * 100)
    (tmp_path / "empty").mkdir()
    cases = {
        "truncated.pt": "not a readable murmur checkpoint",
        "garbage.pt": "not a readable murmur checkpoint",
        "empty": "is not a murmur export",
        "missing": "does not exist",
    }
    for name, says in cases.items():
        out = tmp_path / f"out-{name}"
        assert says in _one_line_error(capsys, ["export", str(tmp_path / name), "--out", str(out)])
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial folder left
    # An existing folder is not overwritten without --force, and never when it is not an export.
    (tmp_path / "taken").mkdir()
    assert "not a murmur export" in _one_line_error(
        capsys, ["export", str(run), "--out", str(tmp_path / "taken"), "--force"]
    )
    assert main(["export", str(run), "--out", str(tmp_path / "again")]) == 0
    assert "exists" in _one_line_error(capsys, ["export", str(run), "--out", str(tmp_path / "again")])
    assert main(["export", str(run), "--out", str(tmp_path / "again"), "--force"]) == 0
