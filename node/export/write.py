"""`murmur export`'s folder, written whole or not at all.

    OUT/
      model.safetensors        the weights under Llama's names (tied output head: not repeated)
      config.json              LlamaForCausalLM's config
      generation_config.json   EOS and a sampling default
      tokenizer.json           the run's tokenizer (node/export/hf_tokenizer.py)
      tokenizer_config.json
      provenance.json          format, run name and id, round, state hash, tokens trained, the run config
                               (a pipelined run's: round is the checkpoint version; each stage's hash),
                               and weights_sha256: model.safetensors' sha256, checked by every reader

An export is published: nothing in it names a path of the machine that wrote it. The source is
relative to the working folder (as a user types it), and the run's dataset is its folder's name and
the sha256 of its manifest (which hashes every shard), not where it lay (``published_paths``).

Everything is written into a hidden folder beside OUT and renamed into place at the end, so an
interrupted or failed export leaves no half-written OUT (at worst the hidden folder, which the next
export to OUT removes).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from murmur import __version__
from murmur.errors import MurmurError
from murmur.node.export.hf_tokenizer import write_tokenizer
from murmur.node.export.llama_format import generation_config, llama_config, to_llama_name
from murmur.node.export.source import EXPORT_FORMAT, PROVENANCE, Source
from murmur.protocol.integrity import sha256_file

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def resolve_dtype(name: str, source: Source) -> torch.dtype:
    """``run``: the dtype the run keeps its weights in (fp32 master weights for every murmur run;
    bf16 is only the compute dtype under autocast), else the named one."""
    if name == "run":
        return next(iter(source.weights.values())).dtype
    if name not in DTYPES:
        raise MurmurError(f"--dtype {name!r}: use run, fp32, bf16 or fp16")
    return DTYPES[name]


def export(source: Source, out: Path, *, dtype: torch.dtype = torch.float32, force: bool = False) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and not force:
        raise MurmurError(f"{out} exists: pass --force to replace it, or choose another --out")
    if out.exists() and not (out / PROVENANCE).is_file():
        raise MurmurError(f"{out} exists and is not a murmur export: it is not replaced, choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        model = source.build_model()  # checks every weight's name and shape against the config
        tensors = {to_llama_name(n): p.detach().to(dtype).contiguous() for n, p in model.state_dict().items()}
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only
        eot = write_tokenizer(source.tokenizer, tmp, max_length=source.model.seq_len)
        _write_json(tmp / "config.json", llama_config(source.model, dtype=_DTYPE_NAMES[dtype], eos_token_id=eot))
        _write_json(tmp / "generation_config.json", generation_config(eos_token_id=eot))
        # The weights' checksum, streamed over the file just written: murmur eval, generate and
        # every other reader of an export check it before they use the weights (source.py).
        weights_sha256 = sha256_file(tmp / "model.safetensors")
        _write_json(tmp / PROVENANCE, provenance(source, dtype, weights_sha256))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.exists():
            old = out.parent / f".{out.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def provenance(source: Source, dtype: torch.dtype, weights_sha256: str | None = None) -> dict:
    p = source.provenance
    return {
        "format": EXPORT_FORMAT,
        "murmur_version": __version__,
        "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "source_kind": source.kind,
        "source": _published_source(source),
        "run_name": p.get("run_name"),
        "run_id": p.get("run_id"),
        "round": p.get("round"),
        "inner_steps": p.get("inner_steps"),
        "state_hash": p.get("state_hash"),
        **({"shared_state_hash": p["shared_state_hash"], "holders": p.get("holders", [])}
           if "shared_state_hash" in p else {}),
        **({"stages": p["stages"]} if "stages" in p else {}),  # a pipelined run's: each stage's hash and holders
        **({"kept": p["kept"]} if "kept" in p else {}),  # a live read: from the coordinator's kept copy
        "tokens_trained": p.get("tokens_trained"),
        "tokens_note": p.get("tokens_note"),
        "dtype": _DTYPE_NAMES[dtype],
        **({"weights_sha256": weights_sha256} if weights_sha256 else {}),
        "tokenizer": source.tokenizer,
        "model": dataclasses.asdict(source.model),
        **published_data(source.run_config),
    }


def _published_source(source: Source) -> str:
    """Where the weights came from: the files' paths as ``published_path`` gives them; a live run's
    coordinator and an export's own record as they are."""
    if source.kind.endswith("checkpoint"):
        return published_path(source.path)
    if source.kind == "pipeline stages":
        return ", ".join(published_path(part) for part in str(source.path).split(", "))
    return str(source.provenance.get("source", source.path))


def published_path(path: Path | str) -> str:
    """``path`` as an export may name it: relative to the working folder when under it, else only its
    last two parts (``.../node-0/checkpoint.pt``); the machine's own folders stay out."""
    p = Path(path)
    if not p.is_absolute():
        return str(p)
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(Path("...", *p.parts[-2:]))


def published_data(run_config: dict | None) -> dict:
    """The run config with its ``data.path`` as the dataset's folder name, and the dataset as its
    name and its manifest's sha256 (None where the folder is not on this machine): a reader can tell
    which data trained the model without learning where the writer keeps it."""
    if not run_config or not isinstance(run_config.get("data"), dict) or "path" not in run_config["data"]:
        return {"run_config": run_config}
    cfg = copy.deepcopy(run_config)
    where = Path(str(cfg["data"]["path"]))
    try:
        digest: str | None = hashlib.sha256((where / "manifest.json").read_bytes()).hexdigest()
    except OSError:
        digest = None
    if where.is_absolute() or ".." in where.parts:
        cfg["data"]["path"] = where.name
    return {"dataset": {"name": where.name, "manifest_sha256": digest}, "run_config": cfg}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
