import subprocess
import sys

import pytest

from murmur.protocol.runconfig import ConfigError, RunConfig, load_config, parse_config


def test_defaults_round_trip_through_toml():
    cfg = RunConfig()
    assert parse_config(cfg.to_toml()) == cfg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[modle]\npreset = 'tiny'", "unknown key 'modle'"),
        ("[train]\nstesp = 10", "unknown key 'train.stesp'"),
        ("[train]\nsteps = 'ten'", "train.steps must be an integer"),
        ("[train]\nsteps = true", "train.steps must be an integer"),
        ("[optim]\nlr = 'fast'", "optim.lr must be a number"),
        ("[model]\npreset = 'huge'", "model.preset = 'huge' is not one of"),
        ("[sync]\nalgorithm = 'gossip'", "sync.algorithm = 'gossip' is not one of"),
        ("[train]\nsteps = 0", "train.steps must be positive"),
        ("[sync]\nexchange_chunk_mb = 0", "sync.exchange_chunk_mb must be positive"),
        ("[sync]\nexchange_chunk_mb = 64", "sync.exchange_chunk_mb must be at most 8"),
        ("model = 3", "[model] must be a table"),
        ("[train\nsteps = 1", "is not valid TOML"),
    ],
)
def test_bad_config_is_a_one_line_error_naming_the_key(text, message):
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 10\n")
    cfg = load_config(path, ["train.steps=20", "optim.lr=1e-3", "data.path=some/dir", "sync.nesterov=false"])
    assert (cfg.train.steps, cfg.optim.lr, cfg.data.path, cfg.sync.nesterov) == (20, 1e-3, "some/dir", False)
    with pytest.raises(ConfigError, match="unknown key 'train.step'"):
        load_config(path, ["train.step=3"])


def test_cli_prints_one_line_and_fails(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nbatchsize = 4\n")
    cmd = [sys.executable, "-m", "murmur.cli", "train", "--config", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: unknown key 'train.batchsize' (known here: batch_size, checkpoint_every, compile, dtype, "
        "eval_batches, eval_every, log_every, steps)"
    ]
