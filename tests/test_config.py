import subprocess
import sys
import typing
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


def _numeric_keys() -> list[tuple[str, object]]:
    """(dotted key, its field) of every number of the schema (ints and floats, optional or not)."""
    from murmur.protocol.runconfig import PipelineSection

    out = []
    sections = {"": RunConfig, "pipeline": PipelineSection}
    sections.update({name: type(getattr(RunConfig(), name)) for name in ("model", "data", "optim", "train", "sync")})
    for prefix, model in sections.items():
        for name, field in model.model_fields.items():
            kinds = typing.get_args(field.annotation) or (field.annotation,)
            if any(k in (int, float) for k in kinds):
                out.append((f"{prefix}.{name}" if prefix else name, field))
    return out


def _cap(field) -> float:
    caps = [getattr(m, n) for m in field.metadata for n in ("le", "lt") if hasattr(m, n)]
    assert caps, "no upper bound"
    return caps[0]


@pytest.mark.parametrize(("key", "field"), _numeric_keys(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_number_has_an_upper_bound_and_past_it_is_a_one_line_error_naming_the_key(key, field):
    cap = _cap(field)
    over = 2**63 if isinstance(cap, int) and int in typing.get_args(field.annotation) + (field.annotation,) else 1e300
    data: dict = {}
    apply_override(data, f"{key}={over!r}")
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    msg = str(err.value)
    assert msg.startswith(f"{key} must ") and "\n" not in msg, msg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # what issue 37 found in a ledger
        ("[train]\nsteps = 9223372036854775808",
         "train.steps must be within (0, 1000000000], got 9223372036854775808 (a billion steps is 30 years"),
        ("[train]\nbatch_size = 9223372036854775807", "train.batch_size must be within (0, 65536], got"),
        ("[pipeline]\nhop_timeout_s = 1e12",
         "pipeline.hop_timeout_s must be within (0, 86400], got 1000000000000.0 (a day)"),
        ("[pipeline]\nstages = 2\nlayers = [1, 5000]", "pipeline.layers must name 1 to 1024 blocks"),
        # a cap is named only to a value above it
        ("[train]\nsteps = 0", "train.steps must be positive, got 0"),
    ],
)
def test_absurd_numbers_are_refused_naming_the_key(text, message):
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert str(err.value).startswith(message), str(err.value)


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


@pytest.mark.parametrize("command", [["train"], ["sim", "--workers", "2"], ["testnet", "up"]])
def test_train_sim_and_testnet_refuse_an_absurd_number_in_one_line_before_doing_anything(tmp_path, capsys, command):
    from murmur.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "kept").write_text("an earlier run's file")
    argv = [*command, "--config", str(ROOT / "configs" / "testnet-tiny.toml"), "--out", str(out),
            "--set", "train.steps=9223372036854775808"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: train.steps must be within (0, 1000000000]"), err
    assert (out / "kept").is_file()  # testnet up wipes its folder only for a config that holds up


def test_cli_prints_one_line_and_fails(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nbatchsize = 4\n")
    cmd = [sys.executable, "-m", "murmur.cli", "train", "--config", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: unknown key 'train.batchsize' (did you mean 'train.batch_size'?)"
    ]


# Per parameter, training the whole model in one process: fp32 weights, fp32 gradients and
# AdamW's two fp32 moments (configs/pipeline-gpu.toml says the same in its comment).
TRAIN_STATE_BYTES_PER_PARAM = 4 + 4 + 8
VOLUNTEER_GPU_BYTES = 24 * 10**9


def _stage_params(path: Path) -> tuple[int, list[int]]:
    """(the whole model's parameters, each stage's), the stages built on the meta device: shapes
    only, so the 2B-parameter model is counted without a byte of it allocated."""
    from murmur.node.model.stages import build_stage, split_layers
    from murmur.node.pipeline.config import model_from_run

    model, pipe = model_from_run(load_config(path))
    spans = split_layers(model.n_layers, pipe.stages, pipe.layers)
    stages = [sum(p.numel() for p in build_stage(model, 0, span, "meta").parameters()) for span in spans]
    return model.num_params(), stages


def test_the_shipped_pipelined_configs_parse_and_fit_what_they_claim():
    cpu = load_config(ROOT / "configs" / "pipeline-cpu.toml")
    assert cpu.pipeline is not None and cpu.pipeline.drivers >= 1 and cpu.train.dtype == "fp32"
    total, stages = _stage_params(ROOT / "configs" / "pipeline-cpu.toml")
    assert sum(stages) == total < 2_000_000 and len(stages) == cpu.pipeline.stages  # a laptop's CPU
    gpu = load_config(ROOT / "configs" / "pipeline-gpu.toml")
    assert gpu.pipeline is not None and gpu.pipeline.drivers >= 1 and gpu.train.dtype == "bf16"
    total, stages = _stage_params(ROOT / "configs" / "pipeline-gpu.toml")
    assert sum(stages) == total == 2_055_882_752  # the figure its comment gives
    # whole, the model's training state does not fit one 24 GB volunteer; its largest stage's does
    assert total * TRAIN_STATE_BYTES_PER_PARAM > VOLUNTEER_GPU_BYTES
    assert max(stages) * TRAIN_STATE_BYTES_PER_PARAM < VOLUNTEER_GPU_BYTES / 3
