"""MuLoCo on real nodes: two `murmur node` processes of a testnet (coordinator, DHT, gRPC exchange)
train with optim.inner = "muon" and the 2-bit codec with error feedback, agree on one state hash
every round, and each one's checkpoint holds its Muon momentum and its error-feedback residual."""

from __future__ import annotations

import pytest
import torch
from _node_helpers import UNTIL_STOPPED, hashes_by_round, make_testnet, small_dataset, trained, wait_rounds

from murmur.node.daemon import checkpoint_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory.mktemp("muloco-data"))


def test_two_nodes_train_muon_with_a_2bit_delta_under_one_state_hash(tmp_path, data):
    overrides = ['optim.inner="muon"', "optim.muon_lr=3e-3", 'sync.algorithm="diloco"', 'sync.codec="2bit"',
                 *UNTIL_STOPPED]
    net = make_testnet(tmp_path, data, overrides=overrides)
    with net:
        net.start_coordinator()
        net.create_run(token_uses=8)
        a = net.add_node(extra=["--min-peers", "2"])
        net.wait_dht_bootstrap()
        b = net.add_node(extra=["--min-peers", "2"])
        for node in (a, b):
            wait_rounds(node, 4)
        by_round = hashes_by_round([a, b])
        common = [r for r, h in by_round.items() if len(h) == 2]
        assert len(common) >= 3 and all(len(set(by_round[r].values())) == 1 for r in common), by_round
        losses = [r["loss"] for r in trained(a)]
        assert all(torch.isfinite(torch.tensor(losses))), losses
        for node in (a, b):
            assert net.stop_node(node) == 0
    for node in (a, b):
        ckpt = checkpoint_file.load(node.state_dir / "checkpoint.pt")
        kinds = [g["kind"] for g in ckpt["optimizer"]["param_groups"]]
        assert kinds[0] == "muon" and set(kinds[1:]) == {"adamw"}, kinds
        assert any("momentum_buffer" in st for st in ckpt["optimizer"]["state"].values())
        residuals = {k: v for k, v in ckpt["codec"].items() if k.startswith("residual/")}
        assert residuals and all(bool(v.abs().sum() > 0) for v in residuals.values()), list(ckpt["codec"])
