"""benchmarks/scale.py: its rows (from real peers, and how kills and hashes count) and its one-line
argument errors. No timing: the figures live in benchmarks/results/scale.json."""

import json
import os

import pytest
from _bench_helpers import benchmark_module

ROW_KEYS = {"peers", "group_size", "numel", "codec", "link", "kills", "rounds", "rounds_complete", "one_hash",
            "seconds_per_round", "bytes_per_peer", "dht_failures"}


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("scale") as module:
        yield module


@pytest.mark.parametrize("argv, says", [
    (["--peers", "8,x"], "--peers '8,x' must be whole numbers"),
    (["--peers", "1"], "at least 2"),
    (["--rounds", "0"], "--rounds 0"),
    (["--kills", "5", "--rounds", "4"], "--kills 5"),
    (["--peers", "4", "--kills", "2"], "kills half the run"),
    (["--group-size", "1"], "--group-size 1"),
    (["--per-process", "0"], "--per-process 0"),
    (["--codec", "int3"], "--codec 'int3'"),
])
def test_a_bad_argument_is_refused_in_one_line(bench, capsys, argv, says):
    assert bench.main([*argv, "--no-write"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


def test_a_group_size_this_run_config_refuses_is_one_line_naming_the_key(bench, capsys):
    from murmur.node.testnet.peer_host import run_config
    from murmur.protocol.runconfig import ConfigError

    try:
        run_config(["sync.group_size=8"])
    except ConfigError:
        assert bench.main(["--group-size", "8", "--no-write"]) == 2
        err = capsys.readouterr().err.strip()
        assert "sync.group_size" in err and "\n" not in err
    else:  # the tree has grouped rounds: the key is taken, and the harness checks it like the config does
        assert bench.main(["--group-size", "1", "--no-write"]) == 2


def test_kill_victims_have_a_process_each_and_the_rest_share(bench):
    assert bench.layout(20, 8, 2) == [(1, True), (1, True), (8, False), (8, False), (2, False)]
    assert bench.layout(8, 8, 0) == [(8, False)]


def _line(node, rnd, digest="ab", ok=True, t1=1.0):
    if not ok:
        return {"event": "round", "node_id": node, "round": rnd, "ok": False, "error": "DHT lookup of k failed",
                "t0": 0.0, "t1": t1}
    return {"event": "round", "node_id": node, "round": rnd, "ok": True, "hash": digest, "bytes_sent": 100,
            "members": 3, "dropped": 0, "t0": 0.0, "t1": t1}


def test_a_round_is_complete_when_every_peer_not_killed_has_one_result(bench):
    args = bench.parser().parse_args(["--rounds", "3"])
    rec = bench.Records(go=0.0)
    # round 1: all three agree; round 2: c was killed in it, a and b agree; round 3: two hashes
    rec.rounds = [_line("a", 1), _line("b", 1), _line("c", 1), _line("a", 2), _line("b", 2, t1=2.0),
                  _line("a", 3, "ab", t1=6.0), _line("b", 3, "cd")]
    rec.killed = {"c": 2}
    row = bench.summarize(args, 3, "loopback", rec, processes=2)
    assert ROW_KEYS <= set(row)
    assert row["rounds_complete"] == 2 and row["one_hash"] is False and row["kills"] == 1
    assert row["seconds_per_round"] == 2.0 and row["bytes_per_peer"] == 100 and row["dht_failures"] == 0
    rec.rounds = [_line("a", 1), _line("b", 1, ok=False)]
    rec.killed = {}
    row = bench.summarize(bench.parser().parse_args(["--rounds", "1"]), 2, "loopback", rec, processes=2)
    assert row["rounds_complete"] == 0 and row["one_hash"] is True and row["dht_failures"] == 1


def test_rows_of_a_later_run_replace_those_with_the_same_key(bench):
    old = [{"peers": 8, "group_size": None, "numel": 1, "codec": "int4", "link": "loopback", "kills": 0, "rounds": 4,
            "seconds_per_round": 9.0},
           {"peers": 16, "group_size": None, "numel": 1, "codec": "int4", "link": "loopback", "kills": 0, "rounds": 4}]
    new = [{**old[0], "seconds_per_round": 1.0}]
    merged = bench.merge(old, new)
    assert [r["peers"] for r in merged] == [8, 16] and merged[0]["seconds_per_round"] == 1.0
    # The same row measured on a machine of other cores (the 16-core host) is a row of its own.
    merged = bench.merge(merged, [{**old[0], "cpus": 16, "seconds_per_round": 0.5}])
    assert sorted((r["peers"], r.get("cpus") or 0) for r in merged) == [(8, 0), (8, 16), (16, 0)]


def test_a_copy_of_the_tree_without_git_names_its_commit_by_argument(bench):
    assert bench.tree_commit("abc1234") == "abc1234"
    assert bench.tree_commit(None)  # git's, or a placeholder that says to pass --commit


@pytest.mark.integration
def test_two_real_peers_make_a_complete_row(bench, tmp_path):
    out = tmp_path / "scale.json"
    argv = ["--peers", "2", "--rounds", "1", "--numel", "4096", "--results", str(out), "--commit", "given"]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert {"device", "date", "commit", "command", "rows"} <= set(data)
    (row,) = data["rows"]
    assert ROW_KEYS <= set(row)
    assert row["cpus"] == os.cpu_count() and row["commit"] == "given" and "load_avg_1m_before" in row
    assert (row["peers"], row["rounds_complete"], row["one_hash"], row["kills"]) == (2, 1, True, 0)
    assert row["bytes_per_peer"] > 0 and row["errors"] == []
