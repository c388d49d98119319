import pytest
import torch

from murmur.node.model.transformer import PRESETS, Transformer, model_config
from murmur.protocol.runconfig import MODEL_PRESETS


def test_preset_names_agree_with_the_config_schema():
    assert tuple(PRESETS) == MODEL_PRESETS


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_parameter_count_matches_the_formula(name):
    cfg = PRESETS[name]
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_the_coordinators_parameter_count_is_the_models():
    """The status page's "less than DDP" divides by the count the coordinator reads from the run's
    TOML (torch-free); it must be the built model's."""
    from murmur.coordinator.runs import shape_of

    toml = '[model]\npreset = "tiny"\ndim = 64\nn_layers = 3\nseq_len = 32\n[train]\nbatch_size = 5\n'
    model = Transformer(model_config("tiny", dim=64, n_layers=3, seq_len=32))
    assert shape_of(toml) == {"n_params": sum(p.numel() for p in model.parameters()), "tokens_per_step": 5 * 32}
    assert shape_of("[model]\npreset = 'tiny'\nn_heads = 5\n") == {"n_params": 0, "tokens_per_step": 0}


def test_preset_sizes():
    millions = {name: cfg.num_params() / 1e6 for name, cfg in PRESETS.items()}
    assert 0.5 < millions["tiny"] < 1.5
    assert 110 < millions["base"] < 140
    assert millions["large"] > 350


def test_logits_shape_and_loss():
    cfg = PRESETS["tiny"]
    model = Transformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 17))
    assert model(idx).shape == (3, 17, cfg.vocab_size)
    loss = model(idx, idx)
    assert loss.shape == () and torch.isfinite(loss)


def test_causality_future_tokens_never_change_past_logits():
    cfg = model_config("tiny", n_kv_heads=2)  # grouped-query attention too
    model = Transformer(cfg, seed=1).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    t = 20
    changed = idx.clone()
    changed[:, t + 1 :] = torch.randint(0, cfg.vocab_size, (2, 32 - t - 1))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_same_seed_same_weights_different_seed_different_weights():
    cfg = PRESETS["tiny"]
    a, b, c = Transformer(cfg, seed=7), Transformer(cfg, seed=7), Transformer(cfg, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_sequence_longer_than_the_model_is_refused():
    cfg = PRESETS["tiny"]
    with pytest.raises(ValueError, match="exceeds"):
        Transformer(cfg)(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))
