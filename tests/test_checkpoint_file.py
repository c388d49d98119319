"""The node's checkpoint file: what goes in comes back, tensor for tensor, bit for bit; files of the
older formats (torch.save's, murmur-checkpoint-1) still load, unchecked; a torn or overwritten file
is one clear error naming it and what to do, not a state."""

from __future__ import annotations

import pytest
import torch

from murmur.node.daemon import checkpoint_file
from murmur.node.daemon.state_dir import StateDir, StateDirError
from murmur.protocol import integrity


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    shared = torch.randn(5, 7, generator=g)
    return {
        "config": {"model": {"preset": "tiny"}, "seed": 7},
        "model": {"w": torch.randn(3, 4, generator=g).to(torch.bfloat16), "b": torch.arange(5, dtype=torch.int64)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(12.0), "exp_avg": torch.randn(9, generator=g)}},
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
        "shared": {"tensors": {"global/w": shared}, "round": 4, "fragments": [(1, shared)]},
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
        "strided": torch.arange(20.0).reshape(4, 5).t(),  # not contiguous
        "bytes": {"sent": {"a": 3}},
    }


def _equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _equal(x, y)
    else:
        assert a == b


def test_a_checkpoint_comes_back_exactly_and_a_tensor_reached_twice_is_one_tensor(tmp_path):
    state = _state()
    checkpoint_file.save(state, tmp_path / "c.pt")
    back = checkpoint_file.load(tmp_path / "c.pt")
    _equal(state, back)
    assert back["shared"]["tensors"]["global/w"] is back["shared"]["fragments"][0][1]


def test_a_checkpoint_torch_save_wrote_still_loads(tmp_path):
    state = _state()
    torch.save(state, tmp_path / "old.pt")
    _equal(state, checkpoint_file.load(tmp_path / "old.pt"))


def test_a_torn_checkpoint_is_a_clear_error_in_the_state_folder(tmp_path):
    sd = StateDir(tmp_path)
    sd.save_checkpoint(_state())
    _equal(_state(), sd.load_checkpoint())
    data = sd.checkpoint_path.read_bytes()
    sd.checkpoint_path.write_bytes(data[: len(data) - 20])  # the last tensor cut short
    with pytest.raises(StateDirError, match=r"checkpoint\.pt is truncated .*move it aside"):
        sd.verify_checkpoint()
    with pytest.raises(StateDirError, match=r"checkpoint\.pt is truncated"):
        sd.load_checkpoint()


def test_a_checkpoint_overwritten_in_place_is_refused_before_anything_is_read(tmp_path):
    """Bytes overwritten inside a tensor, the size unchanged: torch reads such a file happily (the
    issue's node trained from it); the checksum refuses it, in one line naming the file."""
    sd = StateDir(tmp_path)
    sd.save_checkpoint(_state())
    assert sd.verify_checkpoint() is True
    data = bytearray(sd.checkpoint_path.read_bytes())
    at = len(data) - 200  # inside the tensor bytes, before the trailer
    data[at : at + 8] = bytes(8) if any(data[at : at + 8]) else b"\xff" * 8
    sd.checkpoint_path.write_bytes(bytes(data))
    assert sd.checkpoint_path.stat().st_size == len(data)
    with pytest.raises(StateDirError, match=r"checkpoint\.pt is corrupt \(sha256 .* was written\): move it aside"):
        sd.verify_checkpoint()
    with pytest.raises(StateDirError, match="is corrupt"):
        sd.load_checkpoint()
    message = ""
    try:
        sd.load_checkpoint()
    except StateDirError as err:
        message = str(err)
    assert "\n" not in message and str(sd.checkpoint_path) in message


def test_a_checkpoint_of_the_format_before_checksums_loads_unchecked(tmp_path):
    """murmur-checkpoint-1 (the same layout, no trailer): read, and `verify` says it was not checked."""
    path = tmp_path / "v1.pt"
    checkpoint_file.save(_state(), path)
    data = path.read_bytes()
    old = checkpoint_file.MAGIC_V1 + data[len(checkpoint_file.MAGIC) : -integrity.TRAILER_BYTES]
    path.write_bytes(old)
    assert checkpoint_file.verify(path) is False
    _equal(_state(), checkpoint_file.load(path))
    torch.save(_state(), tmp_path / "old.pt")
    assert checkpoint_file.verify(tmp_path / "old.pt") is False
