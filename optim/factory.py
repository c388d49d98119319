"""Build a worker's sync algorithm and codec from the run config's [sync] section."""

from __future__ import annotations

from murmur.optim.aggregate import Aggregator, aggregator_from_config
from murmur.optim.codecs import Codec, codec_from_config
from murmur.optim.demo import DeMo
from murmur.optim.diloco import DiLoCo, StreamingDiLoCo
from murmur.optim.exchange import Exchange
from murmur.optim.sync import DDP, ROUND_TIMEOUT_S, NamedParams, SyncAlgorithm

ALGORITHMS = {"ddp": DDP, "diloco": DiLoCo, "streaming": StreamingDiLoCo, "demo": DeMo}


def check_sync_config(sync) -> None:
    """Fail early, in one line, on a codec or aggregator name that does not exist."""
    codec_from_config(sync)
    aggregator_from_config(sync)


def make_codec_for(sync) -> Codec:
    return codec_from_config(sync)


def make_aggregator_for(sync) -> Aggregator:
    return aggregator_from_config(sync)


def build_sync(
    sync,
    params: NamedParams,
    exchange: Exchange,
    *,
    weight_decay: float = 0.0,
    round_timeout_s: float = ROUND_TIMEOUT_S,
) -> SyncAlgorithm:
    params = list(params)
    if sync.algorithm == "demo":
        return DeMo(params, sync, exchange, weight_decay=weight_decay, round_timeout_s=round_timeout_s)
    return ALGORITHMS[sync.algorithm](params, sync, exchange, round_timeout_s=round_timeout_s)
