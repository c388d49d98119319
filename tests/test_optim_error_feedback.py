"""Error feedback for every lossy codec of the outer delta: over many rounds the sum of what was
sent tracks the sum of the true deltas, the difference being exactly the residual kept, and that
residual stays bounded (it does not grow with the rounds); without it the drift of int4's sum
grows. sync.error_feedback switches it for any codec, and the 2-bit codec's wire is what it says."""

from __future__ import annotations

import pytest
import torch

from murmur.optim.codecs import CodecError, codec_from_config, make_codec
from murmur.protocol.runconfig import ConfigError, config_from_dict

LOSSY = ["int8", "int4", "2bit", "sign", "topk", "topk2bit", "powersgd"]
ROUNDS = 120


def deltas(seed: int = 0):
    """Pseudo-gradient-like deltas: a slowly turning direction plus noise, with an outlier column."""
    gen = torch.Generator().manual_seed(seed)
    drift = torch.randn(48, 96, generator=gen)
    for _ in range(ROUNDS):
        drift = 0.95 * drift + 0.05 * torch.randn(48, 96, generator=gen)
        d = 0.01 * (drift + torch.randn(48, 96, generator=gen))
        d[:, 7] *= 20
        yield d


def run(codec, key="u") -> tuple[list[float], torch.Tensor, float]:
    """(the norm of sum(true) - sum(decoded) after each round, that difference at the end, the
    largest delta's norm)."""
    true_sum = torch.zeros(48, 96)
    sent_sum = torch.zeros(48, 96)
    gaps, biggest = [], 0.0
    for d in deltas():
        sent_sum += codec.decode(codec.encode(d, key))
        true_sum += d
        gaps.append(float((true_sum - sent_sum).norm()))
        biggest = max(biggest, float(d.norm()))
    return gaps, true_sum - sent_sum, biggest


@pytest.mark.parametrize("name", LOSSY)
def test_the_sum_sent_tracks_the_sum_of_true_deltas(name):
    codec = make_codec(name, error_feedback=True, topk_fraction=0.1, powersgd_rank=2)
    gaps, drift, biggest = run(codec)
    # what was not sent is exactly the residual kept for the next round
    assert torch.allclose(drift, codec.residuals["u"], atol=1e-4 * biggest)
    # bounded: no larger late than early in the run, and within a few rounds' worth of update
    assert max(gaps[ROUNDS // 2:]) <= 1.5 * max(gaps[: ROUNDS // 2]) + 1e-6, gaps
    assert max(gaps) <= 20 * biggest, (max(gaps), biggest)


def test_without_error_feedback_int4s_drift_grows():
    with_ef, _, biggest = run(make_codec("int4", error_feedback=True))
    without, _, _ = run(make_codec("int4", error_feedback=False))
    assert without[-1] > 3 * with_ef[-1] and without[-1] > without[ROUNDS // 4]
    assert with_ef[-1] < 0.2 * biggest  # int4's residual is a fraction of one round's delta


def test_sync_error_feedback_switches_it_for_any_codec():
    def codec(**sync):
        return codec_from_config(config_from_dict({"sync": sync}).sync)

    assert not codec(codec="int4").error_feedback  # auto: int4 keeps its old default
    assert codec(codec="int4", error_feedback="on").error_feedback
    assert codec(codec="2bit").error_feedback and not codec(codec="2bit", error_feedback="off").error_feedback
    assert codec(codec="sign").error_feedback
    with pytest.raises(ConfigError, match="sync.error_feedback"):
        config_from_dict({"sync": {"error_feedback": "yes"}})


def test_the_2bit_codec_sends_two_bits_a_value_and_two_levels_a_block():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    codec = make_codec("2bit", block=64)
    wire = codec.encode_stateless(x)
    blocks = -(-1000 // 64)
    assert wire.parts["values"].numel() == blocks * 64 // 4 and wire.parts["scales"].shape == (blocks, 2)
    assert wire.nbytes == blocks * (64 // 4 + 2 * 2)  # 2 bits a value (whole blocks) + two bf16 a block
    y = codec.decode(wire)
    # sign kept everywhere, and better than sending nothing in every block (a Lloyd step)
    assert torch.equal(y >= 0, x >= 0)
    err = (y - x).reshape(-1)[:960].view(-1, 64).norm(dim=1)
    assert bool((err < x[:960].view(-1, 64).norm(dim=1)).all())
    # the short last block is quantized from its own values, not from the padding
    assert torch.equal(y[960:] >= 0, x[960:] >= 0) and float((y[960:] - x[960:]).norm()) < float(x[960:].norm())


def test_a_2bit_payload_of_the_wrong_size_is_refused():
    codec = make_codec("2bit", block=64)
    wire = codec.encode_stateless(torch.randn(256))
    wire.parts["scales"] = wire.parts["scales"][:2]
    with pytest.raises(CodecError, match="2bit payload"):
        codec.decode(wire)
