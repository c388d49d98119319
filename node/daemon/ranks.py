"""Several local ranks in one node: torch.distributed inside the node, the network outside.

A volunteer with N GPUs runs one `murmur node run --gpus N`: one identity, one lease, one
exchange with the run (INTELLECT-1's layout: data parallel inside a node, DiLoCo across nodes).
Rank 0 is the node: it holds the lease, the optimizer, the run's sync algorithm, the peers and
the coordinator. Ranks 1..N-1 are followers that this module starts beside it
(``python -m murmur.node.daemon.ranks``); they hold a replica of the model and nothing else.

Each inner step, over torch.distributed (NCCL on GPUs, gloo on the CPU):

1. rank 0 broadcasts a header (command, rows, sequence length), then the batch's tokens (the
   node's batch is N x ``train.batch_size`` rows of its leased shard) and its parameters, so
   every rank starts the step from rank 0's weights (whatever changed them: an outer step, a
   state fetched from peers, a checkpoint);
2. every rank runs forward and backward on its own slice of the rows;
3. the gradients are summed into rank 0 and averaged there (one flat buffer);
4. rank 0 runs the rest of the step alone: the run's sync hooks, clipping, AdamW.

A follower that dies makes rank 0's next collective fail: the node stops cleanly (commits what
it has, releases its lease, keeps its membership) and exits non-zero, and its restart resumes
from its checkpoint. Rank 0 that dies makes the followers' next collective fail, and a follower
whose parent is gone is killed by the kernel (PR_SET_PDEATHSIG), so no rank outlives its node.
The loss a node reports is its rank 0's slice.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from murmur.errors import MurmurError

STEP, STOP = 1, 2
# A collective waits this long for the other ranks (the first one includes their start: torch
# import and the model build on a loaded machine).
COLLECTIVE_TIMEOUT_S = 300.0
START_TIMEOUT_S = 300.0
REAP_WAIT_S = 2.0  # after a failed collective, how long to wait to name the rank that died


class RankError(MurmurError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: GPU r on a CUDA node, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def _flat_grads(params: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def _broadcast_params(params: Sequence[torch.Tensor]) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    dist.broadcast(flat, 0)
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class LocalRanks:
    """Rank 0's side: starts the followers, and does its part of every step's collectives."""

    def __init__(self, world: int, device: torch.device, config_path: str, vocab_size: int, threads: int) -> None:
        if world < 2:
            raise RankError(f"--gpus must be at least 2 for local ranks, not {world}")
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise RankError(f"--gpus {world}: only {torch.cuda.device_count()} GPU(s) are visible")
        self.world, self.device = world, device
        port = _free_port()
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, world):
            cmd = [sys.executable, "-m", "murmur.node.daemon.ranks", "--rank", str(rank), "--world", str(world),
                   "--port", str(port), "--config", config_path, "--vocab-size", str(vocab_size),
                   "--device", device.type, "--threads", str(threads)]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
        dist.init_process_group(_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                timeout=dt.timedelta(seconds=START_TIMEOUT_S))

    def _check(self, what: str, err: BaseException) -> RankError:
        # The collective may fail a moment before the dead rank's exit can be read: give it that moment.
        deadline = time.monotonic() + REAP_WAIT_S
        while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        dead = [f"rank {i + 1} (exit {p.returncode})" for i, p in enumerate(self.procs) if p.poll() is not None]
        who = ", ".join(dead) or "a rank"
        return RankError(f"{who} of this node's {self.world} failed during {what}: {err}")

    def begin_step(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand the step to the followers; returns rank 0's slice of the batch."""
        rows, t = x.shape
        if rows % self.world:
            raise RankError(f"a batch of {rows} rows does not split over {self.world} ranks")
        try:
            dist.broadcast(torch.tensor([STEP, rows, t], dtype=torch.long, device=self.device), 0)
            tokens = torch.stack([x, y]).to(self.device)
            dist.broadcast(tokens, 0)
            _broadcast_params(list(model.parameters()))
        except RuntimeError as err:
            raise self._check("a step's start", err) from None
        per = rows // self.world
        return x[:per], y[:per]

    def reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum every rank's gradients into rank 0's and average them (called before its optimizer step)."""
        params = list(model.parameters())
        flat = _flat_grads(params)
        try:
            dist.reduce(flat, 0)
        except RuntimeError as err:
            raise self._check("the gradient reduce", err) from None
        flat /= self.world
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p)  # views of this step's own buffer
            offset += n

    def stop(self) -> list[int | None]:
        """Tell the followers to exit (when they can still hear it) and wait for them."""
        with contextlib.suppress(RuntimeError, ValueError):
            if all(p.poll() is None for p in self.procs):
                dist.broadcast(torch.tensor([STOP, 0, 0], dtype=torch.long, device=self.device), 0)
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(30))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()
        return codes


class RankedSync:
    """The run's sync hooks with the local ranks' gradient reduce in front of the optimizer step."""

    def __init__(self, inner, ranks: LocalRanks, model: torch.nn.Module) -> None:  # noqa: ANN001
        self.inner, self.ranks, self.model = inner, ranks, model

    @property
    def replaces_optimizer(self) -> bool:
        return self.inner.replaces_optimizer

    def before_optimizer_step(self, step: int) -> None:
        self.ranks.reduce_grads(self.model)
        self.inner.before_optimizer_step(step)

    def optimizer_step(self, step: int, lr: float) -> None:
        self.inner.optimizer_step(step, lr)

    def after_optimizer_step(self, step: int) -> object:
        return self.inner.after_optimizer_step(step)


# ---------------------------------------------------------------------------------------------
# A follower


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the node (its parent) dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(1)


def follow(args: argparse.Namespace) -> int:
    from murmur.node.train.build import build_model_from_config
    from murmur.node.train.step import autocast
    from murmur.protocol.runconfig import load_config

    _die_with_parent()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    device = rank_device(torch.device(args.device), args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model_from_config(cfg, args.vocab_size, device)
    model.train()
    params = list(model.parameters())
    dist.init_process_group(_backend(device), init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=dt.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        while True:
            header = torch.zeros(3, dtype=torch.long, device=device)
            dist.broadcast(header, 0)
            cmd, rows, t = (int(v) for v in header.tolist())
            if cmd == STOP:
                return 0
            tokens = torch.empty(2, rows, t, dtype=torch.long, device=device)
            dist.broadcast(tokens, 0)
            _broadcast_params(params)
            per = rows // args.world
            x, y = (tokens[i, args.rank * per : (args.rank + 1) * per] for i in (0, 1))
            with autocast(device, cfg.train.dtype):
                loss = model(x, y)
            loss.backward()
            flat = _flat_grads(params)
            dist.reduce(flat, 0)
            for p in params:
                p.grad = None
    except RuntimeError as err:
        print(f"error: rank {args.rank}: the node's rank 0 is gone ({str(err).splitlines()[0][:200]})",
              file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m murmur.node.daemon.ranks", description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--config", required=True, help="the run config (TOML) the node trains")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=0)
    return follow(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
