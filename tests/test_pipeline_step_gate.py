"""The stage peer's step boundary (node/pipeline/step_gate.py) on its own, and with a real worker:
a forward of the next optimizer step waits until this step is taken, so every microbatch's
backward recomputes on the weights its forward ran on."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from murmur.node.model.stages import build_stage, split_layers
from murmur.node.model.transformer import model_config
from murmur.node.pipeline.step_gate import StepGate
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol.runconfig import OptimSection

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_forward_past_the_target_waits_for_the_step_and_then_goes_in():
    async def run() -> None:
        acc = [0]
        gate = StepGate(lambda: acc[0], 8, expire_s=30.0)
        await gate.admit("a", 4)
        await gate.admit("b", 4)  # 0 accumulated + 4 awaited < 8: still this step
        third = asyncio.ensure_future(gate.admit("c", 4))
        await settle()
        assert not third.done()  # 0 + 8 awaited: c is the next step's
        acc[0] = 4  # a's backward accumulated
        gate.done("a")
        await settle()
        assert not third.done()  # 4 + 4 awaited: b's backward will take the step
        acc[0] = 0  # b's backward reached 8 samples and the worker stepped
        gate.done("b")
        await settle()
        assert third.done() and gate.held == 1 and gate.pending_samples == 4

    asyncio.run(run())


def test_a_forward_whose_backward_never_comes_is_forgotten_after_expire_s():
    async def run() -> None:
        clock = Clock()
        gate = StepGate(lambda: 0, 4, expire_s=0.2, clock=clock)
        await gate.admit("lost", 4)  # the driver gave this microbatch up
        waiting = asyncio.ensure_future(gate.admit("next", 4))
        await settle()
        assert not waiting.done()
        clock.now = 0.2  # its wait times out on the loop's own clock within 0.2 s
        await asyncio.wait_for(waiting, timeout=10)
        assert gate.expired == 1 and gate.pending_samples == 4

    asyncio.run(run())


def test_a_waiting_forward_whose_caller_left_is_not_counted():
    async def run() -> None:
        gate = StepGate(lambda: 0, 4, expire_s=30.0)
        await gate.admit("a", 4)
        waiting = asyncio.ensure_future(gate.admit("b", 4))
        await settle()
        waiting.cancel()  # the driver's deadline passed: gRPC cancels the handler
        await settle()
        gate.done("a")
        assert gate.pending_samples == 0
        gate.done("never-admitted")  # a backward whose forward ran on a stage-mate: nothing to forget

    asyncio.run(run())


def test_with_the_gate_a_microbatch_in_flight_across_a_step_gets_its_own_weights_gradient():
    """Two stages of a real model, target 2 samples, microbatches of 1 row, 3 in flight: stage 0's
    forwards are admitted as the gate says, and every backward then recomputes on the weights that
    made the activations stage 1 trained on, so the result equals training stage by stage in order
    (the equivalence of tests/test_pipeline_stages.py) bit for bit."""
    cfg = dataclasses.replace(model_config("tiny", n_layers=2, dim=32, hidden_dim=64, seq_len=8),
                              tie_embeddings=False)
    optim = OptimSection(lr=1e-2, warmup_steps=0)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (1, 9), generator=gen) for _ in range(6)]

    def workers():
        spans = split_layers(cfg.n_layers, 2)
        return [StageWorker(build_stage(cfg, 1, sp), optim, target_samples=2) for sp in spans]

    # one microbatch at a time: the reference
    ref = workers()
    for i, mb in enumerate(data):
        x, y = mb[:, :-1], mb[:, 1:]
        h = ref[0].forward(x)
        g = ref[1].backward(h, targets=y).grad_inputs
        ref[0].backward(x, grad_outputs=g)
        assert ref[0].stats.optimizer_steps == (i + 1) // 2

    async def pipelined(ws) -> None:
        gate = StepGate(lambda: ws[0].stats.samples_accumulated, 2, expire_s=30.0)
        order = asyncio.Queue()

        async def one(i: int) -> None:
            x, y = data[i][:, :-1], data[i][:, 1:]
            await gate.admit(f"mb{i}", 1)
            h = ws[0].forward(x)
            await order.put(i)
            await asyncio.sleep(0)  # let the other lanes' forwards in while this one is downstream
            g = ws[1].backward(h, targets=y).grad_inputs
            await asyncio.sleep(0)
            ws[0].backward(x, grad_outputs=g)
            gate.done(f"mb{i}")

        await asyncio.gather(*(one(i) for i in range(len(data))))
        assert gate.held > 0

    ws = workers()
    asyncio.run(pipelined(ws))
    for a, b in zip(ref, ws, strict=True):
        assert a.stats.optimizer_steps == b.stats.optimizer_steps == 3
        for (name, p), (_, q) in zip(a.module.named_stage_parameters(), b.module.named_stage_parameters(), strict=True):
            assert torch.equal(p, q), name


def test_a_lost_forward_is_forgotten_after_a_few_round_trips_not_the_hop_timeout():
    async def run() -> None:
        clock = Clock()
        gate = StepGate(lambda: 0, 4, expire_s=30.0, clock=clock)
        for i in range(20):  # backwards come 0.1 s after their forward
            await gate.admit(f"mb{i}", 4)
            clock.now += 0.1
            gate.done(f"mb{i}")
        assert gate.expire_after_s == 2.0  # the floor: 2 x (0.1 + 4 x ~0) is below it
        await gate.admit("lost", 4)
        clock.now += 2.5  # past the floor, far below the 30 s hop timeout
        await asyncio.wait_for(gate.admit("next", 4), timeout=10)
        assert gate.expired == 1

    asyncio.run(run())


def test_a_training_forwards_deadline_allows_for_the_rest_of_the_trip():
    """The driver's side: a forward that a stage holds at its step boundary waits for one
    microbatch's trip down and back, so its deadline adds that trip to the forward's own, measured
    per hop, and never passes hop_timeout_s."""
    from murmur.node.pipeline.client import StageEndpoint
    from murmur.node.pipeline.router import Router
    from murmur.protocol.runconfig import PipelineSection

    cfg = PipelineSection(stages=3, hop_timeout_s=30.0, min_hop_timeout_s=0.5)
    router = Router(cfg)
    peers = [StageEndpoint(f"p{s}", f"127.0.0.1:{s + 1}", s) for s in range(3)]
    for s, p in enumerate(peers):
        router.set_peers(s, [p])
    assert router.forward_deadline(peers[0]) == 30.0  # nothing measured yet: the hop timeout
    for _ in range(50):  # steady latencies: rttvar decays towards 0
        for p in peers:
            router.succeeded(p, "forward", 4, 0.1)
            router.succeeded(p, "backward", 4, 0.2)
    own = router.deadline(peers[0], "forward")
    # stage 1's forward, then the backwards of stages 2, 1 and 0, each with the slack of 2
    assert router.forward_deadline(peers[0]) == pytest.approx(own + 2 * (0.1 + 3 * 0.2), rel=0.05)
    assert router.forward_deadline(peers[1]) == pytest.approx(router.deadline(peers[1], "forward") + 2 * 0.4, rel=0.05)
    router.succeeded(peers[2], "backward", 4, 100.0)  # a very slow last stage: capped
    assert router.forward_deadline(peers[0]) == 30.0
