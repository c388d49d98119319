"""The run's tokenizer as files `transformers`' AutoTokenizer loads: tokenizer.json (the `tokenizers`
library's format, written here as plain JSON so that exporting needs neither library) and
tokenizer_config.json.

Both murmur tokenizers are byte-level, so both become a byte-level BPE:

- gpt2: GPT-2's 50,257-token BPE. tiktoken keeps only ranks (token bytes -> id); `tokenizers`
  wants merges. The merge that makes a token is found by running the BPE on the token's own bytes
  with only lower ranks allowed: it stops at exactly two parts, and those are the merge. Listed in
  rank order, the merges make `tokenizers` apply them in tiktoken's order, so ids are the same.
- byte: 256 tokens, id = the byte, and no merges: the byte-level pre-tokenizer turns each byte into
  one symbol and the BPE, with nothing to merge, gives its id. Id 0 (the byte 0, murmur's document
  separator, which never occurs in text) is the special token <|endoftext|> instead, so
  `skip_special_tokens` drops it as murmur's decoder does.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

EOT_TEXT = "<|endoftext|>"


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, the other
    bytes for the code points from 256 on, in byte order. A token's text is its bytes mapped so."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _text(token: bytes) -> str:
    m = byte_to_unicode()
    return "".join(m[b] for b in token)


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merges, in priority order, that reproduce tiktoken's ranks."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, at = rank, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best:
                    best, at = r, i
            if at < 0:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not the merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _tokenizer_json(vocab: dict[str, int], merges: list[tuple[bytes, bytes]], eot: int, split: bool) -> dict:
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": eot, "content": EOT_TEXT, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
        ],
        "normalizer": None,
        # use_regex: GPT-2's pre-tokenization split (the pattern tiktoken's r50k_base uses); the byte
        # tokenizer has no merges, so splitting would change nothing there.
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": split},
        "post_processor": None,  # murmur adds no BOS or EOS to a text
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": split},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab,
            "merges": [[_text(a), _text(b)] for a, b in merges],
        },
    }


def write_tokenizer(name: str, folder: Path, *, max_length: int) -> int:
    """Write tokenizer.json and tokenizer_config.json for murmur's tokenizer ``name`` into
    ``folder``; return the end-of-text id."""
    if name == "gpt2":
        from murmur.node.model.tokenizer import GPT2_EOT, gpt2_ranks

        ranks = gpt2_ranks()
        vocab = {_text(tok): rank for tok, rank in ranks.items()}
        doc = _tokenizer_json(vocab, merges_from_ranks(ranks), GPT2_EOT, split=True)
        eot = GPT2_EOT
    elif name == "byte":
        # Byte 0 never occurs in text (murmur's decoder drops it): its entry is the separator itself.
        vocab = {EOT_TEXT: 0, **{_text(bytes([b])): b for b in range(1, 256)}}
        doc = _tokenizer_json(vocab, [], 0, split=False)
        eot = 0
    else:
        raise ValueError(f"unknown tokenizer {name!r}")
    (folder / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOT_TEXT,
        "bos_token": EOT_TEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "murmur_tokenizer": name,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return eot
