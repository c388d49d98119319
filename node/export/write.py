"""`murmur export`'s folder, written whole or not at all.

    OUT/
      model.safetensors        the weights under Llama's names (tied output head: not repeated)
      config.json              LlamaForCausalLM's config
      generation_config.json   EOS and a sampling default
      tokenizer.json           the run's tokenizer (node/export/hf_tokenizer.py)
      tokenizer_config.json
      provenance.json          format, run name and id, round, state hash, tokens trained, the run config
                               (a pipelined run's: round is the checkpoint version; each stage's hash)

Everything is written into a hidden folder beside OUT and renamed into place at the end, so an
interrupted or failed export leaves no half-written OUT (at worst the hidden folder, which the next
export to OUT removes).
"""

from __future__ import annotations

import dataclasses
import datetime
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
        _write_json(tmp / PROVENANCE, provenance(source, dtype))
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


def provenance(source: Source, dtype: torch.dtype) -> dict:
    p = source.provenance
    return {
        "format": EXPORT_FORMAT,
        "murmur_version": __version__,
        "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "source_kind": source.kind,
        "source": p.get("source", str(source.path)),
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
        "tokenizer": source.tokenizer,
        "model": dataclasses.asdict(source.model),
        "run_config": source.run_config,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
