"""A manifest whose numbers do not fit the ledger is refused with one line, not an OverflowError."""

from __future__ import annotations

import json

import pytest

from murmur.coordinator.runs import RunError, parse_manifest


@pytest.mark.parametrize(
    "shards",
    [
        [{"id": 0, "tokens": 2**63}],
        [{"id": 2**64, "tokens": 10}],
        [{"id": 0, "tokens": 2**62}, {"id": 1, "tokens": 2**62}],
    ],
)
def test_numbers_past_the_ledgers_integers_are_refused(shards):
    with pytest.raises(RunError, match=r"2\^63 - 1") as err:
        parse_manifest(json.dumps({"shards": shards}))
    assert "\n" not in str(err.value)


def test_the_largest_fitting_shard_is_accepted():
    assert parse_manifest(json.dumps({"shards": [{"id": 0, "tokens": 2**63 - 1}]})) == [(0, "shard_0", 2**63 - 1)]
