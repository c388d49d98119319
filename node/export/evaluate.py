"""`murmur eval`: a model's validation loss on a prepared dataset, computed as training computes it.

The batches are `eval_batches` (the rows the trainer, the simulator and the node validate on) and
the loss is `node.train.step.evaluate` (same autocast), so for a run's state on its own dataset the
number equals the val loss the run reported. Batch size and count default to the run config's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from murmur.errors import MurmurError
from murmur.node.export.source import Source
from murmur.node.model.data import Dataset, eval_batches
from murmur.node.train.step import evaluate


@dataclass(slots=True)
class EvalResult:
    loss: float
    tokens: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def run_defaults(source: Source) -> tuple[int, int, str]:
    """(batch size, batches, dtype) of the run's own validation, or 8, 20, auto without a run config."""
    train = (source.run_config or {}).get("train") or {}
    return int(train.get("batch_size", 8)), int(train.get("eval_batches", 20)), str(train.get("dtype", "auto"))


def evaluate_source(
    source: Source, dataset: Dataset, device: torch.device, *, batch_size: int, batches: int, dtype: str
) -> EvalResult:
    if dataset.tokenizer != source.tokenizer:
        raise MurmurError(
            f"{dataset.root} was prepared with the {dataset.tokenizer!r} tokenizer, the model uses "
            f"{source.tokenizer!r}: prepare the data with `murmur data prepare --tokenizer {source.tokenizer}`"
        )
    if dataset.vocab_size > source.model.vocab_size:
        raise MurmurError(f"{dataset.root}'s vocabulary ({dataset.vocab_size}) exceeds the model's")
    model = source.build_model(device)
    val = eval_batches(dataset, batch_size, source.model.seq_len, batches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    loss = evaluate(model, val, device, dtype)  # .item() per batch: the time below is the device's too
    seconds = time.perf_counter() - t0
    return EvalResult(loss, sum(y.numel() for _, y in val), seconds)
