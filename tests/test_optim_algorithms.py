"""DiLoCo, Streaming DiLoCo, DeMo and DDP as the workers run them: equivalences, identical
replicas, schedules, byte accounting, and the inner optimizer matching single-node training."""

from __future__ import annotations

import copy

import pytest
import torch
from _optim_helpers import flat_params, make_workers, run_workers, tiny_config, token_stream

from murmur.optim.diloco import split_fragments
from murmur.optim.inner import lr_at, make_inner_optimizer, set_lr


def test_diloco_one_worker_h1_outer_lr1_no_momentum_matches_plain_training_to_float_rounding():
    """Not bit-exact, by construction: the outer step computes global - 1.0 * (global - local),
    which in fp32 is local only up to rounding (1e-6 here), so this checks closeness."""
    steps = 5
    cfg = tiny_config(steps, algorithm="diloco", inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
    (worker,) = make_workers(cfg, 1)
    plain_model = copy.deepcopy(worker.model)
    plain_opt = make_inner_optimizer(plain_model, cfg.optim)
    run_workers([worker], steps)
    data = token_stream(100)
    for s in range(steps):
        set_lr(plain_opt, lr_at(s, steps, cfg.optim))
        x, y = next(data)
        plain_model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), cfg.optim.grad_clip)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
    for (name, a), b in zip(worker.model.named_parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    assert worker.sync.outer_steps == steps


@pytest.mark.parametrize(
    "sync",
    [
        {"algorithm": "ddp"},
        {"algorithm": "diloco", "inner_steps": 2, "codec": "int4"},
        {"algorithm": "streaming", "inner_steps": 4, "fragments": 2, "overlap_steps": 1, "codec": "topk"},
        {"algorithm": "demo", "inner_steps": 2},
        {"algorithm": "diloco", "inner_steps": 2, "codec": "powersgd", "aggregator": "centered_clip"},
    ],
    ids=lambda s: "-".join(str(v) for v in s.values()),
)
def test_identical_replicas_on_identical_data_stay_bit_identical(sync):
    steps = 4
    workers = make_workers(tiny_config(steps, **sync), 3, same_data=True)
    before = flat_params(workers[0]).clone()
    run_workers(workers, steps)
    ref = flat_params(workers[0])
    assert not torch.equal(ref, before)
    for w in workers[1:]:
        assert torch.equal(flat_params(w), ref), w.peer


def test_diloco_workers_agree_after_a_sync_and_diverge_between():
    workers = make_workers(tiny_config(3, algorithm="diloco", inner_steps=2), 2)
    run_workers(workers, 2)
    assert torch.equal(flat_params(workers[0]), flat_params(workers[1]))
    workers = make_workers(tiny_config(3, algorithm="diloco", inner_steps=2), 2)
    run_workers(workers, 3)  # one step past the sync, on different data
    assert not torch.equal(flat_params(workers[0]), flat_params(workers[1]))


def test_diloco_bytes_are_one_ring_all_reduce_of_the_model_per_outer_step():
    k, steps, h = 2, 4, 2
    workers = make_workers(tiny_config(steps, algorithm="diloco", inner_steps=h, codec="fp32"), k)
    run_workers(workers, steps)
    n = sum(p.numel() for p in workers[0].model.parameters())
    assert workers[0].sync.bytes.sent == {"fp32": (steps // h) * 2 * (k - 1) * 4 * n // k}
    assert workers[0].sync.bytes.rounds == steps // h


def test_streaming_syncs_each_fragment_once_per_window_and_moves_a_fragment_at_a_time():
    k, h, p = 2, 4, 2
    workers = make_workers(
        tiny_config(8, algorithm="streaming", inner_steps=h, fragments=p, overlap_steps=1), k
    )
    run_workers(workers, 8)
    sync = workers[0].sync
    assert [f.rounds for f in sync.fragments] == [2, 2]
    assert [f.offset for f in sync.fragments] == [2, 4]
    sizes = [sum(sync.params[j].numel() for j in f.members) for f in sync.fragments]
    total = sum(sizes)
    assert max(sizes) < 0.75 * total  # each exchange moves part of the model, not all of it
    assert sync.outer_steps == 4 and not sync.in_flight


def test_split_fragments_is_balanced_and_contiguous():
    groups = split_fragments([10, 10, 10, 10, 1, 1], 3)
    assert [i for g in groups for i in g] == list(range(6))
    assert len(groups) == 3 and all(groups)
    assert split_fragments([5], 4) == [[0]]


def test_demo_sends_far_less_than_ddp_per_step():
    steps = 2
    demo = make_workers(tiny_config(steps, algorithm="demo", demo_topk=8), 2)
    run_workers(demo, steps)
    ddp = make_workers(tiny_config(steps, algorithm="ddp"), 2)
    run_workers(ddp, steps)
    assert demo[0].sync.bytes.total_sent * 20 < ddp[0].sync.bytes.total_sent
    assert list(demo[0].sync.bytes.sent) == ["demo_dct"]


def test_demo_dct_round_trips_exactly_when_every_coefficient_is_kept():
    from murmur.optim.demo import DCTTopKCodec

    codec = DCTTopKCodec(topk=64 * 64, chunk=64)
    x = torch.randn(128, 96)
    y = codec.decode(codec.encode(x, "w"))
    torch.testing.assert_close(y, x, atol=0.02, rtol=0.01)  # bf16 values on the wire


def test_a_failing_worker_releases_the_others():
    workers = make_workers(tiny_config(4, algorithm="ddp"), 2)

    def broken():
        raise RuntimeError("disk on fire")
        yield  # pragma: no cover

    workers[1].batches = broken()
    from murmur.optim.exchange import ExchangeError

    workers[0].sync.round_timeout_s = 30
    with pytest.raises((RuntimeError, ExchangeError)):
        run_workers_with_abort(workers, 4)


def run_workers_with_abort(workers, steps):
    """Like the simulator: a failing worker aborts the group so nobody waits for it."""
    import threading

    group = workers[0].sync.exchange._group
    errors = []

    def run(w):
        try:
            for s in range(steps):
                w.step(s, steps)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
            group.abort(f"{w.peer}: {err}")

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 2  # the broken worker and the one it left waiting
    raise errors[0]


def test_demo_replicas_in_one_process_decode_the_gathered_payloads_once():
    """In memory every member gets the same payloads, so the K replicas share one decode of their
    mean (GatherResult.memo) instead of K; the replicas still move identically."""
    from murmur.optim.exchange import Exchange

    class Recording(Exchange):
        """A worker's exchange that keeps every gather result it hands to DeMo."""

        def __init__(self, inner: Exchange, seen: list) -> None:
            self.inner, self.seen = inner, seen

        @property
        def peer_id(self) -> str:
            return self.inner.peer_id

        def all_reduce(self, tensors, **kw):
            return self.inner.all_reduce(tensors, **kw)

        def all_gather(self, wire, **kw):
            fut = self.inner.all_gather(wire, **kw)
            fut.add_done_callback(lambda f: self.seen.append(f.result()))
            return fut

    steps, k = 3, 3
    workers = make_workers(tiny_config(steps, algorithm="demo", demo_topk=8), k, same_data=True)
    results: list = []
    for w in workers:
        w.sync.exchange = Recording(w.sync.exchange, results)
    run_workers(workers, steps)
    assert len(results) == steps * k
    memos = {id(r.memo): r.memo for r in results}
    assert len(memos) == steps  # the K members of a step share one memo...
    assert sum(m.computed for m in memos.values()) == steps  # ...and decode once per step, not per replica
    for a, b in zip(workers[0].model.parameters(), workers[-1].model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_shared_memo_computes_once_under_concurrent_callers():
    import threading

    from murmur.optim.exchange import SharedMemo

    memo, computed, got = SharedMemo(), [], []
    barrier = threading.Barrier(4)

    def call():
        barrier.wait()
        got.append(memo.get("x", lambda: computed.append(1) or object()))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(computed) == 1 and len({id(g) for g in got}) == 1


@pytest.mark.parametrize("shape", [(48, 32), (24, 8, 4), (40,)])
def test_demo_group_dct_is_each_tiles_dct_and_inverts(shape):
    """DeMo transforms parameters of one shape together: slice g, tile t of the coefficients is
    D_r @ tile @ D_c^T of that tensor's t-th tile (row-major), and the inverse gives x back."""
    from murmur.optim.demo import chunk_shape, dct_matrix, group_dct, group_idct

    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    cr, cc = chunk_shape(shape, 16)
    coef = group_dct(x, shape, cr, cc)
    dr, dc = dct_matrix(cr, x.device), dct_matrix(cc, x.device)
    for g in range(3):
        m = x[g].reshape(1, -1) if len(shape) == 1 else x[g].reshape(shape[0], -1)
        tiles = [m[i:i + cr, j:j + cc] for i in range(0, m.shape[0], cr) for j in range(0, m.shape[1], cc)]
        want = torch.stack([(dr @ t @ dc.T).reshape(-1) for t in tiles])
        torch.testing.assert_close(coef[g], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(group_idct(coef, shape, cr, cc), x, rtol=1e-4, atol=1e-4)
