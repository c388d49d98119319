"""Everything murmur reads back from disk is checked before it is used (issue 50, item 2), with real
processes: a node's checkpoint overwritten in place (same size) or cut short is refused in one
line before the node joins (nothing trained, the ledger unchanged); an export whose weights were
overwritten, or whose weights are not finite, is refused by `murmur eval` and `murmur generate` in
one line with a non-zero exit. protocol/integrity.py's format itself: tests/test_checkpoint_file.py,
the stage checkpoint's: tests/test_pipeline_checkpoint.py."""

from __future__ import annotations

import json
import subprocess

import pytest
from _node_helpers import UNTIL_STOPPED, log, make_testnet, small_dataset, trained, wait_rounds

from murmur.node.testnet.procs import murmur_cmd, wait_for

pytestmark = pytest.mark.integration

CLI_TIMEOUT_S = 180  # one `murmur` command (torch's import) on a loaded 2-core machine


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("integrity-data"))


def _murmur(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(murmur_cmd(*args), capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The command failed (exit 1) with one line on stderr and no traceback."""
    err = result.stderr.strip()
    assert result.returncode == 1, (result.returncode, err[-2000:])
    assert "Traceback" not in err and "\n" not in err, err[-2000:]
    return err


def _overwrite_in_place(path, at_from_end: int = 4096) -> None:
    """Bytes changed inside the file, its size unchanged (what a bad disk or a stray write does)."""
    data = bytearray(path.read_bytes())
    at = max(0, len(data) - at_from_end)
    data[at : at + 16] = bytes(b ^ 0x5A for b in data[at : at + 16])
    size = path.stat().st_size
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size


def _ledger(net) -> tuple[int, list]:
    status = net.admin("status", "--run", net.run_id)
    events = net.admin("events", "--run", net.run_id, "--limit", "1000")["events"]
    return int(status["run"]["tokens_committed"]), [(e["seq"], e["kind"]) for e in events]


def test_a_corrupt_or_truncated_checkpoint_is_refused_before_the_join(tmp_path, data):
    with make_testnet(tmp_path, data, node_args=["--solo"], overrides=UNTIL_STOPPED) as net:
        net.start_coordinator()
        net.create_run(token_uses=4)
        node = net.add_node()
        wait_rounds(node, 2)
        net.kill_node(node)  # keeps its membership: a restart rejoins as the same node
        checkpoint = node.state_dir / "checkpoint.pt"
        good = checkpoint.read_bytes()
        rounds = len(trained(node))
        # Once the coordinator has marked the killed process lost (its leases back), the ledger
        # stays as it is unless something joins or trains.
        wait_for(lambda: net.admin("nodes", "list", "--run", net.run_id)["nodes"][0]["status"] == "lost",
                 timeout_s=120, what="the killed node to be marked lost")
        before = _ledger(net)
        for damage, says in (("overwritten", "is corrupt"), ("truncated", "is truncated")):
            if damage == "overwritten":
                _overwrite_in_place(checkpoint)
            else:
                checkpoint.write_bytes(good[: len(good) // 2])
            start = len(log(node))
            net.start_node(node)
            assert node.proc.wait(CLI_TIMEOUT_S) == 1, log(node)[start:][-2000:]
            out = log(node)[start:]
            lines = [line for line in out.splitlines() if str(checkpoint) in line]
            assert len(lines) == 1 and says in lines[0] and "move it aside" in lines[0], out[-2000:]
            assert "Traceback" not in out, out[-3000:]
            # Found before the join: no DHT, no heartbeat, nothing in the ledger, nothing trained.
            assert "DHT" not in out and "leased" not in out, out[-2000:]
            assert _ledger(net) == before
            assert len(trained(node)) == rounds
        # Put back, it is the node's state again: the node resumes from it.
        checkpoint.write_bytes(good)
        net.start_node(node)
        wait_rounds(node, rounds + 1)
        assert "resumed from the local checkpoint" in log(node)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, data):
    """A small export (`murmur export` of a solo node's state folder)."""
    tmp = tmp_path_factory.mktemp("integrity-export")
    with make_testnet(tmp / "net", data, node_args=["--solo"], overrides=UNTIL_STOPPED) as net:
        net.start_coordinator()
        net.create_run(token_uses=2)
        node = net.add_node()
        wait_rounds(node, 1)
        net.kill_node(node)
    out = tmp / "export"
    result = _murmur("export", str(node.state_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    prov = json.loads((out / "provenance.json").read_text())
    assert len(prov["weights_sha256"]) == 64
    return out


def _eval_and_generate(export, data) -> list[str]:
    return [
        _one_line_error(_murmur("eval", str(export), "--data", str(data), "--device", "cpu", "--batches", "1")),
        _one_line_error(_murmur("generate", str(export), "--max-new-tokens", "5", "--device", "cpu")),
    ]


def test_an_export_overwritten_in_place_is_refused_by_eval_and_generate(export_dir, data, tmp_path):
    import shutil

    bad = tmp_path / "export"
    shutil.copytree(export_dir, bad)
    _overwrite_in_place(bad / "model.safetensors")
    for err in _eval_and_generate(bad, data):
        assert "model.safetensors is corrupt" in err and "export it again" in err, err


def test_eval_and_generate_refuse_weights_that_are_not_finite(export_dir, data, tmp_path):
    """Weights that parse and match their checksum, but hold NaN (a run that diverged, exported):
    `val loss nan` with exit 0 and a 23-line traceback before."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from murmur.protocol.integrity import sha256_file

    bad = tmp_path / "export"
    shutil.copytree(export_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name][0] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    prov = json.loads((bad / "provenance.json").read_text())
    prov["weights_sha256"] = sha256_file(bad / "model.safetensors")
    (bad / "provenance.json").write_text(json.dumps(prov))
    assert not torch.isfinite(load_file(bad / "model.safetensors")[name]).all()
    for err in _eval_and_generate(bad, data):
        assert "NaN or Inf" in err and "export it again" in err, err


def test_an_export_from_before_checksums_is_read_with_a_warning(export_dir, data, tmp_path):
    import shutil

    old = tmp_path / "export"
    shutil.copytree(export_dir, old)
    prov = json.loads((old / "provenance.json").read_text())
    del prov["weights_sha256"]
    (old / "provenance.json").write_text(json.dumps(prov))
    result = _murmur("eval", str(old), "--data", str(data), "--device", "cpu", "--batches", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exported before exports carried a checksum" in result.stderr
    assert "val loss" in result.stdout
