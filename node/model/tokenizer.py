"""Tokenizers that work offline: raw bytes, and GPT-2's BPE (r50k_base) from the committed file."""

from __future__ import annotations

import base64
import functools
from typing import Protocol

from murmur.node.model.corpus import assets_dir

# GPT-2's pre-tokenization pattern (r50k_base), as tiktoken writes it.
R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOT = 50256


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot: int  # separates documents

    def encode(self, text: str) -> list[int]: ...
    def decode(self, tokens: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes. Byte 0 never occurs in text, so it marks document boundaries."""

    name = "byte"
    vocab_size = 256
    eot = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t).decode("utf-8", errors="replace")


def gpt2_ranks() -> dict[bytes, int]:
    """GPT-2's BPE ranks (token bytes -> id) from the bundled file; `murmur export` turns them into
    a tokenizer.json (node/export/hf_tokenizer.py)."""
    ranks = {}
    for line in (assets_dir() / "gpt2.tiktoken").read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class GPT2Tokenizer:
    name = "gpt2"
    vocab_size = 50257
    eot = GPT2_EOT

    def __init__(self) -> None:
        import tiktoken

        self._enc = tiktoken.Encoding(
            name="r50k_base",
            pat_str=R50K_PATTERN,
            mergeable_ranks=gpt2_ranks(),
            special_tokens={"<|endoftext|>": GPT2_EOT},
            explicit_n_vocab=self.vocab_size,
        )

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, tokens: list[int]) -> str:
        return self._enc.decode(tokens)


@functools.cache
def get_tokenizer(name: str) -> Tokenizer:
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    from murmur.errors import MurmurError

    raise MurmurError(f"unknown tokenizer {name!r}: use 'byte' or 'gpt2'")
