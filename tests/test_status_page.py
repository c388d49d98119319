"""The status page in headless Chromium against a live testnet (a coordinator and two nodes as
real processes): after the page's scripts ran, its node rows, round and token counts are those of
`murmur admin status --output json` taken around the same moment; a SIGKILLed node's row turns
lost; a screenshot is written as an artifact (and to $MURMUR_STATUS_SCREENSHOT when set).

Chromium is Debian's (`apt-get install chromium chromium-driver`); without it the test skips."""

from __future__ import annotations

import html
import html.parser
import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from _node_helpers import UNTIL_STOPPED, log, make_testnet, small_dataset, wait_rounds

from murmur.coordinator.runs import ddp_equivalent_bytes, shape_of
from murmur.node.daemon.state_dir import read_rounds
from murmur.node.testnet.procs import kill_group, wait_for

pytestmark = pytest.mark.system

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FAST_COORDINATOR = ["--heartbeat-ttl", "3", "--lease-ttl", "4", "--restart-grace", "5"]
FAST_NODE = ["--peer-timeout", "8", "--rendezvous-deadline", "8", "--round-timeout", "60", "--dht-record-ttl", "6"]
BROWSER_TIMEOUT_S = 120.0


def chromium(tmp: Path, url: str, *args: str) -> str:
    """Run headless Chromium on ``url`` (its scripts get 4 s of virtual time, enough for a fetch
    and a refresh); returns stdout. Its whole process group is gone when this returns."""
    assert CHROMIUM
    profile = tmp / "chromium-profile"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={profile}", "--no-first-run", "--virtual-time-budget=4000", *args, url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BROWSER_TIMEOUT_S)
    finally:
        kill_group(proc)  # its zygote and renderers, should any outlive it
        proc.wait()
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode(errors="replace")


class _Rows(html.parser.HTMLParser):
    """Reads the rendered DOM: every element's id and data-* attributes, and each node row's cells."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict[str, str]] = {}
        self.rows: dict[str, dict[str, str]] = {}
        self._row: str | None = None
        self._cell: str | None = None
        self.svg = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.by_id[a["id"]] = a
        if tag == "svg" and a.get("id") == "loss-chart":
            self.svg = True
        if tag == "tr" and "data-node" in a:
            self._row = a["data-node"]
            self.rows[self._row] = {"row_status": a.get("data-status", "")}
        elif tag == "td" and self._row is not None:
            first = (a.get("class") or "").split()
            self._cell = first[1] if len(first) > 1 and first[0] == "num" else (first[0] if first else "")
            if "data-value" in a:
                self.rows[self._row][self._cell + "_value"] = a["data-value"]

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._row = None
        if tag == "td":
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._row is not None and self._cell:
            self.rows[self._row][self._cell] = self.rows[self._row].get(self._cell, "") + data


def read_page(tmp: Path, url: str) -> _Rows:
    parsed = _Rows()
    parsed.feed(chromium(tmp, url, "--dump-dom"))
    return parsed


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium chromium-driver)")
def test_status_page_shows_the_ledger_and_a_lost_node(tmp_path):
    data = small_dataset(tmp_path / "data")
    net = make_testnet(tmp_path / "net", data, node_args=FAST_NODE, overrides=UNTIL_STOPPED)
    net.coordinator_args = list(FAST_COORDINATOR)
    with net:
        net.start_coordinator()
        net.create_run(token_uses=8)
        first = net.add_node(extra=["--min-peers", "2"])
        net.wait_dht_bootstrap()
        second = net.add_node(extra=["--min-peers", "2"])
        for node in (first, second):
            wait_rounds(node, 2, timeout_s=240)
        url = f"http://{net.info['metrics']}/"

        before = net.admin("status", "--run", net.run_id)
        page = read_page(tmp_path, url)
        after = net.admin("status", "--run", net.run_id)

        assert page.svg, "the loss chart was not drawn"
        assert page.by_id["run-algorithm"]  # rendered by the script
        ids = {n["node_id"] for n in after["nodes"]}
        assert set(page.rows) == ids == {n["node_id"] for n in before["nodes"]}
        assert all(r["status"] == r["row_status"] == "active" for r in page.rows.values()), page.rows
        assert all(r["rejected"].isdigit() and r["refused"].isdigit() for r in page.rows.values()), page.rows
        rnd = int(page.by_id["run-round"]["data-value"])
        assert int(before["run"]["outer_step"]) <= rnd <= int(after["run"]["outer_step"])
        committed = int(page.by_id["run-tokens"]["data-committed"])
        assert int(before["run"]["tokens_committed"]) <= committed <= int(after["run"]["tokens_committed"])
        assert int(page.by_id["run-tokens"]["data-total"]) == int(after["run"]["tokens_total"])
        # Less than DDP: DDP's bytes for the committed tokens at this batch, over the bytes sent.
        api = _api_status(url)
        shape = shape_of(api["status"]["run"]["config_toml"])
        workers = sum(1 for n in api["nodes"] if n["tokens_committed"] > 0)
        ddp = ddp_equivalent_bytes(shape, int(api["status"]["run"]["tokens_committed"]), workers)
        assert ddp > 0 and api["run"]["ddp_bytes"] == ddp
        assert api["run"]["reduction_vs_ddp"] == pytest.approx(ddp / int(api["status"]["bytes_sent"]))
        assert float(page.by_id["run-reduction"]["data-value"]) > 1.0  # H steps per exchange: far less
        # Both nodes train in rounds on loopback: peers dial them ("reached" column).
        assert {n["reachability"] for n in api["nodes"]} == {"direct"}, api["nodes"]
        cli_tokens = {n["node_id"]: (int(b["tokens_committed"]), int(n["tokens_committed"]))
                      for b in before["nodes"] for n in after["nodes"] if b["node_id"] == n["node_id"]}
        for node_id, row in page.rows.items():
            lo, hi = cli_tokens[node_id]
            assert lo <= int(row["tokens_value"]) <= hi, (node_id, row, lo, hi)
        # the nodes' validation losses reach the chart's data (train.eval_every rounds)
        assert any(r["val_loss"] is not None for r in api["rounds"]), api["rounds"][:20]
        # each node's own loss by round, for the chart's thin per-node lines
        assert set(api["node_losses"]) <= ids and api["node_losses"], api["node_losses"]
        assert all(isinstance(r, int) and loss > 0 for s in api["node_losses"].values() for r, loss in s)
        # each row names its node as the testnet does (--name), and gives its share of the run's tokens
        assert sorted(row["name"] for row in page.rows.values()) == ["node-0", "node-1"], page.rows
        assert all(row["share"].endswith("%") for row in page.rows.values()), page.rows
        # and the hash of its last round's shared state, as it announces it and its rounds.jsonl records it
        assert all(re.fullmatch(r"[0-9a-f]{12}", row["hash"]) for row in page.rows.values()), page.rows
        shown = {row["hash"] for row in page.rows.values()}  # published before its round's record is written
        wait_for(lambda: shown <= {r["shared_hash"][:12] for n in net.nodes for r in read_rounds(n.state_dir)
                                   if "shared_hash" in r},
                 60, what=f"the rounds of the hashes shown {shown} in the nodes' rounds.jsonl")

        victim = second
        victim_id = _node_id(victim)
        net.kill_node(victim)

        def lost() -> bool:
            nodes = net.admin("nodes", "list", "--run", net.run_id)["nodes"]
            return any(n["node_id"] == victim_id and n["status"] == "lost" for n in nodes)

        wait_for(lost, 60, what="the coordinator to mark the killed node lost")

        def late() -> bool:  # peers' reports can mark it lost before its heartbeat is a TTL old
            return any(n["node_id"] == victim_id and n["heartbeat_late"] for n in _api_status(url)["nodes"])

        wait_for(late, 60, what="its heartbeat to pass the TTL")
        page = read_page(tmp_path, url)
        assert page.rows[victim_id]["status"] == page.rows[victim_id]["row_status"] == "lost", page.rows
        row = _row_classes(tmp_path, url, victim_id)
        assert "st-lost" in row and "heartbeat late" in row  # its heartbeat age is red: past the TTL
        shots = Path(os.environ.get("MURMUR_STATUS_SCREENSHOT") or tmp_path / "status-page.png")
        shots.parent.mkdir(parents=True, exist_ok=True)
        chromium(tmp_path, url, f"--screenshot={shots}", "--window-size=1280,1000", "--hide-scrollbars")
        assert shots.stat().st_size > 10_000  # the page with its lost row: the test artifact
        # The survivor trains on (alone now), or has finished the run's schedule and left cleanly.
        assert first.alive() or first.proc.wait(60) == 0, log(first)[-2000:]


def _node_id(node) -> str:
    """The node id a testnet node joined as (its state folder keeps the join record)."""
    return str(json.loads((node.state_dir / "join.json").read_text())["node_id"])


def _api_status(url: str) -> dict:
    """What the page's script reads: the status page's JSON."""
    return json.loads(urllib.request.urlopen(url + "api/status", timeout=30).read())


def _row_classes(tmp: Path, url: str, node_id: str) -> str:
    dom = chromium(tmp, url, "--dump-dom")
    start = dom.index(f'data-node="{node_id}"')
    return dom[start:dom.index("</tr>", start)]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium chromium-driver)")
def test_a_run_that_completes_no_round_shows_a_stalled_banner(tmp_path):
    """An active member that completes no round past --stall-after: the page shows the red
    banner with the reason, and "none yet" as the last round."""
    from _coordinator_helpers import stalled_run

    with stalled_run(tmp_path) as coord:
        dom = chromium(tmp_path, f"http://{coord.info['metrics']}/", "--dump-dom")
        assert 'data-stalled="true"' in dom, dom[:3000]
        start = dom.index('id="stalled"')
        banner = dom[start:dom.index("</div>", start)]
        assert "hidden" not in banner and "Stalled (no round for over 1.0 s): no round completed" in banner, banner
        assert ">none yet<" in dom


MEASURE = """<script>
// test_status_page.py: which card texts the layout cuts (their content wider than their box).
document.body.dataset.cut = JSON.stringify([...document.querySelectorAll(".card .v, .card .k")]
  .filter((e) => e.scrollWidth > e.clientWidth)
  .map((e) => (e.id || e.previousElementSibling.id) + ": " + e.textContent)
  .concat(document.documentElement.scrollWidth > document.documentElement.clientWidth ? ["the page is wider"] : []));
</script>
"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium chromium-driver)")
def test_no_card_is_cut_at_1400_or_800_pixels(tmp_path):
    """The page as served, its embedded status given the widest values a run shows (Streaming
    DiLoCo with int8, billions of tokens, a stall), rendered at 1400x1000 and 800x1000: every
    card's text fits its box (the DOM's scroll width is its client width). The screenshots stay in
    the test's folder."""
    import asyncio
    import re

    from _coordinator_helpers import admin, join, new_token, start_coordinator, write_run_files

    coord = start_coordinator(tmp_path / "coord.db", "--heartbeat-ttl", "120", "--lease-ttl", "120")
    try:
        config, manifest = write_run_files(tmp_path, [1000])
        assert admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
        token = new_token(coord)

        async def member() -> None:
            client, _ = await join(coord, token, name="a volunteer with a long name")
            async with client:
                await client.heartbeat(tokens_per_s=123456.0)

        asyncio.run(member())
        served = urllib.request.urlopen(f"http://{coord.info['metrics']}/", timeout=30).read().decode()
    finally:
        coord.stop()
    marker = re.search(r'<script id="initial" type="application/json">(.*?)</script>', served, re.S)
    data = json.loads(marker.group(1).replace("<\\/", "</"))
    data["run"].update(algorithm="streaming", codec="int8", reduction_vs_ddp=12345.6)
    st = data["status"]
    st["run"].update(tokens_committed=1_234_567_890, tokens_total=9_876_543_210, outer_step=123456)
    st.update(tokens_per_s=1_234_567.0, bytes_sent=987_654_321_000, last_loss=12.3456, rounds=123456,
              last_round_at=1.0, last_round_age_s=7000.0, stalled=True, stall_reason="no round completed for 7000s",
              nodes_by_status={"active": 123, "lost": 45, "left": 678})
    data["rounds"] = [{"round": r, "loss": 3 - r / 100, "val_loss": 3.1 - r / 100 if r % 10 == 0 else None,
                       "tokens": 1, "bytes_sent": 1} for r in range(10, 111)]
    # two nodes' own lines, one of them starting before the rounds shown (cut at the chart's start)
    data["node_losses"] = {"node-a": [[r, 3.05 - r / 100] for r in range(5, 111)],
                           "node-b": [[r, 2.95 - r / 100] for r in range(10, 111, 2)]}
    page = tmp_path / "page.html"
    page.write_text(served[:marker.start(1)] + json.dumps(data).replace("</", "<\\/") + served[marker.end(1):]
                    .replace("</body>", MEASURE + "</body>"))
    for width in (1400, 800):
        dom = chromium(tmp_path, page.as_uri(), "--dump-dom", f"--window-size={width},1000")
        cut = json.loads(html.unescape(re.search(r'data-cut="([^"]*)"', dom).group(1)))
        # the loss chart's round axis is labelled along its length, not only at its ends
        assert re.findall(r'class="xtick"[^>]*>([^<]*)<', dom) == ["round 10", "35", "60", "85", "110"], width
        val_line = re.search(r'<polyline id="val-line" points="([^"]*)"', dom)
        assert val_line and len(val_line.group(1).split()) == 11, width  # rounds 10, 20, ... 110
        node_lines = dict(re.findall(r'<polyline class="node-line" data-node="([^"]*)"[^>]* points="([^"]*)"', dom))
        assert {k: len(v.split()) for k, v in node_lines.items()} == {"node-a": 101, "node-b": 51}, width
        chromium(tmp_path, page.as_uri(), f"--screenshot={tmp_path / f'status-{width}.png'}",
                 f"--window-size={width},1000", "--hide-scrollbars")
        assert cut == [], (width, cut)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium chromium-driver)")
def test_a_run_whose_every_node_left_shows_stopped_in_its_title_and_banner(tmp_path):
    """No active node past --stall-after: the title says stopped, not just "(active)", and the
    banner says why (tests/test_run_stopped.py: the same with a SIGKILLed node, without a browser)."""
    import asyncio

    from _coordinator_helpers import admin, admin_json, join, new_token, start_coordinator, write_run_files

    from murmur.node.testnet.procs import wait_for

    coord = start_coordinator(tmp_path / "coord.db", "--stall-after", "1")
    try:
        config, manifest = write_run_files(tmp_path, [1000])
        assert admin(coord, "runs", "create", "--config", str(config), "--manifest", str(manifest)).returncode == 0
        token = new_token(coord)

        async def member() -> None:
            client, _ = await join(coord, token)
            async with client:
                await client.heartbeat(tokens_per_s=10.0)
                await client.leave("test")

        asyncio.run(member())
        wait_for(lambda: admin_json(coord, "status")["stopped"], timeout_s=60, what="the run to show as stopped")
        dom = chromium(tmp_path, f"http://{coord.info['metrics']}/", "--dump-dom")
        assert 'data-stopped="true"' in dom and "stopped: no active node" in dom, dom[:3000]
        start = dom.index('id="stalled"')
        banner = dom[start:dom.index("</div>", start)]
        assert "hidden" not in banner, banner
        assert "Stopped (no active node for over 1.0 s): no active node for" in banner, banner
    finally:
        coord.stop()
