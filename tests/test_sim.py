"""`murmur sim` on the tiny preset, on the CPU: the validation loss goes down, the outputs are
written, and bad input is one clear line."""

from __future__ import annotations

import json

import pytest

from murmur.cli import main

SMALL = [
    "--set", "model.n_layers=2", "--set", "model.seq_len=64", "--set", "train.batch_size=4",
    "--set", "train.eval_every=10", "--set", "train.eval_batches=2", "--set", "optim.lr=2e-3",
    "--set", "optim.warmup_steps=2", "--set", "sync.overlap_steps=1", "--device", "cpu",
]


@pytest.mark.parametrize("algorithm,codec", [("diloco", "int4"), ("streaming", "fp16"), ("demo", "fp32")])
def test_sim_lowers_the_validation_loss(byte_dataset, tmp_path, capsys, algorithm, codec):
    out = tmp_path / "out"
    rc = main(["sim", "--workers", "2", "--algorithm", algorithm, "--codec", codec, "-H", "5", "--steps", "20",
               "--data", str(byte_dataset.root), "--out", str(out), *SMALL])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.count("round ") == 4  # one progress line per outer step
    assert "vs ddp" in text  # the final table
    data = json.loads((out / "sim.json").read_text())
    run = data["runs"][0]
    curve = run["curve"]
    assert [p["step"] for p in curve] == [0, 10, 20]
    assert curve[-1]["val_loss"] < curve[0]["val_loss"] - 0.5
    assert curve[-1]["tokens"] == 20 * 2 * 4 * 64
    assert run["bytes_per_worker"] == curve[-1]["bytes_sent"] > 0
    assert run["reduction_vs_ddp"] > 1
    assert (out / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_ddp_counts_a_ring_all_reduce_every_step(byte_dataset, tmp_path):
    out = tmp_path / "ddp"
    rc = main(["sim", "--workers", "3", "--algorithm", "ddp", "--steps", "4", "-H", "2",
               "--data", str(byte_dataset.root), "--out", str(out), *SMALL])
    assert rc == 0
    run = json.loads((out / "sim.json").read_text())["runs"][0]
    assert run["bytes_per_worker"] == run["ddp_bytes_per_worker"] == 4 * (2 * 2 * 4 * run["n_params"] // 3)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--codec", "int3"], "'int3'"),
        (["--aggregator", "median"], "sync.aggregator"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--data", "/nonexistent/x"], "does not exist"),
    ],
)
def test_bad_input_is_one_line(byte_dataset, capsys, args, message):
    base = ["sim", "--data", str(byte_dataset.root), "--steps", "2", *SMALL]
    rc = main([*base, *args])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("error: ") and message in err and "\n" not in err


@pytest.mark.parametrize("engine", ["stacked", "threads"])
def test_sim_warm_starts_from_a_train_checkpoint(byte_dataset, tmp_path, engine):
    """`--init-from`: every replica starts from the checkpoint's weights (the DiLoCo paper's warm
    start), so the first evaluation is the trained model's loss, not the seed's."""
    run = tmp_path / "pre"
    model_keys = [a for a in SMALL if a.startswith("model.")]
    train_args = [x for k in model_keys for x in ("--set", k)]
    assert main(["train", "--data", str(byte_dataset.root), "--steps", "30", "--out", str(run), "--device", "cpu",
                 "--set", "train.batch_size=4", "--set", "optim.lr=2e-3", *train_args]) == 0
    cold, warm = tmp_path / "cold", tmp_path / "warm"
    base = ["sim", "--workers", "2", "-H", "5", "--steps", "5", "--data", str(byte_dataset.root), "--engine", engine,
            *SMALL]
    assert main([*base, "--out", str(cold)]) == 0
    assert main([*base, "--out", str(warm), "--init-from", str(run / "checkpoint.pt")]) == 0
    start = {name: json.loads((d / "sim.json").read_text())["runs"][0]["curve"][0]["val_loss"]
             for name, d in (("cold", cold), ("warm", warm))}
    assert start["warm"] < start["cold"] - 1.0


def test_init_from_a_mismatched_or_missing_checkpoint_is_one_line(byte_dataset, tmp_path, capsys):
    import torch

    from murmur.node.train.build import build_model_from_config
    from murmur.protocol.runconfig import config_from_dict

    other = build_model_from_config(config_from_dict({"model": {"preset": "tiny", "n_layers": 1}}), 256)
    torch.save({"model": other.state_dict()}, tmp_path / "other.pt")
    torch.save({"model": {k: torch.full_like(v, float("nan")) for k, v in other.state_dict().items()}},
               tmp_path / "nan.pt")
    base = ["sim", "--data", str(byte_dataset.root), "--steps", "2", *SMALL]
    for path, message in ((tmp_path / "other.pt", "do not fit the configured model"),
                          (tmp_path / "none.pt", "cannot be read"), (tmp_path / "nan.pt", "non-finite values")):
        rc = main([*base, "--init-from", str(path)])
        err = capsys.readouterr().err.strip()
        assert rc == 1 and err.startswith("error: ") and message in err and "\n" not in err, err


def test_sim_seeds_report_mean_and_spread(byte_dataset, tmp_path, capsys):
    out = tmp_path / "seeds"
    rc = main(["sim", "--workers", "2", "-H", "2", "--steps", "2", "--seeds", "2", "--data", str(byte_dataset.root),
               "--out", str(out), *SMALL])
    assert rc == 0
    assert "2 seeds (0, 1): val loss" in capsys.readouterr().out
    data = json.loads((out / "sim.json").read_text())
    losses = [r["val_loss"] for r in data["runs"]]
    assert len(losses) == 2 and losses[0] != losses[1]  # other weights and other data
    s = data["seeds"]
    assert s["seeds"] == [0, 1]
    assert s["val_loss_mean"] == pytest.approx(sum(losses) / 2)
    assert s["val_loss_spread"] == pytest.approx(abs(losses[0] - losses[1]) / 2)


@pytest.mark.parametrize("seeds,message", [("0", "at least 1"), ("a", "comma-separated"), ("1,1", "distinct")])
def test_bad_seeds_are_one_line(byte_dataset, capsys, seeds, message):
    rc = main(["sim", "--data", str(byte_dataset.root), "--steps", "2", "--seeds", seeds, *SMALL])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and message in err and "\n" not in err, err
