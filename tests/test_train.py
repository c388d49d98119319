import subprocess
import sys

import torch

from murmur.node.train.trainer import Trainer
from murmur.optim.inner import lr_at
from murmur.protocol.runconfig import OptimSection, config_from_dict

CPU = torch.device("cpu")


def _cfg(data_path, steps=40, **train):
    return config_from_dict(
        {
            "model": {"preset": "tiny", "seq_len": 64},
            "data": {"path": str(data_path)},
            "optim": {"lr": 3e-3, "warmup_steps": 5},
            "train": {"steps": steps, "batch_size": 8, "eval_batches": 4, **train},
        }
    )


def test_schedule_warms_up_then_decays():
    o = OptimSection(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, o) == 0.1 and lr_at(9, 100, o) == 1.0
    assert lr_at(10, 100, o) == 1.0
    assert abs(lr_at(100, 100, o) - 0.1) < 1e-12
    lrs = [lr_at(s, 100, o) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_checkpoint_round_trip_resumes_exactly(byte_dataset, tmp_path):
    cfg = _cfg(byte_dataset.root, steps=8)
    straight = Trainer(cfg, byte_dataset, CPU)
    expected = [straight.step().loss for _ in range(8)]

    first = Trainer(cfg, byte_dataset, CPU)
    got = [first.step().loss for _ in range(4)]
    first.save(tmp_path / "ckpt.pt")
    second = Trainer(cfg, byte_dataset, CPU)
    second.load(tmp_path / "ckpt.pt")
    assert second.step_count == 4 and second.loader.position == first.loader.position
    got += [second.step().loss for _ in range(4)]
    assert got == expected  # bit-exact on the CPU


def test_short_run_on_real_text_lowers_validation_loss(byte_dataset):
    trainer = Trainer(_cfg(byte_dataset.root, steps=40), byte_dataset, CPU)
    before = trainer.validate()
    for _ in range(40):
        trainer.step()
    after = trainer.validate()
    assert after < before - 1.0, (before, after)  # ln(256) = 5.5 at start; ~3 after 40 steps


def test_cli_trains_and_resumes(byte_dataset, tmp_path):
    cmd = [
        sys.executable, "-m", "murmur.cli", "train", "--preset", "tiny", "--data", str(byte_dataset.root),
        "--set", "train.batch_size=4", "--set", "model.seq_len=32", "--set", "train.eval_batches=2",
        "--set", "train.eval_every=3", "--device", "cpu", "--out", str(tmp_path / "run"),
    ]
    first = subprocess.run([*cmd, "--steps", "3"], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "step     3/3 | loss" in first.stdout and "done: 3 steps" in first.stdout
    again = subprocess.run([*cmd, "--steps", "5", "--resume"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "step     4/5" in again.stdout and "step     1/" not in again.stdout


def test_missing_data_folder_is_a_one_line_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "murmur.cli", "train", "--data", str(tmp_path / "absent"), "--steps", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: data folder {tmp_path / 'absent'} does not exist: run " \
        f"`murmur data prepare --out {tmp_path / 'absent'}`"
