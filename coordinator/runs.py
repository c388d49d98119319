"""Runs and join tokens: what the operator creates. Validation happens here, before the ledger is touched."""

from __future__ import annotations

import functools
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from murmur.errors import MurmurError
from murmur.protocol.jointoken import JoinToken, secret_hash
from murmur.protocol.model_shape import ddp_bytes, model_config
from murmur.protocol.runconfig import ConfigError, parse_config

from .settings import CoordinatorSettings
from .store import Store

RUN_STATES = ("active", "paused", "finished")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class RunError(MurmurError):
    code = "INVALID_ARGUMENT"


class NotFound(RunError):
    code = "NOT_FOUND"


class Conflict(RunError):
    code = "ALREADY_EXISTS"


LEDGER_INT_MAX = 2**63 - 1  # SQLite's INTEGER; offsets and token sums must fit


def parse_manifest(text: str) -> list[tuple[int, str, int]]:
    """The shards of a dataset manifest (`murmur data prepare` writes it) as (id, name, tokens)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise RunError(
            f"the dataset manifest is not valid JSON ({err}); pass the manifest.json that `murmur data prepare` wrote"
        ) from None
    shards = data.get("shards") if isinstance(data, dict) else None
    if not isinstance(shards, list) or not shards:
        raise RunError(
            "the dataset manifest has no 'shards' list; pass the manifest.json that `murmur data prepare` wrote"
        )
    out: list[tuple[int, str, int]] = []
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict):
            raise RunError(f"manifest shard #{i} must be an object with 'tokens'")
        sid, tokens = shard.get("id", i), shard.get("tokens")
        name = shard.get("file", shard.get("name", f"shard_{i}"))
        if isinstance(sid, bool) or not isinstance(sid, int) or sid < 0:
            raise RunError(f"manifest shard #{i}: 'id' must be a non-negative integer, got {sid!r}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise RunError(f"manifest shard #{i}: 'tokens' must be a non-negative integer, got {tokens!r}")
        if sid > LEDGER_INT_MAX or tokens > LEDGER_INT_MAX:
            raise RunError(f"manifest shard #{i}: 'id' and 'tokens' must be at most 2^63 - 1 (the ledger's integers)")
        if not isinstance(name, str):
            raise RunError(f"manifest shard #{i}: 'file' must be a string")
        out.append((sid, name, tokens))
    if sum(s[2] for s in out) > LEDGER_INT_MAX:
        raise RunError("the dataset manifest's tokens add up to more than 2^63 - 1 (the ledger's integers)")
    if len({s[0] for s in out}) != len(out):
        raise RunError("the dataset manifest repeats a shard id")
    return out


@dataclass(slots=True)
class NewToken:
    token: str
    token_id: str


class Runs:
    def __init__(
        self,
        store: Store,
        settings: CoordinatorSettings,
        ca_fingerprint: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.settings = settings
        self.ca_fingerprint = ca_fingerprint
        self.clock = clock

    def create(self, config_toml: str, manifest_json: str, run_id: str = "") -> str:
        if len(config_toml.encode()) > self.settings.max_config_bytes:
            raise RunError(f"the run config is larger than {self.settings.max_config_bytes} bytes")
        try:
            cfg = parse_config(config_toml, "the run config")
        except ConfigError as err:
            raise RunError(str(err)) from None
        shards = parse_manifest(manifest_json)
        if len(shards) > self.settings.max_shards:
            raise RunError(f"the manifest has {len(shards)} shards, more than max_shards={self.settings.max_shards}")
        run_id = run_id or cfg.name
        if not _RUN_ID_RE.match(run_id):
            raise RunError(f"run id {run_id!r} must be 1-64 letters, digits, '.', '_' or '-'")
        now = self.clock()
        with self.store.write():
            if self.store.run(run_id) is not None:
                raise Conflict(f"run {run_id} already exists; pick another --run-id or name")
            self.store.insert_run(run_id, cfg.name, config_toml, manifest_json, shards, now)
            self.store.event("run_created", run_id=run_id, at=now, shards=len(shards), tokens=sum(s[2] for s in shards))
        return run_id

    def get(self, run_id: str) -> Any:
        row = self.store.run(run_id)
        if row is None:
            raise NotFound(f"no run {run_id!r}; `murmur admin runs list` shows the runs")
        return row

    def set_state(self, run_id: str, state: str) -> None:
        if state not in RUN_STATES:
            raise RunError(f"run state must be one of {', '.join(RUN_STATES)}, got {state!r}")
        row = self.get(run_id)
        if row["state"] == "finished" and state != "finished":
            raise RunError(f"run {run_id} is finished and cannot be resumed")
        with self.store.write():
            self.store.set_run_state(run_id, state)
            self.store.event("run_" + state, run_id=run_id, previous=row["state"])

    def create_token(self, run_id: str, ttl_s: float, uses: int, note: str) -> NewToken:
        self.get(run_id)
        ttl_s = ttl_s or self.settings.token_ttl_s
        uses = uses or self.settings.token_uses
        if ttl_s <= 0 or uses <= 0:
            raise RunError("a token needs a positive --ttl and --uses")
        token = JoinToken(secrets.token_hex(6), secrets.token_urlsafe(24), self.ca_fingerprint)
        now = self.clock()
        with self.store.write():
            self.store.insert_token(
                token.token_id, run_id, secret_hash(token.secret), now, now + ttl_s, uses, note[:200]
            )
            self.store.event("token_created", run_id=run_id, at=now, token=token.token_id, uses=uses, ttl_s=ttl_s)
        return NewToken(str(token), token.token_id)

    def revoke_token(self, token_id: str) -> None:
        row = self.store.token(token_id)
        if row is None:
            raise NotFound(f"no token {token_id!r}; `murmur admin tokens list` shows the ids")
        with self.store.write():
            self.store.revoke_token(token_id)
            self.store.event("token_revoked", run_id=row["run_id"], token=token_id)


@functools.lru_cache(maxsize=32)  # a run's TOML never changes; the status page asks every few seconds
def sync_of(config_toml: str) -> dict[str, Any]:
    """The run's algorithm, codec and H as its TOML says (the defaults of protocol/runconfig.py otherwise)."""
    try:
        sync = parse_config(config_toml, "the run configuration").sync
        return {"algorithm": sync.algorithm, "codec": sync.codec, "inner_steps": sync.inner_steps}
    except MurmurError:  # a stored config parsed when the run was created; only a newer schema fails
        return {"algorithm": "?", "codec": "?", "inner_steps": 0}


@functools.lru_cache(maxsize=32)
def shape_of(config_toml: str) -> dict[str, int]:
    """The run's parameter count and tokens per worker-step (batch x sequence), as its TOML says;
    zeros for a config this coordinator cannot read."""
    try:
        cfg = parse_config(config_toml, "the run configuration")
        m = cfg.model
        shape = model_config(
            m.preset, dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
            hidden_dim=m.hidden_dim, vocab_size=m.vocab_size, seq_len=m.seq_len, tie_embeddings=cfg.embeddings_tied(),
        )
    except (MurmurError, ValueError):
        return {"n_params": 0, "tokens_per_step": 0}
    return {"n_params": shape.num_params(), "tokens_per_step": cfg.train.batch_size * shape.seq_len}


def ddp_equivalent_bytes(shape: dict[str, int], tokens: int, workers: int) -> int:
    """What DDP would have sent, over all workers, to train ``tokens`` with ``workers`` of them at
    this batch: every worker-step a ring all-reduce of fp32 gradients (protocol/model_shape.py)."""
    if not shape["tokens_per_step"] or workers < 2:
        return 0
    return ddp_bytes(shape["n_params"], workers, tokens // shape["tokens_per_step"])
