"""The node's checkpoint file: what goes in comes back, tensor for tensor, bit for bit; files of the
older torch.save format still load; a torn file is an error, not a state."""

from __future__ import annotations

import pytest
import torch

from murmur.node.daemon import checkpoint_file
from murmur.node.daemon.state_dir import StateDir, StateDirError


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
    with pytest.raises(StateDirError, match="cannot be read"):
        sd.load_checkpoint()
