"""The docs must match the code: every run key with its default and choices, every environment
variable we read, every exchange setting; and no file may point at notes outside the repository."""

import dataclasses
import re
import subprocess
import tomllib
import typing
from pathlib import Path

from pydantic import BaseModel

from murmur.protocol.runconfig import RunConfig

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "configuration.md").read_text()


def _table(annotation):
    """The table a field holds, an optional one (``PipelineSection | None``) included; else None."""
    options = typing.get_args(annotation) or (annotation,)
    return next((t for t in options if isinstance(t, type) and issubclass(t, BaseModel)), None)


def _keys(cls, prefix=""):
    for name, field in cls.model_fields.items():
        table = _table(field.annotation)
        if table is not None:
            yield from _keys(table, f"{prefix}{name}.")
        else:
            yield prefix + name


def test_the_key_walk_sees_every_section():
    keys = list(_keys(RunConfig))
    assert {"name", "model.preset", "train.steps", "sync.exchange_chunk_mb", "pipeline.stages"} <= set(keys)


def test_every_config_key_is_documented():
    missing = [k for k in _keys(RunConfig) if f"`{k}`" not in DOC]
    assert not missing, f"docs/configuration.md lacks {missing}"


# A row of a key table: | `section.key` | default | meaning |
_ROW = re.compile(r"^\| `([a-z_][a-z0-9_.]*)` \| ([^|]+) \| ([^\n]+) \|$", re.M)


def _default(key):
    *sections, name = key.split(".")
    cls = RunConfig
    for section in sections:
        cls = _table(cls.model_fields[section].annotation)
    return getattr(cls(), name)  # an optional table's keys: their defaults once the table is there


def _field(key):
    *sections, name = key.split(".")
    cls = RunConfig
    for section in sections:
        cls = _table(cls.model_fields[section].annotation)
    return cls.model_fields[name]


def test_the_documented_defaults_and_choices_are_the_schemas():
    rows = {key: (default.strip(), meaning) for key, default, meaning in _ROW.findall(DOC)}
    keys = list(_keys(RunConfig))
    assert sorted(rows) == sorted(keys), "docs/configuration.md's key tables name other keys than the schema"
    for key, (written, meaning) in rows.items():
        default = _default(key)
        if default is None:  # taken from the preset or the dataset: said in words
            assert not written.startswith("`"), key
        else:
            assert written.startswith("`") and written.endswith("`"), f"{key}: default {written} not in backticks"
            assert tomllib.loads(f"v = {written.strip('`')}")["v"] == default, f"{key}: docs say {written}"
        annotation = _field(key).annotation
        if typing.get_origin(annotation) is typing.Literal:
            undocumented = [c for c in typing.get_args(annotation) if f"`{c}`" not in meaning and c != default]
            assert not undocumented, f"{key}: docs/configuration.md does not name {undocumented}"


def test_every_environment_variable_is_documented():
    used = set()
    for folder in ("murmur", "node", "optim", "kernels", "protocol", "coordinator", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"\bMURMUR_[A-Z_]+\b", path.read_text()))
    documented = set(re.findall(r"`(MURMUR_[A-Z_]+)`", DOC))
    # A name that only stands as the prefix of documented ones (a filter in a test) is fine.
    missing = sorted(v for v in used if v not in documented and not any(d.startswith(v) for d in documented))
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_every_exchange_setting_is_documented():
    from murmur.node.exchange.group import RendezvousSettings
    from murmur.node.exchange.settings import ExchangeSettings
    from murmur.node.net.server import PeerServerSettings
    from murmur.node.net.state_transfer import StateFetchSettings

    doc = (ROOT / "docs" / "protocol.md").read_text()
    classes = (ExchangeSettings, PeerServerSettings, RendezvousSettings, StateFetchSettings)
    names = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c)]
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, f"docs/protocol.md lacks {missing}"


def test_no_tracked_file_points_outside_the_repository():
    # Spelled in pieces so that this file does not name them itself.
    outside = ["DESIGN" + ".md", "NOTES" + ".md", "../" + "shared"]
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    offenders = []
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # binary
        offenders += [f"{name}: {word}" for word in outside if word in text]
    assert not offenders, f"files that name notes outside the repository: {offenders}"
