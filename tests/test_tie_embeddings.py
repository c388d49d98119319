"""``model.tie_embeddings``: one key decides whether the embedding and the head share a matrix, for
`murmur train`, the nodes and the sim (node/train/build.py) and the stage peers
(node/pipeline/config.py) alike, so one process can train exactly a pipeline's model."""

from __future__ import annotations

import pytest

from murmur.errors import MurmurError
from murmur.node.pipeline.config import model_from_run
from murmur.node.train.build import build_model_from_config, resolve_model_config
from murmur.protocol.runconfig import parse_config

pytestmark = pytest.mark.unit

SMALL = "[model]\ndim = 32\nn_layers = 2\nhidden_dim = 64\nseq_len = 16\n"


def test_tied_by_default_and_untied_by_default_across_stages():
    assert resolve_model_config(parse_config(SMALL), 256).tie_embeddings is True
    piped = parse_config(SMALL + "[pipeline]\nstages = 2\n")
    assert resolve_model_config(piped, 256).tie_embeddings is False
    assert model_from_run(piped)[0].tie_embeddings is False
    one_stage = parse_config(SMALL + "[pipeline]\nstages = 1\n")  # the one stage holds both ends
    assert model_from_run(one_stage)[0].tie_embeddings is True


def test_untied_one_process_builds_the_pipelines_model():
    single = parse_config(SMALL + "tie_embeddings = false\n")
    piped = parse_config(SMALL + "[pipeline]\nstages = 2\n")
    model = build_model_from_config(single, 256)
    assert model.lm_head is not None
    assert resolve_model_config(single, 256) == model_from_run(piped)[0]
    names = {n for n, _ in model.named_parameters()}
    assert "lm_head.weight" in names and "embed.weight" in names
    tied = build_model_from_config(parse_config(SMALL), 256)
    assert tied.lm_head is None
    assert sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in tied.parameters()) == 256 * 32
    # the coordinator's parameter count follows the key too
    from murmur.coordinator.runs import shape_of

    assert shape_of(single.to_toml())["n_params"] - shape_of(parse_config(SMALL).to_toml())["n_params"] == 256 * 32


@pytest.mark.parametrize(("text", "said"), [
    (SMALL + "tie_embeddings = true\n[pipeline]\nstages = 3\n",
     "model.tie_embeddings must be false (or left out) when pipeline.stages = 3 > 1"),
    (SMALL + "tie_embeddings = 1\n", "model.tie_embeddings must be true or false, got 1"),
])
def test_a_bad_value_is_refused_in_one_line(text, said):
    with pytest.raises(MurmurError) as err:
        parse_config(text)
    assert said in str(err.value) and "\n" not in str(err.value)
