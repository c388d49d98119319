"""A node's log lines carry the time they were written: as text, or one JSON object a line."""

from __future__ import annotations

import datetime as dt
import io
import json
import time

import pytest

from murmur.logline import line_writer


def test_text_lines_start_with_their_time():
    out = io.StringIO()
    before = time.time()
    line_writer("text", out)("joined run r as n1\nsecond line")
    first, second = out.getvalue().splitlines()
    stamp, _, msg = first.partition(" ")
    assert msg == "joined run r as n1" and second.endswith(" second line")
    at = dt.datetime.fromisoformat(stamp).timestamp()
    assert before - 0.001 <= at <= time.time() + 0.001


def test_json_lines_are_one_object_each():
    out = io.StringIO()
    line_writer("json", out)('round 3 | loss 2.5 | "quoted"')
    (record,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert record["msg"] == 'round 3 | loss 2.5 | "quoted"'
    assert dt.datetime.fromisoformat(record["time"]).timestamp() == pytest.approx(record["at"], abs=0.002)


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="text or json"):
        line_writer("xml")
