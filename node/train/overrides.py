"""The run config a command line asks for: `--config`, shortcut flags and `--set`, one rule.

The rule, for every command that takes a run config (`murmur train`, `murmur sim`): the TOML file
(or the built-in defaults) first, then the shortcut flags (`--steps N` is `--set train.steps=N`),
then every `--set key=value` in the order given. The later form wins, so an explicit `--set`
beats a shortcut flag for the same key, and of two `--set` for one key the last one wins.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from murmur.protocol.runconfig import RunConfig

# A command's shortcut flags: argparse destination -> the config key it sets.
Shortcuts = Mapping[str, str]


def add_set_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.steps=200 (repeatable; wins over shortcut flags)")


def overrides(args: argparse.Namespace, shortcuts: Shortcuts) -> list[str]:
    """``key=value`` items in the order they apply: the shortcut flags given, then every --set."""
    # json.dumps writes a string as a TOML basic string (quotes and backslashes escaped).
    items = [f"{key}={json.dumps(getattr(args, flag))}" for flag, key in shortcuts.items()
             if getattr(args, flag, None) is not None]
    return items + list(args.set)


def config_from_args(args: argparse.Namespace, shortcuts: Shortcuts) -> RunConfig:
    """``args.config`` (or the defaults) with the command line's overrides applied by the rule above."""
    # The schema (pydantic, a few hundred ms) only once a config is built: not for --help.
    from murmur.protocol.runconfig import apply_override, config_from_dict, load_config

    items = overrides(args, shortcuts)
    if args.config:
        return load_config(args.config, items)
    data: dict = {}
    for item in items:
        apply_override(data, item)
    return config_from_dict(data)
