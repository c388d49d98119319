"""What a run left behind, read into one `Source`: a model's shape, its weights, its tokenizer, and
what is known of where it came from.

Accepted, in the order they are tried:

    an export folder        provenance.json + config.json + model.safetensors (`murmur export`'s)
    a checkpoint file       a node's checkpoint.pt (node/daemon/checkpoint_file.py) or `murmur train`'s
    a node state folder     STATE_DIR/checkpoint.pt, with join.json (run id) and rounds.jsonl (tokens)
    a `murmur train` folder runs/NAME/checkpoint.pt
    a testnet folder        OUT/nodes/node-*/: the node whose round log reached the newest round
    stage peers' folders    STATE_DIR/stage-checkpoints/ of a pipelined run's stage peers (one or
                            several folders, or a testnet folder with stages): the newest version
                            of every stage, assembled (node/export/stage_set.py)

A node's checkpoint holds two copies of the model: the local weights and the global state the
peers agreed on after the round ("shared"). The global state is the run's model (its hash is the one
every node publishes), so that is what is read; parameters it does not hold (none today) come from
the local weights.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from murmur.errors import MurmurError
from murmur.node.model.transformer import ModelConfig, Transformer

PROVENANCE = "provenance.json"
EXPORT_FORMAT = "murmur-export-1"
CHECKPOINT = "checkpoint.pt"
CHECKPOINT_FIX = "use another checkpoint (an earlier round's, or another node's state folder)"


class SourceError(MurmurError):
    """The path is not something a model can be read from."""


@dataclass(slots=True)
class Source:
    path: Path | str  # a file or folder, or where a live run's state came from
    kind: str  # "node checkpoint", "train checkpoint" or "export"
    model: ModelConfig
    weights: dict[str, torch.Tensor]  # murmur's parameter names
    tokenizer: str  # "byte" or "gpt2"
    run_config: dict[str, Any] | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def check_finite(self) -> None:
        """Refuse weights that hold NaN or Inf (a corrupted file that still parses, a run that
        diverged): they would evaluate to a NaN loss and sample from NaN probabilities."""
        for name, t in self.weights.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise SourceError(
                    f"{self.path}: the weight {name} holds {bad:,} NaN or Inf values: the model is broken; "
                    "export it again from a good checkpoint (or use an earlier one)"
                )

    def build_model(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Transformer:
        """murmur's own model with these weights, in eval mode."""
        model = Transformer(self.model)
        try:
            model.load_state_dict({k: v.float() for k, v in self.weights.items()}, strict=True)
        except RuntimeError as err:
            first = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
            raise SourceError(f"{self.path}: the weights do not fit the model's shape ({first})") from None
        return model.to(device=device, dtype=dtype).eval()


def load_source(path: str | Path) -> Source:
    p = Path(path)
    if not p.exists():
        raise SourceError(f"{p} does not exist: give a checkpoint file, a run folder or an export folder")
    if p.is_file():
        return _from_checkpoint(p)
    if (p / PROVENANCE).is_file():
        return _from_export(p)
    if (p / CHECKPOINT).is_file():
        return _from_checkpoint(p / CHECKPOINT)
    node = _newest_testnet_node(p)
    if node is not None:
        source = _from_checkpoint(node / CHECKPOINT)
        _count_every_nodes_tokens(source, sorted(d for d in (p / "nodes").glob("node-*") if d.is_dir()))
        return source
    raise SourceError(
        f"{p} is not a murmur export ({PROVENANCE}), a run or state folder ({CHECKPOINT}) "
        "or a testnet folder (nodes/node-*/checkpoint.pt)"
    )


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _read_checkpoint(path: Path) -> dict[str, Any]:
    from murmur.node.daemon import checkpoint_file
    from murmur.protocol.integrity import IntegrityError

    try:
        checked = checkpoint_file.verify(path, fix=CHECKPOINT_FIX)
        state = checkpoint_file.load(path, verified=True)
    except IntegrityError as err:
        raise SourceError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - a truncated, corrupt or foreign file is the same user error
        reason = (str(err).splitlines() or [""])[0][:120]
        raise SourceError(
            f"{path} is not a readable murmur checkpoint ({type(err).__name__}{': ' + reason if reason else ''})"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or "config" not in state:
        raise SourceError(f"{path} is readable but not a murmur checkpoint (no model and run config in it)")
    if not checked:
        print(f"warning: {path} was written before checkpoints carried a checksum: it is read unchecked",
              file=sys.stderr)
    return state


def _from_checkpoint(path: Path) -> Source:
    from murmur.node.train.build import resolve_model_config
    from murmur.protocol.runconfig import config_from_dict

    state = _read_checkpoint(path)
    try:
        cfg = config_from_dict(state["config"])
    except MurmurError as err:
        raise SourceError(f"{path}: the run config inside the checkpoint is not valid ({err})") from None
    weights = {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    if "embed.weight" not in weights:
        raise SourceError(f"{path} holds no model weights murmur knows (no embed.weight)")
    mcfg = resolve_model_config(cfg, int(weights["embed.weight"].shape[0]))
    prov: dict[str, Any] = {"source": str(path), "run_name": cfg.name}
    if "shared" in state:
        kind = "node checkpoint"
        weights, prov_node = _global_weights(state, path.parent)
        prov.update(prov_node)
    else:
        kind = "train checkpoint"
        steps = int(state.get("step", 0))
        prov.update(
            run_id=None,
            round=None,
            inner_steps=steps,
            state_hash=_hash(weights),
            tokens_trained=steps * cfg.train.batch_size * mcfg.seq_len,
            tokens_note="murmur train: steps x batch_size x seq_len",
        )
    return Source(path, kind, mcfg, weights, cfg.data.tokenizer, state["config"], prov)


def _hash(weights: dict[str, torch.Tensor]) -> str:
    """The state hash nodes publish (node/daemon/shared_state.py's global_hash): sha256 over the
    `param/`-named parameters in model order."""
    from murmur.protocol.wire import tensors_hash

    return tensors_hash((f"param/{n}", t) for n, t in weights.items()).hex()


def _global_weights(state: dict[str, Any], folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from murmur.node.daemon.shared_state import GLOBAL_PREFIXES
    from murmur.protocol.wire import tensors_hash

    shared = state["shared"]
    tensors: dict[str, torch.Tensor] = shared["tensors"]
    weights = dict(state["model"])
    for name, t in tensors.items():
        prefix = next((p for p in GLOBAL_PREFIXES if name.startswith(p)), None)
        if prefix is not None and name[len(prefix):] in weights:
            weights[name[len(prefix):]] = t
    rnd = int(shared["round"])
    digest = tensors_hash((n, t) for n, t in tensors.items() if n.startswith(GLOBAL_PREFIXES)).hex()
    prov: dict[str, Any] = {"run_id": _run_id(folder), "round": rnd, "inner_steps": int(shared["step"]),
                            "state_hash": digest}
    prov.update(_node_tokens(folder, rnd))
    return weights, prov


def _run_id(folder: Path) -> str | None:
    """join.json's run id while the node is a member; after a clean leave (which drops join.json),
    the one its round log recorded."""
    from murmur.node.daemon.state_dir import read_rounds

    try:
        return str(json.loads((folder / "join.json").read_text())["run_id"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        pass
    return next((str(r["run"]) for r in reversed(read_rounds(folder)) if r.get("run")), None)


def _tokens_by_round(folder: Path) -> dict[int, int]:
    """Tokens a node put into the global model per round, from its round log: the last record of a
    round (a restarted node may log one twice), and none where the round completed without its
    update (it caught up from peers instead)."""
    from murmur.node.daemon.state_dir import read_rounds

    by_round = {}
    for r in read_rounds(folder):
        if "tokens" in r:
            by_round[int(r["round"])] = int(r["tokens"]) if r.get("contributed", True) else 0
    return by_round


def _node_tokens(folder: Path, upto_round: int) -> dict[str, Any]:
    """Tokens this node trained up to the checkpoint's round. Its peers trained others into the same
    global model; a node does not know how many, so this is a lower bound."""
    by_round = _tokens_by_round(folder)
    if not by_round:
        return {"tokens_trained": None, "tokens_note": "no round log beside the checkpoint"}
    return {
        "tokens_trained": sum(t for r, t in by_round.items() if r <= upto_round),
        "tokens_note": "this node's own tokens (rounds.jsonl); its peers' add to the global model",
    }


def _count_every_nodes_tokens(source: Source, nodes: list[Path]) -> None:
    """A testnet folder holds every node's round log: the run's tokens up to the exported round."""
    upto = source.provenance.get("round")
    if upto is None:
        return
    total = sum(t for d in nodes for r, t in _tokens_by_round(d).items() if r <= upto)
    source.provenance["tokens_trained"] = total
    source.provenance["tokens_note"] = f"all {len(nodes)} nodes' tokens up to round {upto} (their rounds.jsonl)"


def _newest_testnet_node(root: Path) -> Path | None:
    from murmur.node.daemon.state_dir import read_rounds

    nodes = sorted(d for d in (root / "nodes").glob("node-*") if (d / CHECKPOINT).is_file())
    if not nodes:
        return None

    def last_round(d: Path) -> int:
        return max((int(r.get("round", -1)) for r in read_rounds(d)), default=-1)

    return max(nodes, key=last_round)  # max keeps the first of equals: node-0 before node-1


# ---------------------------------------------------------------------------------------------
# Export folders (written by node/export/write.py)


def _check_weights_file(folder: Path, prov: dict[str, Any]) -> None:
    """model.safetensors against the sha256 its provenance.json recorded (a streaming hash). An
    export from before checksums has none: read unchecked, with a warning line (stderr)."""
    from murmur.protocol.integrity import check_digest

    weights = folder / "model.safetensors"
    expected = prov.get("weights_sha256")
    if not expected:
        print(f"warning: {folder} was exported before exports carried a checksum: its weights are read unchecked "
              "(export it again to add one)", file=sys.stderr)
        return
    if not weights.is_file():
        raise SourceError(f"{folder} has no model.safetensors: export it again (murmur export)")
    check_digest(weights, str(expected), what="the export's weights", fix="export it again (murmur export)")


def _from_export(folder: Path) -> Source:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from murmur.node.export.llama_format import from_llama_name, model_config_from_llama

    try:
        prov = json.loads((folder / PROVENANCE).read_text())
        if prov.get("format") != EXPORT_FORMAT:
            raise ValueError(f"format {prov.get('format')!r}, expected {EXPORT_FORMAT!r}")
        mcfg = model_config_from_llama(json.loads((folder / "config.json").read_text()))
        _check_weights_file(folder, prov)
        weights = {from_llama_name(k): v for k, v in load_file(folder / "model.safetensors").items()}
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as err:
        raise SourceError(f"{folder} is not a readable murmur export ({type(err).__name__}: {err})") from None
    return Source(folder, "export", mcfg, weights, prov.get("tokenizer", "byte"), prov.get("run_config"), prov)
