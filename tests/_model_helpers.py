"""A tiny model trained a few steps on the bundled corpus and saved as `murmur train` saves it: what
the export, eval and generate tests read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from murmur.node.model.data import Dataset
from murmur.node.train.trainer import Trainer
from murmur.protocol.runconfig import config_from_dict


def trained_tiny(dataset: Dataset, folder: Path, steps: int, eval_batches: int = 2, **model: Any) -> Trainer:
    """The tiny preset (``model`` overrides its shape) after ``steps`` steps of batch 4 at lr 3e-3,
    checkpointed to ``folder``/checkpoint.pt; the trainer, for the tests to compare with."""
    cfg = config_from_dict({
        "model": {"preset": "tiny", **model},
        "data": {"path": str(dataset.root)},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"steps": steps, "batch_size": 4, "eval_batches": eval_batches},
    })
    trainer = Trainer(cfg, dataset, torch.device("cpu"))
    for _ in range(steps):
        trainer.step()
    trainer.save(folder / "checkpoint.pt")
    return trainer
