"""The configuration reference must name every run key and every environment variable we read."""

import dataclasses
import re
from pathlib import Path

from pydantic import BaseModel

from murmur.protocol.runconfig import RunConfig

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "configuration.md").read_text()


def _keys(cls, prefix=""):
    for name, field in cls.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _keys(field.annotation, f"{prefix}{name}.")
        else:
            yield prefix + name


def test_the_key_walk_sees_every_section():
    keys = list(_keys(RunConfig))
    assert {"name", "model.preset", "train.steps", "sync.exchange_chunk_mb"} <= set(keys)


def test_every_config_key_is_documented():
    missing = [k for k in _keys(RunConfig) if f"`{k}`" not in DOC]
    assert not missing, f"docs/configuration.md lacks {missing}"


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
