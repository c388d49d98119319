"""The router's rules on a hand-driven clock, and the commit window's once-and-only-once."""

from __future__ import annotations

import pytest

from murmur.node.pipeline.client import StageEndpoint
from murmur.node.pipeline.driver import CommitWindow
from murmur.node.pipeline.router import Router
from murmur.protocol.runconfig import PipelineSection


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def peers(stage: int, *names: str) -> list[StageEndpoint]:
    return [StageEndpoint(n, f"127.0.0.1:{i + 1}", stage) for i, n in enumerate(names)]


def make(**kw) -> tuple[Router, Clock]:
    clock = Clock()
    cfg = PipelineSection(stages=2, hop_timeout_s=30.0, min_hop_timeout_s=1.0, bench_s=2.0, max_bench_s=8.0, **kw)
    return Router(cfg, clock=clock), clock


def test_load_follows_measured_throughput_and_new_peers_are_tried_at_once():
    router, _ = make()
    router.set_peers(1, peers(1, "fast", "slow"))
    picks = {"fast": 0, "slow": 0}
    for _ in range(200):
        p = router.choose(1, 4)
        picks[p.node_id] += 1
        router.succeeded(p, "forward", 4, 0.01 if p.node_id == "fast" else 0.1)  # 10x apart
    assert picks["slow"] > 0 and picks["fast"] > 5 * picks["slow"], picks
    router.set_peers(1, peers(1, "fast", "slow", "new"))
    assert router.choose(1, 4).node_id == "new"  # enters at the current minimum


def test_a_failed_peer_is_benched_with_doubling_and_comes_back():
    router, clock = make()
    a, b = peers(0, "a", "b")
    router.set_peers(0, [a, b])
    router.failed(a, "forward", timed_out=False)
    assert {router.choose(0, 1).node_id for _ in range(5)} == {"b"}
    clock.now += 2.1  # first bench: 2 s
    router.failed(a, "forward", timed_out=False)  # second failure in a row: 4 s
    clock.now += 3.0
    assert router.choose(0, 1, exclude=["b"]).node_id == "a"  # all benched: the earliest back is offered
    assert router.state(a).benched_until - clock.now == pytest.approx(1.0)
    router.succeeded(a, "forward", 1, 0.01)
    assert router.state(a).failures == 0
    with pytest.raises(LookupError):
        router.choose(0, 1, exclude=["a", "b"])


def test_a_peer_back_under_its_node_id_at_a_new_address_is_no_longer_benched():
    router, _ = make()
    router.set_peers(1, peers(1, "a", "b"))
    dead = StageEndpoint("b", "127.0.0.1:2", 1)
    for _ in range(3):  # the killed process: failures in a row, benched for 8 s
        router.failed(dead, "forward", timed_out=False)
    router.set_peers(1, [StageEndpoint("a", "127.0.0.1:1", 1), dead])  # the same address: still benched
    assert {router.choose(1, 4).node_id for _ in range(5)} == {"a"}
    arrivals = router.arrivals
    router.set_peers(1, [StageEndpoint("a", "127.0.0.1:1", 1), StageEndpoint("b", "127.0.0.1:9", 1)])  # restarted
    assert router.arrivals == arrivals + 1  # a driver pausing after a failure stops waiting
    st = router.state(StageEndpoint("b", "127.0.0.1:9", 1))
    assert (st.failures, st.benched_until, st.peer.address, st.failed_total) == (0, 0.0, "127.0.0.1:9", 3)
    assert "b" in {router.choose(1, 4).node_id for _ in range(5)}


def test_deadlines_adapt_to_latency_clamped_and_back_off_on_timeouts():
    router, _ = make()
    (p,) = peers(1, "p")
    router.set_peers(1, [p])
    assert router.deadline(p, "forward") == 30.0  # unmeasured: the configured bound
    for _ in range(20):
        router.succeeded(p, "forward", 4, 0.05)
    assert router.deadline(p, "forward") == 1.0  # 50 ms calls: the floor
    for _ in range(30):
        router.succeeded(p, "backward", 4, 2.0)
    steady = router.deadline(p, "backward")
    assert 4.0 <= steady < 30.0
    router.failed(p, "backward", timed_out=True)
    assert router.deadline(p, "backward") > steady  # Karn: a timeout doubles the estimate
    router.set_peers(1, [])
    assert router.peers(1) == []


def test_commit_window_commits_each_microbatch_once_in_order():
    w = CommitWindow()
    assert w.complete(1) == (0, 0)  # a gap: nothing to commit yet
    assert w.complete(0) == (0, 2)
    assert w.complete(3) == (2, 2)
    assert w.complete(2) == (2, 4)
    for again in (0, 3):
        with pytest.raises(ValueError, match="twice"):
            w.complete(again)


def test_a_retry_pause_ends_when_a_peer_enters_a_stage():
    import asyncio

    from murmur.node.pipeline.driver import _pause

    router, _ = make()
    router.set_peers(1, peers(1, "a"))
    router.set_peers(1, peers(1, "a"))  # the same peers again: no arrival

    async def main() -> None:
        waiting = asyncio.create_task(_pause(router, 30.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        router.set_peers(1, peers(1, "a", "refill"))  # the coordinator refilled the stage
        await asyncio.wait_for(waiting, 5.0)  # not the 30 s

    asyncio.run(main())
    assert router.arrivals == 2


def test_commits_go_out_one_at_a_time_in_order_though_lanes_finish_together():
    """Two lanes: microbatch 1 completes while microbatch 0's commit is still in flight. Its commit
    must wait, or the ledger (which refuses a commit that does not start at its end) could see
    [1, 2) before [0, 1): a loaded run of test_pipeline_coordinator saw the records come back out of order."""
    import asyncio

    import torch

    from murmur.node.pipeline.driver import MicrobatchResult, run_in_order

    class ScriptedDriver:  # the lanes' side only; tests/test_pipeline_coordinator.py runs the real one
        cfg = PipelineSection(stages=2)

        def __init__(self) -> None:
            self.commit0_started, self.mb1_done = asyncio.Event(), asyncio.Event()

        async def run_microbatch(self, name: str, x, y) -> MicrobatchResult:
            if name.startswith("mb1."):
                await self.commit0_started.wait()
                self.mb1_done.set()
            return MicrobatchResult(loss=1.0)

    async def main() -> list[tuple]:
        driver, events = ScriptedDriver(), []

        async def on_commit(lo: int, hi: int) -> None:
            events.append(("start", lo, hi))
            if lo == 0:
                driver.commit0_started.set()
                await driver.mb1_done.wait()
                for _ in range(10):  # the other lane gets every chance to start its commit now
                    await asyncio.sleep(0)
            events.append(("end", lo, hi))

        x = torch.zeros(1, 1)
        end = await run_in_order(driver, lambda i: (x, x), 3, concurrency=2, on_done=lambda i, r: None,
                                 on_commit=on_commit)
        assert end == 3
        return events

    events = asyncio.run(asyncio.wait_for(main(), 30))
    assert events[:4] == [("start", 0, 1), ("end", 0, 1), ("start", 1, 2), ("end", 1, 2)], events
