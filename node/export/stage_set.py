"""A pipelined run's model, assembled from its stage peers' checkpoints into one `Source`.

`murmur export` is given the stage peers' state folders (or a testnet folder whose stage peers
kept theirs under ``nodes/peer-*/``). Each folder holds versions of one or more stages
(node/pipeline/stage_checkpoint.py); the model is the newest *complete set*: the newest version
that some folder holds for every stage, all of one run and one cut. Stage-mates can hold different
states of the same version (they sync only every ``pipeline.sync_every_samples``); the state most folders
hold is taken (a tie: the smallest hash), as the coordinator names it (coordinator/stage_board.py).

The pipeline unties the embedding and the output head when it has more than one stage
(docs/pipeline.md), so such a model is exported with ``tie_word_embeddings: false``: its
``ModelConfig`` says so, and node/export/llama_format.py writes it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from murmur.node.export.source import Source, SourceError, load_source
from murmur.node.model.transformer import ModelConfig
from murmur.node.pipeline import stage_checkpoint
from murmur.protocol.wire import tensors_hash


def load_sources(paths: list[str | Path]) -> Source:
    """`murmur export`'s SOURCEs as one source: one path as `load_source` reads it, or a pipelined
    run's model from stage peers' folders (one folder of them, or several)."""
    ps = [Path(p) for p in paths]
    for p in ps:
        if not p.exists():
            raise SourceError(f"{p} does not exist: give a checkpoint file, a run folder or an export folder")
    if len(ps) == 1 and not (ps[0].is_dir() and holds_stages(ps[0])):
        return load_source(ps[0])
    bad = next((p for p in ps if not (p.is_dir() and holds_stages(p))), None)
    if bad is not None:
        raise SourceError(f"{bad} holds no stage checkpoints: several SOURCEs must all be stage peers' folders")
    return load_stage_set(ps)


def holds_stages(path: Path) -> bool:
    """A stage peer's state folder, or a folder of them (a testnet's)."""
    return bool(_folders(Path(path)))


def _folders(path: Path) -> list[Path]:
    if stage_checkpoint.listed(path):
        return [path]
    found = []
    for pattern in ("*", "nodes/*", "stages/*"):
        found += [d for d in sorted(path.glob(pattern)) if d.is_dir() and stage_checkpoint.listed(d)]
    return found


def load_stage_set(paths: list[Path]) -> Source:
    folders = [f for p in paths for f in _folders(Path(p))]
    if not folders:
        raise SourceError(f"no stage checkpoints ({stage_checkpoint.FOLDER}/) in {', '.join(map(str, paths))}")
    files = [c for f in folders for c in stage_checkpoint.listed(f)]
    cuts = {c.stages for c in files}
    if len(cuts) > 1:
        raise SourceError(f"the folders hold checkpoints of pipelines of {sorted(cuts)} stages: give one run's")
    (stages,) = cuts
    by_version: dict[int, dict[int, list[stage_checkpoint.CheckpointFile]]] = {}
    for c in files:
        by_version.setdefault(c.version, {}).setdefault(c.stage, []).append(c)
    complete = [v for v, got in by_version.items() if len(got) == stages]
    if not complete:
        have = sorted({c.stage for c in files})
        raise SourceError(f"no version of all {stages} stages in these folders (stages found: {have}); "
                          "give every stage's peer folder")
    version = max(complete)
    chosen = [_pick(by_version[version][s]) for s in range(stages)]
    weights: dict = {}
    run_ids, model, config, tokens = set(), None, None, []
    stage_rows = []
    for s, (state, holders) in enumerate(chosen):
        run_ids.add(state["run_id"])
        model = model or state["model"]
        config = config or state.get("config")
        tokens.append(int(state.get("tokens_committed", 0)))
        weights.update(state["params"])
        stage_rows.append({"stage": s, "state_hash": state["state_hash"], "holders": holders})
    if len(run_ids) > 1:
        raise SourceError(f"version {version}'s stages come from different runs ({sorted(run_ids)})")
    mcfg = ModelConfig(**model)
    tokenizer = ((config or {}).get("data") or {}).get("tokenizer", "byte")
    order = model_order(mcfg)
    missing = [n for n in order if n not in weights]
    if missing:
        raise SourceError(f"the stages of version {version} do not hold {missing[:3]}: another layer split?")
    weights = {n: weights[n] for n in order}
    prov = {
        "source": ", ".join(str(p) for p in paths), "run_name": (config or {}).get("name"), "run_id": run_ids.pop(),
        "round": version, "inner_steps": None, "state_hash": tensors_hash(weights.items()).hex(),
        "stages": stage_rows, "tokens_trained": min(tokens),
        "tokens_note": "the ledger's total the stage peers had heard of at the checkpoint (the least of the stages')",
    }
    return Source(", ".join(str(p) for p in paths), "pipeline stages", mcfg, weights, tokenizer, config, prov)


def _pick(candidates: list[stage_checkpoint.CheckpointFile]) -> tuple[dict, list[str]]:
    """The state most holders of one stage and version agree on, and where it was read from."""
    states = []
    for c in candidates:
        try:
            states.append((c, stage_checkpoint.read(c.path)))
        except ValueError as err:
            raise SourceError(str(err)) from None
    count = Counter(st["state_hash"] for _, st in states)
    best = min(count, key=lambda h: (-count[h], h))
    holders = [str(c.path.parent.parent) for c, st in states if st["state_hash"] == best]
    return next(st for _, st in states if st["state_hash"] == best), holders


def model_order(cfg: ModelConfig) -> list[str]:
    """Parameter names of the whole model, in its own order (what `Transformer.state_dict` lists)."""
    import torch

    from murmur.node.model.transformer import Transformer

    with torch.device("meta"):
        return list(Transformer(cfg).state_dict())
