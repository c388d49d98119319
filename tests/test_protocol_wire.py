"""The wire contract: stubs match their sources, WireTensor <-> protobuf, refusals by reason."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from _net_helpers import REPO

from murmur.optim.codecs import make_codec
from murmur.protocol import generate, tensor_pb2
from murmur.protocol.version import PROTOCOL_VERSION, VersionMismatch, check_version
from murmur.protocol.wire import (
    WireError,
    WireLimits,
    all_finite,
    check_finite,
    layout_hash,
    tensors_hash,
    wire_from_proto,
    wire_to_proto,
)


def test_committed_stubs_match_the_proto_sources():
    proc = subprocess.run(
        [sys.executable, "-m", "murmur.protocol.generate", "--check"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr


def test_check_names_the_drifted_stub_and_generation_fixes_it(tmp_path):
    for f in (REPO / "protocol").glob("*.proto"):
        shutil.copy(f, tmp_path)
    assert generate.write(tmp_path)  # fresh folder: everything is written
    assert generate.check(tmp_path) == []
    src = tmp_path / "tensor.proto"
    src.write_text(src.read_text().replace("string codec = 1;", "string codec_name = 1;"))
    problems = generate.check(tmp_path)
    assert any(p.startswith("tensor_pb2.py") for p in problems)
    assert generate.main(["--check", "--proto-dir", str(tmp_path)]) == 1
    generate.write(tmp_path)
    assert generate.check(tmp_path) == []
    (tmp_path / "gone_pb2.py").write_text("")
    assert any("no .proto source" in p for p in generate.check(tmp_path))


@pytest.mark.parametrize("codec", ["fp32", "fp16", "bf16", "int8", "int4", "topk", "sign", "powersgd"])
def test_every_codec_round_trips_through_the_protobuf_message(codec):
    c = make_codec(codec)
    x = torch.randn(33, 70)
    w = c.encode_stateless(x, "k")
    raw = wire_to_proto(w).SerializeToString()
    back = wire_from_proto(tensor_pb2.WireTensor.FromString(raw))
    assert (back.codec, back.shape, back.dtype, back.meta) == (w.codec, w.shape, w.dtype, w.meta)
    assert torch.equal(c.decode(back), c.decode(w))
    assert back.nbytes == w.nbytes


def _msg(**over):
    w = make_codec("int8").encode_stateless(torch.randn(256), "k")
    msg = wire_to_proto(w)
    for k, v in over.items():
        setattr(msg, k, v) if not callable(v) else v(msg)
    return msg


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda m: setattr(m.parts[0], "dtype", "complex128"), "unknown dtype"),
        (lambda m: setattr(m.parts[0], "data", m.parts[0].data[:-1]), "bytes for shape"),
        (lambda m: m.parts[0].shape.__setitem__(0, -4), "negative dimension"),
        (lambda m: m.parts.append(m.parts[0]), "appears twice"),
        (lambda m: setattr(m, "dtype", "float128"), "unknown tensor dtype"),
        (lambda m: m.shape.extend([1 << 20, 1 << 20]), "elements"),
    ],
)
def test_malformed_messages_are_refused_with_a_reason(mutate, reason):
    msg = _msg()
    mutate(msg)
    with pytest.raises(WireError, match=reason):
        wire_from_proto(msg, WireLimits(max_numel=1 << 30))


def test_nan_in_a_part_is_refused_before_decoding():
    w = make_codec("int8").encode_stateless(torch.randn(256), "k")
    w.parts["scales"][0] = float("inf")
    with pytest.raises(WireError, match="NaN or Inf"):
        check_finite(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_finds_one_bad_value_anywhere(dtype):
    # min/max instead of isfinite().all(): a NaN or an infinity at any position, in the vectorized
    # body or the tail, must still be found; huge finite values and empty tensors pass.
    n = 1000
    assert all_finite(torch.randn(n).to(dtype))
    assert all_finite(torch.empty(0, dtype=dtype))
    assert all_finite(torch.full((7,), torch.finfo(dtype).max, dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for pos in (0, 1, 31, 32, 500, n - 2, n - 1):
            t = torch.randn(n).to(dtype)
            t[pos] = bad
            assert not all_finite(t), (bad, pos)
            assert not all_finite(t.reshape(10, 100))


def test_hashes_depend_on_names_shapes_and_bytes():
    a = [("w", torch.ones(2, 3))]
    assert tensors_hash(a) == tensors_hash([("w", torch.ones(2, 3))])
    assert tensors_hash(a) != tensors_hash([("v", torch.ones(2, 3))])
    assert tensors_hash(a) != tensors_hash([("w", torch.ones(3, 2))])
    assert tensors_hash([("s", torch.tensor(3))]) != tensors_hash([("s", torch.tensor(4))])
    assert layout_hash("int8", [((2, 3), torch.float32)]) != layout_hash("int4", [((2, 3), torch.float32)])


def test_version_mismatch_names_both_versions():
    check_version(str(PROTOCOL_VERSION))
    with pytest.raises(
        VersionMismatch, match=f"speaks v{PROTOCOL_VERSION}, the peer speaks v{PROTOCOL_VERSION + 1}"
    ):
        check_version(PROTOCOL_VERSION + 1)
    with pytest.raises(VersionMismatch, match="no version"):
        check_version(None)
