"""Token datasets that the coordinator leases piece by piece.

`murmur data prepare` turns text into fixed-size token shards (raw little-endian uint16, read
through memory maps), a held-out validation split and a `manifest.json` with the source, the
tokenizer, and each shard's token count and sha256. The same input gives byte-identical output.

A position in the training data is `(shard, offset)`: the coordinator leases a shard from an offset
and nodes commit the offset they reached. `BatchLoader` starts from any position and resumes there
exactly: the batches after a resume are the ones an uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from murmur.errors import MurmurError
from murmur.node.model.corpus import bundled_corpus, iter_text_files, read_source
from murmur.node.model.tokenizer import get_tokenizer

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
TOKEN_DTYPE = np.dtype("<u2")  # both tokenizers fit in 16 bits
DEFAULT_SHARD_TOKENS = 1 << 18
DEFAULT_VAL_FRACTION = 0.01
DEFAULT_PIECE_CHARS = 16384  # --shuffle-seed cuts files into pieces of about this many characters


class DataError(MurmurError):
    """A dataset that is missing, incomplete or corrupted."""


@dataclass(frozen=True, slots=True)
class Position:
    shard: int
    offset: int

    def to_dict(self) -> dict[str, int]:
        return {"shard": self.shard, "offset": self.offset}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------
# Preparing

VAL_BLOCK_TOKENS = 2048  # the validation split is cut in blocks of at least this many tokens
VAL_MAX_BLOCKS = 100


def split_validation(tokens: np.ndarray, n_val: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(train, val, blocks): ``n_val`` tokens held out as equal blocks spread evenly over the
    stream, the end of each of ``blocks`` equal segments. Taking the tail instead would hold out
    only the last source of a multi-source corpus (the Linux docs of Shakespeare + Python docs +
    Linux docs), and the validation loss would measure that source alone."""
    blocks = max(1, min(VAL_MAX_BLOCKS, n_val // VAL_BLOCK_TOKENS))
    size = n_val // blocks
    bounds = np.linspace(0, len(tokens), blocks + 1).astype(np.int64)
    train, val = [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        train.append(tokens[a : b - size])
        val.append(tokens[b - size : b])
    return np.concatenate(train), np.concatenate(val), blocks


def cut_pieces(text: str, size: int) -> list[str]:
    """``text`` cut at paragraph breaks (blank lines) into pieces of about ``size`` characters or
    more; a text without a break after ``size`` characters stays whole from there on."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = text.find("\n\n", start + size)
        if cut < 0:
            break
        pieces.append(text[start : cut + 2])
        start = cut + 2
    pieces.append(text[start:])
    return [p for p in pieces if p]


def prepare(
    out: str | Path,
    sources: list[str | Path] | None = None,
    tokenizer: str = "byte",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    shuffle_seed: int | None = None,
    piece_chars: int = DEFAULT_PIECE_CHARS,
) -> dict:
    """Tokenize the sources (the bundled Shakespeare when none) into ``out``; returns the manifest.

    ``shuffle_seed``: cut every file into pieces of about ``piece_chars`` at paragraph breaks and
    shuffle the pieces with this seed, so every shard (and every worker's stream) mixes the
    sources instead of reading one source after another; ``None`` keeps the files in order."""
    if shard_tokens < 1024:
        raise DataError(f"--shard-tokens {shard_tokens} is too small (at least 1024)")
    if not 0.0 < val_fraction < 0.5:
        raise DataError(f"--val-fraction {val_fraction} must be within (0, 0.5)")
    tok = get_tokenizer(tokenizer)
    paths = [Path(s) for s in sources] if sources else [bundled_corpus()]
    for p in paths:
        if not p.exists():
            raise DataError(f"source {p} does not exist")
    files = list(iter_text_files(paths))
    if not files:
        raise DataError(f"no .txt, .md, .rst or .html files under {', '.join(map(str, paths))}")
    texts = [read_source(f) for f in files]
    docs = texts
    if shuffle_seed is not None:
        if piece_chars < 256:
            raise DataError(f"--piece-chars {piece_chars} is too small (at least 256)")
        docs = [piece for t in texts for piece in cut_pieces(t, piece_chars)]
        random.Random(shuffle_seed).shuffle(docs)
    encoded = tok.encode_batch(docs) if hasattr(tok, "encode_batch") else [tok.encode(t) for t in docs]
    stream: list[int] = []
    for ids in encoded:
        stream.extend(ids)
        stream.append(tok.eot)
    tokens = np.asarray(stream, dtype=TOKEN_DTYPE)
    n_val = max(int(len(tokens) * val_fraction), 1024)
    if len(tokens) < n_val + shard_tokens // 4:
        raise DataError(f"only {len(tokens)} tokens: too little text for a dataset (add more sources)")
    train, val, val_blocks = split_validation(tokens, n_val)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("shard_*.bin"):
        old.unlink()
    shards = []
    for i, start in enumerate(range(0, len(train), shard_tokens)):
        piece = train[start : start + shard_tokens].tobytes()
        name = f"shard_{i:05d}.bin"
        (out / name).write_bytes(piece)
        shards.append({"id": i, "file": name, "tokens": len(piece) // TOKEN_DTYPE.itemsize, "sha256": _sha256(piece)})
    val_bytes = val.tobytes()
    (out / "val.bin").write_bytes(val_bytes)
    source_label = ["bundled:shakespeare.txt"] if not sources else [str(s) for s in sources]
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": source_label,
        "source_files": len(files),
        "source_sha256": _sha256("\0".join(texts).encode("utf-8")),
        "order": "files" if shuffle_seed is None else {"shuffle_seed": shuffle_seed, "pieces": len(docs),
                                                        "piece_chars": piece_chars},
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "dtype": "uint16",
        "shard_tokens": shard_tokens,
        "total_train_tokens": int(len(train)),
        "shards": shards,
        "val": {"file": "val.bin", "tokens": int(len(val)), "blocks": val_blocks, "sha256": _sha256(val_bytes)},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ---------------------------------------------------------------------------------------------
# Reading


class Dataset:
    """A prepared dataset folder. Shards are memory-mapped and checked against their sha256."""

    def __init__(self, root: Path, manifest: dict) -> None:
        self.root = root
        self.manifest = manifest
        self._maps: dict[int, np.ndarray] = {}
        self._val: np.ndarray | None = None

    @classmethod
    def open(cls, path: str | Path) -> Dataset:
        root = Path(path)
        if not root.is_dir():
            raise DataError(f"data folder {root} does not exist: run `murmur data prepare --out {root}`")
        mpath = root / MANIFEST
        if not mpath.is_file():
            raise DataError(f"{root} has no {MANIFEST}: run `murmur data prepare --out {root}`")
        try:
            manifest = json.loads(mpath.read_text())
            _ = manifest["shards"], manifest["val"], manifest["vocab_size"], manifest["tokenizer"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{mpath} is malformed ({err}): re-run `murmur data prepare`") from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise DataError(f"{mpath} has format {manifest.get('format_version')}, expected {FORMAT_VERSION}")
        return cls(root, manifest)

    @property
    def num_shards(self) -> int:
        return len(self.manifest["shards"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def tokenizer(self) -> str:
        return str(self.manifest["tokenizer"])

    def shard_size(self, shard: int) -> int:
        return int(self.manifest["shards"][shard]["tokens"])

    def _load(self, entry: dict, what: str) -> np.ndarray:
        path = self.root / entry["file"]
        if not path.is_file():
            raise DataError(f"{what} file {path} is missing: re-run `murmur data prepare`")
        data = path.read_bytes()
        if _sha256(data) != entry["sha256"]:
            raise DataError(f"{what} {path} fails its sha256 check (corrupted?): re-run `murmur data prepare`")
        # Verified once; then read through a memory map so many workers share the page cache.
        return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")

    def shard(self, shard: int) -> np.ndarray:
        if not 0 <= shard < self.num_shards:
            raise DataError(f"shard {shard} does not exist (the dataset has {self.num_shards})")
        if shard not in self._maps:
            self._maps[shard] = self._load(self.manifest["shards"][shard], f"shard {shard}")
        return self._maps[shard]

    def val(self) -> np.ndarray:
        if self._val is None:
            self._val = self._load(self.manifest["val"], "validation split")
        return self._val

    def verify(self) -> None:
        """Check every file against the manifest (raises DataError on the first mismatch)."""
        for i in range(self.num_shards):
            self.shard(i)
        self.val()


class BatchLoader:
    """Batches ``(x, y)`` of shape [B, T] read in order from ``shards``, starting at ``position``.

    A batch takes B*T+1 consecutive tokens of one shard (targets are inputs shifted by one) and
    advances the offset by B*T. When a shard has no full batch left the loader moves to the next
    shard of the list (wrapping round when ``cycle``), or stops. ``position`` always names the next
    batch, so saving it and starting a new loader there resumes exactly.
    """

    def __init__(
        self,
        dataset: Dataset,
        shards: list[int],
        batch_size: int,
        seq_len: int,
        position: Position | None = None,
        cycle: bool = True,
    ) -> None:
        if not shards:
            raise DataError("a loader needs at least one shard")
        self.dataset, self.shards, self.cycle = dataset, list(shards), cycle
        self.batch_size, self.seq_len = batch_size, seq_len
        self.span = batch_size * seq_len
        if all(dataset.shard_size(s) < self.span + 1 for s in self.shards):
            raise DataError(f"no shard holds one batch of {batch_size}x{seq_len} tokens: use smaller batches")
        self.position = position or Position(self.shards[0], 0)
        if self.position.shard not in self.shards:
            raise DataError(f"position shard {self.position.shard} is not among the loader's shards")

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def _advance_shard(self) -> None:
        i = self.shards.index(self.position.shard) + 1
        if i == len(self.shards):
            if not self.cycle:
                raise StopIteration
            i = 0
        self.position = Position(self.shards[i], 0)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch  # here, not at the top: preparing and checking shards (`murmur data`) needs no torch

        for _ in range(len(self.shards) + 1):
            if self.position.offset + self.span + 1 <= self.dataset.shard_size(self.position.shard):
                break
            self._advance_shard()
        tokens = self.dataset.shard(self.position.shard)
        o = self.position.offset
        buf = torch.from_numpy(tokens[o : o + self.span + 1].astype(np.int64))
        self.position = Position(self.position.shard, o + self.span)
        x = buf[:-1].view(self.batch_size, self.seq_len)
        y = buf[1:].view(self.batch_size, self.seq_len)
        return x, y


def eval_batches(dataset: Dataset, batch_size: int, seq_len: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of the validation split (fewer if it is short; the same every time), their
    rows spread evenly over the whole split, so a few batches still cover every part of it."""
    import torch

    val = dataset.val()
    fit = (len(val) - 1) // seq_len  # whole rows the split holds
    n = min(n, fit // batch_size)
    if n < 1:
        # A validation split shorter than one batch: use shorter rows of the whole split.
        rows = max(1, fit)
        buf = torch.from_numpy(val[: rows * seq_len + 1].astype(np.int64))
        return [(buf[:-1].view(rows, seq_len), buf[1:].view(rows, seq_len))]
    total = n * batch_size
    # total <= fit, so the stride is at least seq_len: rows never overlap.
    stride = (len(val) - 1 - seq_len) // max(total - 1, 1)
    idx = torch.arange(seq_len + 1)
    data = torch.from_numpy(val.astype(np.int64))
    rows = torch.stack([data[i * stride + idx] for i in range(total)])
    return [(batch[:, :-1], batch[:, 1:]) for batch in rows.split(batch_size)]
