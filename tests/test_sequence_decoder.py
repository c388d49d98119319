"""The fp32 fast path of the KV cache (node/model/sequence_decoder.py): its logits equal the model's
full forward to 1e-5 however the cache is filled (a prompt, a chunk after it, one token at a time),
with grouped-query heads and with an untied output matrix, a full cache refuses more tokens, and
`murmur generate` takes it for fp32 weights only (other dtypes keep the model's own modules)."""

from __future__ import annotations

import pytest
import torch

from murmur.node.export.generate import CachedLogits
from murmur.node.model.sequence_decoder import SequenceDecoder
from murmur.node.model.transformer import Transformer, model_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SEQ = 24


def _model(**shape: int | bool) -> Transformer:
    return Transformer(model_config("tiny", seq_len=SEQ, **shape), seed=3).eval()


def _ids() -> list[int]:
    return torch.randint(0, 256, (SEQ,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("shape", [{}, {"n_kv_heads": 2}, {"n_kv_heads": 1, "tie_embeddings": False}],
                         ids=["mha", "gqa", "mqa-untied"])
def test_logits_equal_the_full_forward(shape):
    model = _model(**shape)
    ids = _ids()
    with torch.no_grad():
        full = model(torch.tensor([ids]))[0]
    dec = SequenceDecoder(model)
    # A prompt, a chunk after it (a causal mask over cached positions), then one token at a time.
    got = {8: dec.feed(ids[:9]), 11: dec.feed(ids[9:12])}
    got |= {i: dec.step(ids[i]) for i in range(12, SEQ)}
    assert dec.length == SEQ and dec.room == 0
    for pos, logits in got.items():
        assert (logits - full[pos]).abs().max().item() < 1e-5, pos
    with pytest.raises(ValueError, match="do not fit"):
        dec.step(ids[0])
    # A reset starts the sequence over, at position 0.
    dec.reset()
    assert (dec.feed(ids[:5]) - full[4]).abs().max().item() < 1e-5


def test_the_decoder_does_not_touch_the_model():
    model = _model(n_kv_heads=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dec = SequenceDecoder(model)
    dec.feed(_ids()[:4])
    dec.step(7)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fp32_takes_the_fast_path_and_bf16_the_models_modules():
    model = _model(n_kv_heads=2)
    assert isinstance(CachedLogits(model).fast, SequenceDecoder)
    bf16 = _model(n_kv_heads=2).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32"):
        SequenceDecoder(bf16)
    ids = _ids()
    cached = CachedLogits(bf16)
    assert cached.fast is None
    with torch.inference_mode():
        full = bf16(torch.tensor([ids[:12]]))[0].float()
        first = cached.after(ids[:10]).float()
        assert cached.length == 10
        steps = [cached.after(ids[10:11]).float(), cached.after(ids[11:12]).float()]
    for pos, logits in zip((9, 10, 11), [first, *steps], strict=True):
        assert (logits - full[pos]).abs().max().item() < 1e-2, pos
