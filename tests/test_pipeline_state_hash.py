"""A stage's published state takes its hash when first asked for, not after every step
(node/pipeline/stage_state.py): the hash then is exactly the weights the state names, a step
cannot land halfway through it, and a state that changed before anyone asked says so."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from murmur.node.model.stages import build_stage, split_layers
from murmur.node.model.transformer import model_config
from murmur.node.pipeline import stage_state
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol.runconfig import OptimSection
from murmur.protocol.wire import tensors_hash

pytestmark = pytest.mark.unit


def setup():
    cfg = dataclasses.replace(model_config("tiny", n_layers=2, dim=32, hidden_dim=64, seq_len=8), tie_embeddings=False)
    worker = StageWorker(build_stage(cfg, 4, split_layers(2, 2)[1]), OptimSection(lr=1e-2, warmup_steps=0),
                         target_samples=1)
    publisher = stage_state.LivePublisher(worker)
    worker.before_step = publisher.before_change
    return worker, publisher


def step(worker: StageWorker) -> None:
    worker.backward(torch.randn(1, 8, 32), targets=torch.randint(0, 256, (1, 8)))


def weights_hash(worker: StageWorker) -> bytes:
    return tensors_hash([(n, p.detach().clone()) for n, p in worker.module.named_stage_parameters()])


def test_a_state_hashes_its_weights_when_asked_and_keeps_that_hash_after_a_step():
    worker, publisher = setup()
    state = publisher.state()
    assert state._hash is None  # no hash taken at publication
    before = weights_hash(worker)
    assert state.state_hash == before
    step(worker)
    assert worker.stats.optimizer_steps == 1 and weights_hash(worker) != before
    assert state.state_hash == before  # the hash of the weights it named, not of the new ones
    fresh = publisher.state()
    assert fresh.state_hash == weights_hash(worker) != before


def test_a_state_that_changed_before_anyone_asked_refuses_a_hash_and_a_reader():
    worker, publisher = setup()
    state = publisher.state()
    step(worker)
    with pytest.raises(stage_state.StateChanged):
        _ = state.state_hash
    with pytest.raises(stage_state.StateChanged):
        state.open()


def test_opening_a_state_takes_its_hash_for_the_manifest():
    worker, publisher = setup()
    state = publisher.state()
    before = weights_hash(worker)
    reader = state.open()
    step(worker)  # a step while the call reads: the state stays what it was
    assert state.state_hash == before
    reader.close()


def test_a_step_waits_for_a_hash_being_taken(monkeypatch):
    worker, publisher = setup()
    state = publisher.state()
    before = weights_hash(worker)
    started, release, pinning = threading.Event(), threading.Event(), threading.Event()
    real = stage_state.tensors_hash

    def slow_hash(tensors):
        started.set()
        assert release.wait(30)
        return real(tensors)

    def before_change():  # the step is about to change the weights
        pinning.set()
        publisher.before_change()

    monkeypatch.setattr(stage_state, "tensors_hash", slow_hash)
    worker.before_step = before_change
    got: list[bytes] = []
    asker = threading.Thread(target=lambda: got.append(state.state_hash))
    asker.start()
    assert started.wait(30)
    stepper = threading.Thread(target=step, args=(worker,))
    stepper.start()
    assert pinning.wait(30)
    release.set()  # the hash goes on reading the weights while the step waits to change them
    asker.join(30)
    stepper.join(30)
    assert got == [before] and worker.stats.optimizer_steps == 1
