"""`murmur generate`: sampling from a model, token by token, with or without the KV cache.

The model sees at most its `seq_len` tokens (the rows it was trained on, positions from 0). When a
generation outgrows that, the context restarts on the last half of the text: one prefill of
seq_len/2 tokens every seq_len/2 new tokens, so the cache keeps its speed and no position past
training is ever used. The path without a cache (a full forward of the context per token) makes the
same choice, so the two compute the same logits and greedy decoding gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from murmur.errors import MurmurError
from murmur.node.model.kv_cache import KVCache, decode
from murmur.node.model.sequence_decoder import SequenceDecoder
from murmur.node.model.transformer import Transformer


@dataclass(kw_only=True, slots=True, frozen=True)
class Sampling:
    temperature: float = 0.8  # 0: greedy (the most likely token)
    top_k: int | None = None  # keep the k most likely tokens
    top_p: float | None = None  # keep the fewest tokens whose probability sums to p

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise MurmurError("--temperature must not be negative (0 is greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise MurmurError("--top-k must be at least 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise MurmurError("--top-p must be in (0, 1]")


def pick(logits: torch.Tensor, s: Sampling, gen: torch.Generator) -> int:
    """One token from the logits [V] of the last position."""
    if s.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / s.temperature
    if s.top_k is not None and s.top_k < logits.numel():
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if s.top_p is not None and s.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p >= s.top_p  # what is already past p before this token
        probs = probs.clone()
        probs[order[drop]] = 0.0
    return int(torch.multinomial(probs, 1, generator=gen))


def generate(
    model: Transformer,
    prompt: list[int],
    *,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int = 0,
    use_cache: bool = True,
    vocab_size: int | None = None,
    stop_token: int | None = None,
) -> Iterator[int]:
    """An iterator of up to ``max_new_tokens`` tokens after ``prompt`` (the tokenizer's
    ``vocab_size`` masks the model's padded ids; ``stop_token`` ends the generation unyielded).
    The prompt is checked here, before the first token is asked for."""
    if len(prompt) > model.cfg.seq_len:
        raise MurmurError(
            f"the prompt is {len(prompt)} tokens and the model's context is {model.cfg.seq_len}: shorten the prompt"
        )
    if not prompt:
        raise MurmurError("an empty prompt: give at least one token (the tokenizer's end-of-text starts a document)")
    return _tokens(model, prompt, max_new_tokens, sampling, seed, use_cache, vocab_size, stop_token)


class CachedLogits:
    """The last position's logits through a KV cache, fed only the tokens it has not seen: fp32
    weights take `SequenceDecoder` (its per-token choices made once, here); other dtypes walk the
    model's modules and kernels (`kv_cache.decode`), whose numerics they were trained with."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.fast = SequenceDecoder(model) if model.embed.weight.dtype == torch.float32 else None
        self.cache: KVCache | None = None

    @property
    def length(self) -> int:
        if self.fast is not None:
            return self.fast.length
        return 0 if self.cache is None else self.cache.length

    def reset(self) -> None:
        if self.fast is not None:
            self.fast.reset()
        self.cache = None

    def after(self, new: list[int]) -> torch.Tensor:
        if self.fast is not None:
            return self.fast.step(new[0]) if len(new) == 1 else self.fast.feed(new)
        if self.cache is None:
            self.cache = KVCache(self.model)
        device = self.model.embed.weight.device
        return decode(self.model, torch.tensor([new], device=device), self.cache)[0, -1]


def _tokens(
    model: Transformer, prompt: list[int], max_new_tokens: int, sampling: Sampling, seed: int, use_cache: bool,
    vocab_size: int | None, stop_token: int | None,
) -> Iterator[int]:
    seq_len = model.cfg.seq_len
    device = model.embed.weight.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt)
    start = 0  # the model sees ids[start:]
    with torch.inference_mode():
        cached = CachedLogits(model) if use_cache else None
        for _ in range(max_new_tokens):
            if len(ids) - start > seq_len:
                start = len(ids) - seq_len // 2  # restart on the last half
                if cached is not None:
                    cached.reset()
            if cached is not None:
                logits = cached.after(ids[start + cached.length :])
            else:
                h = model.hidden_states(torch.tensor([ids[start:]], device=device))
                logits = F.linear(h[0, -1], model.output_weight)
            if vocab_size is not None and vocab_size < logits.numel():
                logits[vocab_size:] = float("-inf")
            token = pick(logits.cpu(), sampling, gen)
            if token == stop_token:
                return
            ids.append(token)
            yield token
