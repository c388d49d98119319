"""The activation codecs on their own (node/pipeline/codec.py): what a hop sends is byte for byte
the message the general wire conversion (protocol/wire.py) builds, it decodes back to the tensor,
and every malformed message is refused with one WireError naming the reason."""

from __future__ import annotations

import math

import pytest
import torch

from murmur import kernels
from murmur.node.pipeline import codec
from murmur.optim.wire import WireTensor
from murmur.protocol import pipeline_pb2, tensor_pb2
from murmur.protocol.wire import WireError, wire_to_proto

pytestmark = pytest.mark.unit

SHAPE = (4, 16, 32)
TOKENS = (4, 16)


def reference(t: torch.Tensor, name: str) -> tensor_pb2.WireTensor:
    """The message as the general conversion builds it (how every codec was encoded before)."""
    shape = tuple(t.shape)
    if name == "tokens":
        return wire_to_proto(WireTensor("tokens", shape, "int64", {"values": t.to(torch.int64).reshape(-1)}))
    if name == "int8":
        q, scales, _ = kernels.quantize_blockwise(t.float().reshape(-1), 8, codec.INT8_BLOCK)
        return wire_to_proto(WireTensor("int8", shape, "float32", {"values": q, "scales": scales},
                                        {"block": codec.INT8_BLOCK}))
    dtype = torch.float32 if name == "fp32" else torch.bfloat16
    return wire_to_proto(WireTensor(name, shape, "float32", {"values": t.to(dtype).reshape(-1)}))


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "tokens"])
def test_encoded_in_place_is_the_general_conversions_message_and_decodes_back(name):
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 256, TOKENS, generator=g) if name == "tokens" else torch.randn(SHAPE, generator=g)
    want = reference(t, name).SerializeToString()
    assert codec.encode(t, name).SerializeToString() == want
    request = pipeline_pb2.ForwardRequest(run_id="r", microbatch="mb0.1")
    codec.encode_into(request.inputs, t, name)  # the field of the request itself
    assert request.inputs.SerializeToString() == want
    back = codec.decode(request.inputs, shape=tuple(t.shape), what="inputs")
    if name == "tokens":
        assert back.dtype == torch.int64 and torch.equal(back, t)
    else:
        assert back.dtype == torch.float32 and back.shape == t.shape
        tol = {"fp32": 0.0, "bf16": 1e-2, "int8": 3e-2}[name]
        assert (back - t).abs().max().item() <= tol * t.abs().max().item()
        back.add_(1.0)  # a decoded tensor is the receiver's own (writable, not the message's bytes)


def test_an_encoding_asked_of_an_unknown_codec_leaves_the_message_empty():
    request = pipeline_pb2.ForwardRequest()
    with pytest.raises(WireError, match="unknown activation codec 'fp8'"):
        codec.encode_into(request.inputs, torch.zeros(SHAPE), "fp8")
    assert not request.HasField("inputs")


def malformed() -> dict[str, tuple[tensor_pb2.WireTensor, tuple[int, ...], str]]:
    x = torch.randn(SHAPE)

    def good(name: str = "bf16") -> tensor_pb2.WireTensor:
        return codec.encode(torch.randint(0, 9, TOKENS) if name == "tokens" else x, name)

    cases: dict[str, tuple[tensor_pb2.WireTensor, tuple[int, ...], str]] = {}
    cases["missing"] = (tensor_pb2.WireTensor(), SHAPE, "missing")
    m = good()
    m.shape[:] = [4, 16, 33]
    cases["another shape"] = (m, SHAPE, "expected [4, 16, 32]")
    m = good()
    m.codec = "fp8"
    cases["unknown codec"] = (m, SHAPE, "unknown codec 'fp8'")
    m = good()
    m.dtype = "complex64"
    cases["unknown dtype"] = (m, SHAPE, "unknown tensor dtype")
    m = good()
    m.parts.add().CopyFrom(m.parts[0])
    cases["a part twice"] = (m, SHAPE, "do not match codec")
    m = good()
    m.parts.add(name="scales", dtype="float32", shape=[1], data=b"\0" * 4)
    cases["a part its codec does not send"] = (m, SHAPE, "do not match codec")
    m = good()
    m.parts[0].dtype = "float16"
    cases["values of another dtype"] = (m, SHAPE, f"needs {math.prod(SHAPE)} torch.bfloat16 values")
    m = good()
    m.parts[0].data = m.parts[0].data[:-2]
    cases["bytes short of the shape"] = (m, SHAPE, "bytes")
    m = good()
    m.parts[0].shape[:] = [-1, -math.prod(SHAPE)]
    cases["a negative part shape"] = (m, SHAPE, "values")
    m = codec.encode(x.clone().index_fill_(0, torch.tensor([2]), float("nan")), "fp32")
    cases["NaN"] = (m, SHAPE, "NaN or Inf")
    m = codec.encode(x.clone().index_fill_(0, torch.tensor([3]), float("inf")), "bf16")
    cases["Inf"] = (m, SHAPE, "NaN or Inf")
    m = good("tokens")
    m.parts[0].dtype = "int32"
    m.parts[0].data = m.parts[0].data[: len(m.parts[0].data) // 2]
    cases["token ids of another dtype"] = (m, TOKENS, "int64 values")
    m = good("int8")
    m.meta[0].int_value = 0
    cases["an int8 block of 0"] = (m, SHAPE, "block")
    m = good("int8")
    m.meta.add(name="x", float_value=float("inf"))
    cases["an infinite meta value"] = (m, SHAPE, "not finite")
    m = good("int8")
    m.parts[1].shape[:] = [3]
    m.parts[1].data = m.parts[1].data[:12]
    cases["too few int8 scales"] = (m, SHAPE, "fp32 scales")
    m = good()
    for i in range(20):
        m.meta.add(name=f"m{i}", int_value=i)
    cases["too many meta entries"] = (m, SHAPE, "at most")
    return cases


@pytest.mark.parametrize("read", [codec.decode, codec.check])
@pytest.mark.parametrize("case", sorted(malformed()))
def test_a_malformed_message_is_refused_with_its_reason(case, read):
    msg, shape, words = malformed()[case]
    with pytest.raises(WireError) as err:
        read(msg, shape=shape, what="inputs")
    text = str(err.value)
    assert text.startswith("inputs: ") and words in text and "\n" not in text, (case, text)


@pytest.mark.parametrize("name", ["fp32", "bf16", "tokens"])
def test_a_tensor_in_any_layout_encodes_to_the_same_message(name):
    """Non-contiguous, requiring grad, or already of the codec's dtype: one message for one value."""
    g = torch.Generator().manual_seed(1)
    if name == "tokens":
        base = torch.randint(0, 256, TOKENS[::-1], generator=g)
        variants = [base.t(), base.t().contiguous(), base.t().to(torch.int32)]
    else:
        base = torch.randn(SHAPE[::-1], generator=g)
        t = base.permute(2, 1, 0)
        variants = [t, t.contiguous().requires_grad_(True), t.to(torch.bfloat16) if name == "bf16" else t.double()]
    want = reference(variants[1].detach(), name).SerializeToString()
    for v in variants:
        assert codec.encode(v, name).SerializeToString() == want


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "tokens"])
def test_a_checked_message_handed_on_is_what_decoding_and_encoding_it_again_sends(name):
    """What a driver does with a stage's outputs (node/pipeline/driver.py): ``check`` passes the
    message itself, and the next request copies it. For every codec but int8 that is byte for byte
    the old way (decode to fp32, encode again); for int8 it is the sender's own quantization,
    which decodes to the same values."""
    g = torch.Generator().manual_seed(2)
    t = torch.randint(0, 256, TOKENS, generator=g) if name == "tokens" else torch.randn(SHAPE, generator=g)
    reply = pipeline_pb2.ForwardReply()
    codec.encode_into(reply.outputs, t, name)
    shape = tuple(t.shape)
    assert codec.check(reply.outputs, shape=shape, what="outputs") is reply.outputs
    handed_on, reencoded = pipeline_pb2.BackwardRequest(), pipeline_pb2.BackwardRequest()
    handed_on.inputs.CopyFrom(reply.outputs)
    codec.encode_into(reencoded.inputs, codec.decode(reply.outputs, shape=shape, what="outputs"), name)
    if name != "int8":
        assert handed_on.SerializeToString() == reencoded.SerializeToString()
    assert torch.equal(codec.decode(handed_on.inputs, shape=shape, what="inputs"),
                       codec.decode(reply.outputs, shape=shape, what="outputs"))
