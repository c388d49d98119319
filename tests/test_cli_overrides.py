"""One override rule for every command that takes a run config: the shortcut flags apply first,
then every `--set` in order, so an explicit `--set` wins over a shortcut flag for the same key."""

from __future__ import annotations

import json
from importlib import import_module

from murmur.cli import build_parser, main
from murmur.node.train.overrides import config_from_args

TINY = ["--set", "model.n_layers=1", "--set", "model.seq_len=32", "--set", "train.batch_size=2",
        "--set", "train.eval_batches=1", "--device", "cpu"]


def test_set_wins_over_the_shortcut_flag_in_murmur_train(byte_dataset, tmp_path, capsys):
    rc = main(["train", "--data", str(byte_dataset.root), "--out", str(tmp_path / "run"), *TINY,
               "--steps", "5", "--set", "train.steps=2"])
    assert rc == 0
    assert "done: 2 steps" in capsys.readouterr().out


def test_set_wins_over_the_shortcut_flag_in_murmur_sim(byte_dataset, tmp_path):
    out = tmp_path / "sim"
    rc = main(["sim", "--workers", "2", "-H", "1", "--set", "sync.overlap_steps=0", "--data", str(byte_dataset.root),
               "--out", str(out), *TINY, "--set", "train.steps=2", "--steps", "5", "--codec", "int8",
               "--set", 'sync.codec="fp16"'])
    assert rc == 0
    run = json.loads((out / "sim.json").read_text())["runs"][0]
    assert run["steps"] == 2 and run["codec"] == "fp16"


def test_the_last_set_wins_and_shortcut_values_are_quoted(tmp_path):
    odd = str(tmp_path / 'a "quoted" back\\slash dir')
    for command in ("train", "sim"):
        argv = [command, "--data", odd, "--set", "train.steps=7", "--set", "train.steps=9"]
        args = build_parser(argv).parse_args(argv)
        shortcuts = import_module(args.func.__module__).SHORTCUTS
        cfg = config_from_args(args, shortcuts)
        assert cfg.train.steps == 9 and cfg.data.path == odd, command
