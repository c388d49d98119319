"""Single-node training: `murmur train --config RUN.toml`.

The inner optimizer (AdamW, or Muon with AdamW: optim.inner) with warm-up and cosine decay, gradient
clipping, bf16 autocast on a GPU, validation every N steps, checkpoints (model, optimizer, data
position, RNG) with exact resume, and a progress line every `train.log_every` steps: only those
steps wait for the device, and between them the next batch loads while the device runs the queued
steps. The step itself is the one the simulator and the node run (node/train/step.py), on a model
built as theirs are (node/train/build.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from murmur.errors import MurmurError
from murmur.node.model.data import BatchLoader, Dataset, Position, eval_batches
from murmur.node.train.build import build_model_from_config, open_run_dataset, resolve_device
from murmur.node.train.step import InnerStep, clip_grad_norm, evaluate
from murmur.optim.inner import make_inner_optimizer
from murmur.protocol import integrity
from murmur.protocol.runconfig import RunConfig


@dataclass(slots=True)
class StepStats:
    step: int
    loss: float
    lr: float
    tokens_per_s: float
    ms: float


class Trainer:
    """One model, its AdamW and its data position; `step()` runs one optimizer step."""

    def __init__(self, cfg: RunConfig, dataset: Dataset, device: torch.device, shards: list[int] | None = None):
        self.cfg, self.dataset, self.device = cfg, dataset, device
        self.model = build_model_from_config(cfg, dataset.vocab_size, device)
        self.opt = make_inner_optimizer(self.model, cfg.optim)
        self.loader = BatchLoader(
            dataset, shards or list(range(dataset.num_shards)), cfg.train.batch_size, self.model.cfg.seq_len
        )
        self.step_count = 0
        self._read_at = (time.perf_counter(), 0)  # (time, step) of the last read of the loss
        forward = torch.compile(self.model) if cfg.train.compile else self.model
        self.inner = InnerStep(forward, self.opt, cfg, device, clip_grad_norm(self.model))
        self.val_batches = eval_batches(dataset, cfg.train.batch_size, self.model.cfg.seq_len, cfg.train.eval_batches)

    def step(self, read: bool = True) -> StepStats | None:
        """One optimizer step. With ``read``, wait for the device and return the loss with the
        mean rate since the last read; without, return None once the step is queued."""
        x, y = next(self.loader)
        loss, lr = self.inner(self.step_count, self.cfg.train.steps, x, y)
        self.step_count += 1
        if not read:
            return None
        loss_value = loss.item()  # waits for the device, so the timing below is honest
        if not math.isfinite(loss_value):
            raise MurmurError(f"loss became {loss_value} at step {self.step_count - 1}: lower optim.lr")
        (t0, step0), now = self._read_at, time.perf_counter()
        self._read_at = (now, self.step_count)
        dt = (now - t0) / max(1, self.step_count - step0)
        return StepStats(self.step_count, loss_value, lr, x.numel() / dt, dt * 1000)

    def restart_clock(self) -> None:
        """Rates from now on (after validation or a checkpoint, which are not steps)."""
        self._read_at = (time.perf_counter(), self.step_count)

    def validate(self) -> float:
        return evaluate(self.model, self.val_batches, self.device, self.cfg.train.dtype)

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "config": self.cfg.to_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.step_count,
            "position": self.loader.position.to_dict(),
            "rng": rng,
        }

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(self.state_dict(), tmp)
        integrity.seal(tmp)  # the checksum trailer (protocol/integrity.py): checked by every reader
        tmp.replace(path)  # atomic: a crash mid-save never leaves a torn checkpoint

    def load(self, path: Path) -> None:
        # Before anything is read from it: one line naming the file when its bytes are not the
        # ones written (a checkpoint from before checksums has no trailer and is read unchecked).
        integrity.check(path, what="checkpoint", fix="delete it (or move it aside) and train again, or resume another")
        try:
            state = torch.load(path, map_location=self.device, weights_only=False)
        except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
            name = err.__class__.__name__
            raise MurmurError(f"checkpoint {path} cannot be read ({name}): delete it or fix it") from None
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step_count = int(state["step"])
        self.loader.position = Position(**state["position"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)


# ---------------------------------------------------------------------------------------------
# The command's training (its arguments: node/train/train_cli.py)


def train(cfg: RunConfig, *, device: str = "auto", out: str | None = None, resume: bool = False) -> int:
    """`murmur train` once its command line gave ``cfg``: train, validate, checkpoint to OUT."""
    dev = resolve_device(device)
    dataset = open_run_dataset(cfg)
    torch.manual_seed(cfg.seed)
    trainer = Trainer(cfg, dataset, dev)
    ckpt = Path(out or Path("runs") / cfg.name) / "checkpoint.pt"
    if resume:
        if not ckpt.is_file():
            raise MurmurError(f"--resume: no checkpoint at {ckpt}")
        trainer.load(ckpt)
        print(f"resumed from {ckpt} at step {trainer.step_count}")
    n_params = sum(p.numel() for p in trainer.model.parameters())
    mc = trainer.model.cfg
    print(
        f"training {cfg.model.preset} ({n_params / 1e6:.2f}M params, {mc.n_layers}x{mc.dim}, seq {mc.seq_len}) "
        f"on {cfg.data.path} ({dataset.tokenizer}) with {dev}, {cfg.train.steps} steps of "
        f"{cfg.train.batch_size}x{mc.seq_len} tokens"
    )
    t_start = time.perf_counter()
    first_val = best_val = trainer.validate()
    print(f"val  step {trainer.step_count:5d} | loss {first_val:.4f}")
    tokens = 0
    trainer.restart_clock()
    tc = cfg.train
    while trainer.step_count < tc.steps:
        n = trainer.step_count + 1
        stats = trainer.step(read=n % tc.log_every == 0 or n == tc.steps)
        tokens += tc.batch_size * mc.seq_len
        if stats is not None:
            print(
                f"step {n:5d}/{tc.steps} | loss {stats.loss:.4f} | lr {stats.lr:.2e} | "
                f"{stats.tokens_per_s:,.0f} tok/s | {stats.ms:.0f} ms",
                flush=True,
            )
        if n % tc.eval_every == 0 or n == tc.steps:
            val = trainer.validate()
            best_val = min(best_val, val)
            print(f"val  step {n:5d} | loss {val:.4f}", flush=True)
            trainer.restart_clock()
        if tc.checkpoint_every and n % tc.checkpoint_every == 0:
            trainer.save(ckpt)
            trainer.restart_clock()
    trainer.save(ckpt)
    wall = time.perf_counter() - t_start
    final = trainer.validate()
    print(
        f"done: {trainer.step_count} steps, {tokens:,} tokens in {wall:.0f}s ({tokens / max(wall, 1e-9):,.0f} tok/s); "
        f"val loss {first_val:.4f} -> {final:.4f} (best {min(best_val, final):.4f}); checkpoint {ckpt}"
    )
    return 0
