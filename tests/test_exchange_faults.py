"""The fault injector of node/net/faults.py: its spec strings, its delays, and poisoned updates as the
owners of a real gRPC exchange see them (peers on loopback, one process)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from _net_helpers import no_lost_task_exceptions, peer_group  # noqa: F401 - a fixture

from murmur.node.net.faults import POISON_FLIP_SCALE, POISON_SCALE, FaultError, FaultInjector
from murmur.optim.codecs import make_codec
from murmur.optim.exchange import ExchangeError

TIMEOUT = 60


def test_spec_strings_arm_call_faults_and_delays():
    inj = FaultInjector.parse(["exit_midstream@2", "lose_result@1x2", "poison_sign@3x*", "delay:rendezvous:0.5@4"])
    assert "exit_midstream" in inj.call_faults("me", 2) and "exit_midstream" not in inj.call_faults("me", 2)
    assert all("lose_result" in inj.call_faults("me", 1) for _ in range(2))
    assert "lose_result" not in inj.call_faults("me", 1)
    assert all(inj.call_faults("me", 3).poison_kind == "poison_sign" for _ in range(5))  # x*: always
    assert inj.call_faults("me", 2).poison_kind == ""
    asyncio.run(inj.delay("rendezvous", "me", 3))  # another round: no delay
    assert ("delay", "me", 4) not in inj.fired
    asyncio.run(inj.delay("rendezvous", "me", 4))
    assert ("delay", "me", 4) in inj.fired


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("bogus", "unknown fault 'bogus'"),
        ("delay:nowhere:1", "unknown delay point 'nowhere'"),
        ("delay:send_input", "positive number of seconds"),
        ("delay:send_input:-2", "positive number of seconds"),
        ("exit@two", "bad fault spec 'exit@two'"),
        ("nan@1xmany", "bad fault spec 'nan@1xmany'"),
    ],
)
def test_bad_spec_strings_are_refused_with_the_reason(spec, reason):
    with pytest.raises(FaultError, match=reason):
        FaultInjector.parse([spec])


def test_release_ends_the_delays_sleeping_now_and_not_later_ones():
    """A test holds a point with a long delay and lets it go on an event: the sleeping delay ends, on
    a plain thread and in an event loop, and a delay armed later sleeps its length."""
    inj = FaultInjector.parse(["delay:checkpoint:600@1", "delay:rendezvous:600@1", "delay:checkpoint:0.2@2"])
    slept = threading.Event()
    t = threading.Thread(target=lambda: inj.pause("checkpoint", "me", 1) and slept.set())
    t.start()
    wait_until(lambda: ("delay", "me", 1) in inj.fired)
    inj.release()
    t.join(30)
    assert not t.is_alive() and slept.is_set()

    async def held() -> float:
        task = asyncio.create_task(inj.delay("rendezvous", "me", 1))
        while inj.fired.count(("delay", "me", 1)) < 2:
            await asyncio.sleep(0.01)
        inj.release()
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(held()) == 600.0
    t0 = time.monotonic()
    assert inj.pause("checkpoint", "me", 2) == 0.2 and time.monotonic() - t0 >= 0.2  # not released


RELEASED_BY_SIGNAL = """
from murmur.node.net.faults import FaultInjector
inj = FaultInjector.parse(["delay:checkpoint:600@1"])
inj.release_on_signal()
print("slept", inj.pause("checkpoint", "me", 1), flush=True)
"""


def test_sigusr1_releases_a_process_whose_faults_armed_it():
    """The signal a test sends a node (``--fault`` arms it): a real process, a real SIGUSR1."""
    proc = subprocess.Popen([sys.executable, "-c", RELEASED_BY_SIGNAL], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # The delay's log line (stderr): a release from then on ends it.
        assert "injected fault: checkpoint delayed 600.0 s" in proc.stderr.readline()
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out == "slept 600.0\n", err
    assert "checkpoint delay released after" in err


def wait_until(ok, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_delay_strikes_only_its_peer_round_and_target():
    inj = FaultInjector()
    inj.arm("delay", peer="a", round=1, point="send_input", seconds=0.01, target="owner-b", times=-1)

    async def main():
        await inj.delay("send_input", "b", 1, target="owner-b")  # another peer
        await inj.delay("send_input", "a", 2, target="owner-b")  # another round
        await inj.delay("send_input", "a", 1, target="owner-c")  # another owner
        await inj.delay("snapshot_piece", "a", 1)  # another point
        assert inj.fired == []
        await inj.delay("send_input", "a", 1, target="owner-b")
        await inj.delay("send_input", "a", 1, target="owner-b")

    asyncio.run(main())
    assert inj.fired == [("delay", "a", 1)] * 2


def _reduce(peers, xs, round_id=1):
    futs = [p.exchange.all_reduce([x], round_id=round_id, key="k") for p, x in zip(peers, xs, strict=True)]
    out = []
    for f in futs:
        try:
            out.append(f.result(timeout=TIMEOUT))
        except ExchangeError as err:
            out.append(err)
    return out


@pytest.mark.parametrize("kind", ["poison_scale", "poison_sign", "poison_flip", "poison_random"])
def test_the_owners_aggregate_the_poisoned_update(kind):
    """Peer 2 poisons its update before encoding: every owner (peer 2's own span included) takes
    in the poisoned values, so the plain mean is the honest inputs' mean plus the poison's third."""
    with peer_group(3, codec="fp32") as (_, peers, _):
        bad = peers[2]
        bad.faults.arm(kind, peer=bad.node_id, round=1)
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(700, generator=g) for _ in peers]
        results = _reduce(peers, xs)
        assert all(not isinstance(r, Exception) for r in results), results
        assert all(torch.equal(r.tensors[0], results[0].tensors[0]) for r in results)
        assert len(results[0].members) == 3 and not results[0].dropped
        seen = 3 * results[0].tensors[0] - xs[0] - xs[1]  # what the owners took as peer 2's input
        if kind == "poison_scale":
            torch.testing.assert_close(seen, xs[2] * POISON_SCALE, rtol=1e-4, atol=1e-2)
        elif kind == "poison_sign":
            torch.testing.assert_close(seen, -xs[2], rtol=1e-4, atol=1e-4)
        elif kind == "poison_flip":
            torch.testing.assert_close(seen, -POISON_FLIP_SCALE * xs[2], rtol=1e-4, atol=1e-3)
        else:  # noise of about the honest update's size, unrelated to it
            assert 0.5 < float(seen.std() / xs[2].std()) < 2.0
            assert abs(float(torch.corrcoef(torch.stack([seen, xs[2]]))[0, 1])) < 0.2
        # The next round is honest again (the fault was armed for round 1 only).
        again = _reduce(peers, xs, round_id=2)
        torch.testing.assert_close(again[0].tensors[0], sum(xs) / 3, rtol=1e-5, atol=1e-6)


def test_a_nan_poisoned_update_is_refused_and_the_honest_peers_complete():
    with peer_group(3, codec="int8") as (_, peers, _):
        bad = peers[2]
        bad.faults.arm("poison_nan", peer=bad.node_id, round=1)
        g = torch.Generator().manual_seed(2)
        xs = [torch.randn(700, generator=g) for _ in peers]
        results = _reduce(peers, xs)
        honest = results[:2]
        assert all(not isinstance(r, Exception) for r in honest), honest
        assert torch.equal(honest[0].tensors[0], honest[1].tensors[0])
        assert bad.node_id not in honest[0].members
        assert "not finite" in honest[0].dropped[bad.node_id] or "NaN" in honest[0].dropped[bad.node_id]
        scale = max(float(x.abs().max()) for x in xs[:2])
        assert float((honest[0].tensors[0] - (xs[0] + xs[1]) / 2).abs().max()) <= 4 / 127 * scale


@pytest.mark.parametrize("kind, expect", [("poison_scale", POISON_SCALE), ("poison_sign", -1.0)])
def test_a_poisoned_gather_payload_reaches_every_member(kind, expect):
    """A gather's payload was encoded by the caller (DeMo): the poison strikes its float parts."""
    with peer_group(3, codec="topk") as (_, peers, _):
        bad = peers[1]
        bad.faults.arm(kind, peer=bad.node_id, round=5)
        codec = make_codec("topk")
        g = torch.Generator().manual_seed(3)
        wires = [[codec.encode_stateless(torch.randn(4096, generator=g), "w")] for _ in peers]
        futs = [p.exchange.all_gather(w, round_id=5, key="demo") for p, w in zip(peers, wires, strict=True)]
        results = [f.result(timeout=TIMEOUT) for f in futs]
        honest_values = wires[1][0].parts["values"]
        for res in results:
            got = res.updates[bad.node_id][0]
            torch.testing.assert_close(got.parts["values"], honest_values * expect)
            assert torch.equal(got.parts["indices"], wires[1][0].parts["indices"])
            assert torch.equal(res.updates[peers[0].node_id][0].parts["values"], wires[0][0].parts["values"])
