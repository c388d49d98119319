"""What every engine builds from a run config before it trains: the device, the dataset, the model.

The single-node trainer, both simulator engines and the node all build their replicas here, so
the same seed gives the same initial weights everywhere.
"""

from __future__ import annotations

import math

import torch

from murmur.errors import MurmurError
from murmur.gpu_choice import check_device_name
from murmur.node.model.data import Dataset
from murmur.node.model.transformer import ModelConfig, Transformer, model_config
from murmur.protocol.runconfig import RunConfig


def resolve_device(name: str = "auto") -> torch.device:
    """``--device`` (auto, cpu, cuda, cuda:N) as a device that exists here, else a one-line error.
    cuda:N also becomes the current CUDA device: kernels launch and NCCL binds there."""
    name = check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise MurmurError(f"--device {name} was asked for but no CUDA device is available: use --device cpu")
    device = torch.device(name)
    if device.index is not None:
        count = torch.cuda.device_count()
        if device.index >= count:
            raise MurmurError(
                f"--device {name}: {count} GPU(s) are visible (cuda:0 to cuda:{count - 1}); "
                "CUDA_VISIBLE_DEVICES decides which GPUs a process sees and numbers them from 0"
            )
        torch.cuda.set_device(device)
    return device


def open_run_dataset(cfg: RunConfig) -> Dataset:
    """The dataset at data.path, which must have been prepared with the run's tokenizer."""
    dataset = Dataset.open(cfg.data.path)
    if dataset.tokenizer != cfg.data.tokenizer:
        raise MurmurError(
            f"data.tokenizer is {cfg.data.tokenizer!r} but {cfg.data.path} was prepared with {dataset.tokenizer!r}"
        )
    return dataset


def resolve_model_config(cfg: RunConfig, vocab_size: int) -> ModelConfig:
    """The preset with the run's overrides; the vocabulary follows the dataset (padded to 64). The
    embeddings are tied as ``model.tie_embeddings`` says (by default untied only in a run pipelined
    over several stages), so `murmur train`, the sim, nodes and stage peers build one model."""
    m = cfg.model
    vocab = m.vocab_size or (vocab_size if vocab_size <= 256 else 64 * math.ceil(vocab_size / 64))
    try:
        return model_config(
            m.preset, dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
            hidden_dim=m.hidden_dim, seq_len=m.seq_len, vocab_size=vocab, tie_embeddings=cfg.embeddings_tied(),
        )
    except ValueError as err:
        raise MurmurError(f"[model] {err}") from None


def build_model_from_config(cfg: RunConfig, vocab_size: int, device: torch.device | str = "cpu") -> Transformer:
    mcfg = resolve_model_config(cfg, vocab_size)
    if mcfg.vocab_size < vocab_size:
        raise MurmurError(f"model.vocab_size {mcfg.vocab_size} is smaller than the tokenizer's {vocab_size}")
    return Transformer(mcfg, seed=cfg.seed).to(device)
