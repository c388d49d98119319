"""The algorithm options of issue 18, each by its behaviour: the inner-lr rule for K workers,
Streaming DiLoCo's strided fragments, DeMo's fp32 or bf16 coefficient values, SparseLoCo-style
top-k with 2-bit values and decaying error feedback, and the final sync of a run that ends
between syncs."""

from __future__ import annotations

import pytest
import torch
from _optim_helpers import flat_params, make_workers, run_workers, tiny_config

from murmur.optim.codecs import make_codec
from murmur.optim.demo import DCTTopKCodec
from murmur.optim.diloco import fragment_groups, strided_fragments
from murmur.optim.inner import inner_lr_for
from murmur.protocol.runconfig import ConfigError, config_from_dict


def test_inner_lr_scale_sqrt_k_scales_the_local_step_algorithms_only():
    def sync(**kw):
        return config_from_dict({"sync": kw}).sync

    assert inner_lr_for(1e-3, sync(inner_lr_scale="sqrt_k"), 4) == pytest.approx(2e-3)
    assert inner_lr_for(1e-3, sync(algorithm="streaming", inner_lr_scale="sqrt_k"), 9) == pytest.approx(3e-3)
    assert inner_lr_for(1e-3, sync(inner_lr_scale="sqrt_k"), 1) == 1e-3
    assert inner_lr_for(1e-3, sync(), 4) == 1e-3  # the default keeps optim.lr
    # DDP and DeMo step one model on the whole batch: their lr is the single model's.
    assert inner_lr_for(1e-3, sync(algorithm="ddp", inner_lr_scale="sqrt_k"), 4) == 1e-3
    assert inner_lr_for(1e-3, sync(algorithm="demo", inner_lr_scale="sqrt_k"), 4) == 1e-3


@pytest.mark.parametrize("key,value", [("inner_lr_scale", "cube"), ("fragment_layout", "random"),
                                       ("demo_values", "fp8"), ("sparse_average", "chunk")])
def test_option_values_are_validated(key, value):
    with pytest.raises(ConfigError, match=f"sync.{key}"):
        config_from_dict({"sync": {key: value}})


def test_averaging_over_senders_refuses_a_robust_aggregator_in_one_line():
    with pytest.raises(ConfigError, match='sync.sparse_average.*"mean" only.*"trimmed_mean"') as err:
        config_from_dict({"sync": {"codec": "topk2bit", "sparse_average": "senders", "aggregator": "trimmed_mean"}})
    assert "\n" not in str(err.value)


NAMES = ["embed.weight"] + [f"blocks.{b}.{w}" for b in range(4) for w in ("attn.wq.weight", "norm.weight")] + [
    "norm.weight", "head.weight"]


def test_strided_fragments_deal_blocks_round_robin():
    groups = strided_fragments(NAMES, 2)
    # Fragment 0: the embedding, blocks 0 and 2; fragment 1: blocks 1 and 3, the final norm, the head.
    assert groups == [[0, 1, 2, 5, 6], [3, 4, 7, 8, 9, 10]]
    contiguous = fragment_groups(NAMES, [1] * len(NAMES), 2, "contiguous")
    assert contiguous != groups and sorted(i for g in contiguous for i in g) == list(range(len(NAMES)))
    assert strided_fragments(NAMES, 8) == strided_fragments(NAMES, 4)  # at most one fragment per block
    assert strided_fragments(["a", "b", "c"], 2) == [[0, 1], [2]]  # no blocks: by position


def test_streaming_strided_layout_builds_fragments_across_the_depth():
    (worker,) = make_workers(tiny_config(2, algorithm="streaming", inner_steps=2, fragments=2,
                                         fragment_layout="strided"), 1)
    names = worker.sync.names
    blocks = [{n.split(".")[1] for i in f.members if (n := names[i]).startswith("blocks.")}
              for f in worker.sync.fragments]
    assert blocks == [{"0"}, {"1"}]  # the 2-layer tiny model: block 0 | block 1


def test_demo_values_fp32_are_the_papers_coefficients_bf16_rounds_them():
    x = torch.randn(64, 64)
    exact, rounded = DCTTopKCodec(64 * 64, 64, "fp32"), DCTTopKCodec(64 * 64, 64, "bf16")
    w32, w16 = exact.encode(x, "w"), rounded.encode(x, "w")
    assert w32.parts["values"].dtype == torch.float32 and w16.parts["values"].dtype == torch.bfloat16
    assert w32.nbytes - w16.nbytes == 2 * 64 * 64  # two more bytes per value, exactly
    torch.testing.assert_close(exact.decode(w32), x, atol=1e-5, rtol=0)
    assert (rounded.decode(w16) - x).abs().max() > 1e-3


def test_demo_bf16_values_can_flip_the_sign_of_a_mean_near_zero():
    """Two members whose coefficients nearly cancel: in fp32 the mean keeps its sign, in bf16 both
    round to the same magnitude and the step direction is lost (or flipped)."""
    a, b = torch.tensor([1.0 + 2**-12]), torch.tensor([-1.0])
    assert torch.sign((a + b) / 2) == 1
    assert torch.sign((a.bfloat16().float() + b.bfloat16().float()) / 2) != 1


def test_demo_workers_send_fp32_values_by_default_and_bf16_on_request():
    sent = {}
    for values in ("fp32", "bf16"):
        workers = make_workers(tiny_config(1, algorithm="demo", demo_topk=8, demo_values=values), 2)
        run_workers(workers, 1)
        sent[values] = workers[0].sync.bytes.total_sent
    # Each coefficient: an int16 position and a 4- or 2-byte value.
    assert sent["fp32"] * 4 == sent["bf16"] * 6


def test_sparseloco_topk2bit_payload_is_exact_and_error_feedback_decays():
    """top-64 of each 4096-chunk (1.56%), 2-bit values, ef = 0.95 * ef + delta (SparseLoCo)."""
    codec = make_codec("topk2bit", topk_fraction=64 / 4096, ef_decay=0.95)
    x = torch.randn(2 * 4096)
    wire = codec.encode(x, "w")
    k = 64
    assert wire.nbytes == 2 * (2 * k + k // 4 + 2 * 2)  # per chunk: positions, 2-bit values, two bf16 levels
    res = codec.residuals["w"].clone()
    torch.testing.assert_close(res, x - codec.decode(wire))
    y = torch.randn(2 * 4096)
    wire2 = codec.encode(y, "w")
    torch.testing.assert_close(codec.residuals["w"], y + 0.95 * res - codec.decode(wire2))
    assert x.numel() * 4 / wire.nbytes > 97  # SparseLoCo's "more than 97x"


@pytest.mark.parametrize("sync", [
    {"algorithm": "diloco", "inner_steps": 3},
    {"algorithm": "streaming", "inner_steps": 4, "fragments": 2, "overlap_steps": 1},
])
def test_sync_now_ends_a_run_between_syncs_on_the_global_model(sync):
    steps = 5  # not a multiple of H: the replicas have drifted since the last sync
    workers = make_workers(tiny_config(steps, **sync), 2)
    run_workers(workers, steps)
    assert not torch.equal(flat_params(workers[0]), flat_params(workers[1]))
    rounds = workers[0].sync.bytes.rounds
    workers = make_workers(tiny_config(steps, **sync), 2)
    run_workers(workers, steps, final_sync=True)
    assert torch.equal(flat_params(workers[0]), flat_params(workers[1]))
    glob = torch.cat([g.reshape(-1) for g in workers[0].sync.eval_tensors()])
    assert torch.equal(glob, flat_params(workers[0]))
    assert all(f.last_launch == steps - 1 for f in workers[0].sync.fragments)
    assert workers[0].sync.bytes.rounds == rounds + len(workers[0].sync.fragments)


def test_sync_now_on_a_sync_step_adds_no_round():
    workers = make_workers(tiny_config(4, algorithm="diloco", inner_steps=2), 2)
    run_workers(workers, 4, final_sync=True)
    assert workers[0].sync.bytes.rounds == 2

