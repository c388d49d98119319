import subprocess
import sys
from pathlib import Path

import pytest

from murmur.protocol.runconfig import (
    CODECS,
    ConfigError,
    RunConfig,
    apply_override,
    config_from_dict,
    load_config,
    parse_config,
)

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_round_trip_through_toml():
    cfg = RunConfig()
    assert parse_config(cfg.to_toml()) == cfg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[modle]\npreset = 'tiny'", "unknown key 'modle' (did you mean 'model'?)"),
        ("[train]\nstesp = 10", "unknown key 'train.stesp' (did you mean 'train.steps'?)"),
        ("[train]\nfoo = 10", "unknown key 'train.foo' (known here: batch_size, checkpoint_every, compile, dtype,"),
        ("[train]\nsteps = 'ten'", "train.steps must be an integer, got 'ten'"),
        ("[train]\nsteps = true", "train.steps must be an integer, got true"),
        ("[train]\nsteps = 10.0", "train.steps must be an integer, got 10.0"),
        ("[train]\ncompile = 1", "train.compile must be true or false, got 1"),
        ("name = 3", "name must be a string, got 3"),
        ("[optim]\nlr = 'fast'", "optim.lr must be a number, got 'fast'"),
        ("[optim]\nlr = nan", "optim.lr must be a finite number, got nan"),
        ("[optim]\nlr = -1e-3", "optim.lr must not be negative, got -0.001"),
        ("[optim]\nbeta2 = 1.0", "optim.beta2 must be within [0, 1), got 1.0"),
        ("[model]\npreset = 'huge'", "model.preset = 'huge' is not one of 'tiny', 'small', 'medium', 'base' or"),
        ("[model]\ndim = 0", "model.dim must be positive, got 0"),
        ("[sync]\nalgorithm = 'gossip'", "sync.algorithm = 'gossip' is not one of"),
        ("[sync]\ncodec = 'int3'", "sync.codec = 'int3' is not one of 'fp32',"),
        ("[train]\nsteps = 0", "train.steps must be positive, got 0"),
        ("[train]\nsteps = 0\nbatch_size = 0", "train.steps must be positive, got 0 (and 1 more error)"),
        ("[sync]\nexchange_chunk_mb = 0", "sync.exchange_chunk_mb must be within (0, 8], got 0"),
        ("[sync]\nexchange_chunk_mb = 64", "must be within (0, 8], got 64 (a chunk travels as one gRPC message"),
        ("[sync]\ninner_steps = 4\noverlap_steps = 4", "sync.overlap_steps must be within [0, sync.inner_steps = 4)"),
        ("model = 3", "[model] must be a table, got 3"),
        ("[train\nsteps = 1", "is not valid TOML"),
    ],
)
def test_bad_config_is_a_one_line_error_naming_the_key(text, message):
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_config_that_is_not_a_table_is_refused():
    with pytest.raises(ConfigError, match="the run config must be a table, got 3"):
        config_from_dict(3)


def test_numbers_are_read_as_the_key_says():
    cfg = parse_config("[optim]\nlr = 1\n[train]\nsteps = 7")
    assert (cfg.optim.lr, type(cfg.optim.lr), cfg.train.steps) == (1.0, float, 7)


def test_a_parsed_config_can_be_adjusted_in_place():
    # Callers (the testnet launcher, benchmarks) set keys on a parsed config, as on a dataclass.
    cfg = parse_config("")
    cfg.data.path = "elsewhere"
    cfg.sync.inner_steps = 2
    cfg.sync.overlap_steps = 0
    assert parse_config(cfg.to_toml()) == cfg


def test_codec_names_match_optim():
    from murmur.optim.codecs import CODECS as OPTIM_CODECS

    assert CODECS == OPTIM_CODECS


def test_every_shipped_config_is_valid():
    paths = sorted((ROOT / "configs").glob("*.toml"))
    assert paths
    for path in paths:
        load_config(path)


def test_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 10\n")
    cfg = load_config(path, ["train.steps=20", "optim.lr=1e-3", "data.path=some/dir", "sync.nesterov=false"])
    assert (cfg.train.steps, cfg.optim.lr, cfg.data.path, cfg.sync.nesterov) == (20, 1e-3, "some/dir", False)
    with pytest.raises(ConfigError, match="unknown key 'train.step'"):
        load_config(path, ["train.step=3"])
    with pytest.raises(ConfigError, match="train.steps must be an integer, got 'many'"):
        load_config(path, ["train.steps=many"])  # a bare word is a string, then checked as any value


def test_override_errors():
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        apply_override({}, "train.steps")
    with pytest.raises(ConfigError, match="train is not a table"):
        apply_override({"train": 3}, "train.steps=1")


def test_cli_prints_one_line_and_fails(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nbatchsize = 4\n")
    cmd = [sys.executable, "-m", "murmur.cli", "train", "--config", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: unknown key 'train.batchsize' (did you mean 'train.batch_size'?)"
    ]
