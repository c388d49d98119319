"""What a stage peer says about its memory is its own: its peak is its own address space's
(not the peak of the bigger process that spawned it), and copies of its stage it freed leave
the process instead of staying resident in malloc's heaps (node/pipeline/memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _net_helpers import REPO

from murmur.node.pipeline.memory import MIB

pytestmark = pytest.mark.integration

CHILD_PEAK = "from murmur.node.pipeline.memory import peak_rss_mb; print(peak_rss_mb())"

# Weight-sized blocks freed while small ones allocated between them stay (as a peer frees a
# checkpoint's copies, a replaced replica or published state, around buffers it keeps).
FRAGMENTS = """
import ctypes, json, sys
from murmur.node.pipeline.memory import return_freed_memory, rss_mb
if sys.argv[1] == "fixed" and not return_freed_memory():
    print(json.dumps({"glibc": False})); raise SystemExit
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(4 << 20))  # one weight-sized copy freed (glibc raises its threshold past it)
big, small = [], []
start = rss_mb()
for _ in range(64):  # a transient of many weight-sized copies, small buffers kept between them
    p = libc.malloc(4 << 20); ctypes.memset(p, 1, 4 << 20); big.append(p)
    q = libc.malloc(64 << 10); ctypes.memset(q, 1, 64 << 10); small.append(q)
held = rss_mb()
for p in big:
    libc.free(p)
print(json.dumps({"glibc": True, "grew_mb": held - start, "after_mb": rss_mb() - start}))
"""


def test_a_child_reports_its_own_peak_not_its_parents():
    # This process touches 512 MiB; a child it spawns must not report that as its own peak
    # (ru_maxrss does: Linux carries it across exec).
    ballast = bytearray(512 * MIB)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    out = subprocess.run([sys.executable, "-c", CHILD_PEAK], capture_output=True, text=True, cwd=REPO,
                         start_new_session=True, timeout=120, check=True).stdout
    del ballast
    assert 1 < float(out) < 400, out  # the interpreter and what memory.py imports, not 512 MiB


def fragments(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FRAGMENTS, mode], capture_output=True, text=True, cwd=REPO,
                         timeout=120, check=True).stdout
    return json.loads(out)


def test_freed_copies_of_a_stage_leave_the_process():
    fixed = fragments("fixed")
    if not fixed["glibc"]:
        pytest.skip("not glibc: its own allocator decides")
    default = fragments("default")
    # glibc's default: the 4 MiB blocks freed in the middle of the heap stay resident
    assert default["grew_mb"] > 250 and default["after_mb"] > 200, default
    # with the stage peer's setting they are unmapped; the 64 small blocks kept (4 MiB) remain
    assert fixed["grew_mb"] > 250 and fixed["after_mb"] < 30, fixed


# A checkpoint written from copies (as before) and from the live tensors (as a stage peer does
# now), the process's peak growth measured around each: VmHWM reset through /proc/self/clear_refs.
CHECKPOINT = """
import dataclasses, json, sys, torch
from pathlib import Path
from murmur.node.model.stages import build_stage, split_layers
from murmur.node.model.transformer import model_config
from murmur.node.pipeline import stage_checkpoint
from murmur.node.pipeline.memory import peak_rss_mb, return_freed_memory, rss_mb
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol.runconfig import OptimSection
return_freed_memory()
torch.set_num_threads(1)
cfg = dataclasses.replace(model_config("tiny", n_layers=4, dim=512, hidden_dim=1536, seq_len=8), tie_embeddings=False)
w = StageWorker(build_stage(cfg, 0, split_layers(4, 4)[1]), OptimSection(lr=1e-3, warmup_steps=0), target_samples=1)
w.backward(torch.randn(1, 8, 512), grad_outputs=torch.randn(1, 8, 512))  # AdamW's moments exist
out = {"stage_mb": w.module.parameter_bytes() / 2**20}
for mode in ("copies", "live"):
    start = rss_mb()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from here
    with w.lock:
        params, opt = (stage_checkpoint.take if mode == "copies" else stage_checkpoint.live)(w.module, w.optimizer)
        stage_checkpoint.write(Path(sys.argv[1]), run_id="r", stage=1, stages=4, version=1, model=cfg,
                               layers=[1] * 4, params=params, optimizer=opt, outer=None, tokens_committed=0,
                               optimizer_steps=1, run_config=None)
    del params, opt
    out[mode] = peak_rss_mb() - start
print(json.dumps(out))
"""


def test_a_checkpoint_does_not_copy_the_stage(tmp_path):
    """Written from the live weights and AdamW moments under the worker's lock, a checkpoint raises
    the process's peak by nothing like the stage; from copies (as before) by its weights and both
    moments, three times the stage's weights: the measurement sees what it should."""
    out = json.loads(subprocess.run([sys.executable, "-c", CHECKPOINT, str(tmp_path)], capture_output=True, text=True,
                                    cwd=REPO, timeout=300, check=True).stdout)
    assert out["copies"] > 2.5 * out["stage_mb"], out
    assert out["live"] < 0.1 * out["stage_mb"], out


def test_the_published_state_is_the_live_weights_and_a_replica_streams_to_disk(tmp_path):
    """A stage's published state holds no copy of its weights; a replica fetched from it goes to a
    file and holds them exactly; a step that lands while a call reads the state is copied for that
    call, in a file (the transfer never mixes two steps), and a call opened after the step is refused."""
    import dataclasses
    import os

    import torch

    from murmur.node.model.stages import build_stage, split_layers
    from murmur.node.model.transformer import model_config
    from murmur.node.net.loop import LoopThread
    from murmur.node.net.server import PeerServer
    from murmur.node.pipeline import replica, stage_state
    from murmur.node.pipeline.worker import StageWorker
    from murmur.protocol.identity import CertificateAuthority
    from murmur.protocol.runconfig import OptimSection

    cfg = dataclasses.replace(model_config("tiny", n_layers=2, dim=32, hidden_dim=64, seq_len=8), tie_embeddings=False)
    worker = StageWorker(build_stage(cfg, 4, split_layers(2, 2)[1]), OptimSection(lr=1e-2, warmup_steps=0),
                         target_samples=1)
    publisher = stage_state.LivePublisher(worker)
    worker.before_step = publisher.before_change
    ca = CertificateAuthority.create("live-state")
    loop = LoopThread()
    server = PeerServer(ca.issue(), run_id="r")
    try:
        loop.run(server.start())
        state = publisher.state()
        server.publish_state(state)
        params = [p for _, p in worker.module.named_stage_parameters()]
        assert [t.data_ptr() for _, t in state.tensors] == [p.data_ptr() for p in params]  # no copy
        disk = loop.run(replica.fetch_to_disk(ca.issue(), server.node_id, server.address, state.name,
                                              tmp_path / "replica.bin"))
        assert disk.state_hash == state.state_hash and (tmp_path / "replica.bin").stat().st_size == sum(
            p.numel() * 4 for p in params)
        assert all(torch.equal(disk.tensor(n), p) for (n, _), p in zip(state.tensors, params, strict=True))
        # A call reading while a step lands: it keeps reading the state it opened.
        (first, _), (name, t) = state.tensors[0], state.tensors[1]
        reader = state.open()
        reader.read(first, 0, 4)  # the first tensor is being sent
        reader.read(first, 4, params[0].numel() * 4)
        before = [reader.read(name, 0, 64), reader.read(name, 64, t.numel() * 4)]
        reader.read(name, 0, 8)  # the second one started: the first is sent
        worker.backward(torch.randn(1, 8, 32), targets=torch.randint(0, 256, (1, 8)))  # one optimizer step
        assert worker.stats.optimizer_steps == 1
        assert first not in state._pinned and name in state._pinned  # only what the call still sends
        # ... written to a file, not held in memory: the bytes of the tensors the call still needs
        assert state._spill is not None and state.pinned_bytes == sum(
            p.numel() * 4 for p in params[1:]) == os.fstat(state._spill.fileno()).st_size
        assert b"".join([reader.read(name, 0, 64), reader.read(name, 64, t.numel() * 4)]) == b"".join(before)
        assert b"".join(before) != params[1].detach().numpy().tobytes()
        reader.close()
        assert state._pinned == {} and state._spill is None  # the copy went with the last call that needed it
        with pytest.raises(stage_state.StateChanged):
            state.open()  # stale, and nobody kept a copy for a new call
        fresh = publisher.state()
        server.publish_state(fresh)
        again = loop.run(replica.fetch_to_disk(ca.issue(), server.node_id, server.address, fresh.name,
                                               tmp_path / "replica.bin"))
        assert again.state_hash == fresh.state_hash != state.state_hash
        assert torch.equal(again.tensor(name), params[1])
    finally:
        loop.run(server.stop())
        loop.stop()


# A stage worker's backward and step, each one's peak growth over the memory it held before.
WORKER = """
import dataclasses, json, torch
from murmur.node.model.stages import build_stage, split_layers
from murmur.node.model.transformer import model_config
from murmur.node.pipeline.memory import peak_rss_mb, return_freed_memory, rss_mb
from murmur.node.pipeline.worker import StageWorker
from murmur.protocol.runconfig import OptimSection
return_freed_memory()
torch.set_num_threads(1)
cfg = dataclasses.replace(model_config("tiny", n_layers=4, dim=1024, hidden_dim=2048, seq_len=8), tie_embeddings=False)
w = StageWorker(build_stage(cfg, 0, split_layers(4, 4)[1]), OptimSection(lr=1e-3, warmup_steps=0), target_samples=4)
x, g = torch.randn(2, 8, 1024), torch.randn(2, 8, 1024)
growth = {"backward": 0.0, "step": 0.0}
for i in range(8):
    start = rss_mb()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    res = w.backward(x, grad_outputs=g)
    if i >= 2:  # AdamW's moments exist from the first step (i = 1) on
        key = "step" if res.stepped else "backward"
        growth[key] = max(growth[key], peak_rss_mb() - start)
largest = max(p.numel() * 4 for p in w.params) / 2**20
print(json.dumps({"stage_mb": w.module.parameter_bytes() / 2**20, "largest_mb": largest, **growth}))
"""


def test_a_backward_and_a_step_hold_no_copy_of_the_stage():
    """Gradients go into their sums as autograd makes them (not all at once beside the sums), and
    the CPU AdamW steps tensor by tensor (foreach's temporaries were twice the stage's weights):
    a backward raises the peak by a fraction of the stage's weights, a step by a few of its largest
    tensor's temporaries (its square root of the second moment, the update)."""
    out = json.loads(subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, cwd=REPO,
                                    timeout=300, check=True).stdout)
    assert out["backward"] < 0.35 * out["stage_mb"], out
    assert out["step"] < 3.5 * out["largest_mb"] < out["stage_mb"], out


def test_a_backward_whose_caller_left_is_taken_out_of_the_sums():
    import dataclasses

    import torch

    from murmur.node.model.stages import build_stage, split_layers
    from murmur.node.model.transformer import model_config
    from murmur.node.pipeline.worker import StageWorker
    from murmur.protocol.runconfig import OptimSection

    cfg = dataclasses.replace(model_config("tiny", n_layers=2, dim=32, hidden_dim=64, seq_len=8), tie_embeddings=False)
    for span in split_layers(2, 2):
        w = StageWorker(build_stage(cfg, 1, span), OptimSection(lr=1e-2, warmup_steps=0), target_samples=100)
        x = torch.randint(0, 256, (2, 8)) if span.is_first else torch.randn(2, 8, 32)
        kw = {"targets": torch.randint(0, 256, (2, 8))} if span.is_last else {"grad_outputs": torch.randn(2, 8, 32)}
        w.backward(x, **kw)
        before = [t.clone() for t in w.grad_sums]
        res = w.backward(x * (1 if span.is_first else 2), keep=lambda: False, **kw)
        assert not res.kept and w.stats.samples_accumulated == 2
        for a, b in zip(w.grad_sums, before, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert all(p.grad is None for p in w.params)
