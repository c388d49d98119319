"""`murmur generate` and the KV cache: cached logits equal a full forward's, greedy decoding gives the
same tokens with and without the cache (across context restarts too), a seed fixes the text, and a
prompt longer than the context is one line with nothing printed."""

from __future__ import annotations

import pytest
import torch
from _model_helpers import trained_tiny

from murmur.cli import main
from murmur.node.export.generate import Sampling, generate, pick
from murmur.node.model.kv_cache import KVCache, decode
from murmur.node.model.transformer import Transformer, model_config

PROMPT = "ROMEO:\nBut soft"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory, byte_dataset):
    """A briefly trained tiny model with grouped-query attention and a 32-token context."""
    folder = tmp_path_factory.mktemp("run")
    trainer = trained_tiny(byte_dataset, folder, 8, seq_len=32, n_kv_heads=2)
    return folder, trainer.model.eval()


def test_cached_logits_equal_a_full_forward():
    model = Transformer(model_config("tiny", seq_len=24, n_kv_heads=2), seed=3).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model, batch=2)
    # A prefill, a chunk, then one token at a time: every way in which the cache is filled.
    parts = [decode(model, ids[:, :9], cache), decode(model, ids[:, 9:12], cache)]
    parts += [decode(model, ids[:, i : i + 1], cache) for i in range(12, 24)]
    with torch.no_grad():
        full = model(ids)
    assert (torch.cat(parts, dim=1) - full).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="do not fit"):
        decode(model, ids[:, :1], cache)


def test_greedy_with_the_cache_equals_greedy_without(run):
    _, model = run
    prompt = list(PROMPT.encode())
    greedy = Sampling(temperature=0)
    # 70 tokens past a 15-token prompt in a 32-token context: the context restarts four times.
    cached = list(generate(model, prompt, max_new_tokens=70, sampling=greedy, use_cache=True))
    plain = list(generate(model, prompt, max_new_tokens=70, sampling=greedy, use_cache=False))
    assert len(cached) == 70 and cached == plain
    top1 = list(generate(model, prompt, max_new_tokens=70, sampling=Sampling(temperature=1.0, top_k=1)))
    assert top1 == cached


def test_top_p_keeps_the_fewest_tokens_that_reach_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    picks = {pick(logits, Sampling(temperature=1.0, top_p=0.75), gen) for _ in range(200)}
    assert picks == {0, 1}


def _generate(capsys, folder, *extra: str) -> str:
    argv = ["generate", str(folder), "--prompt", PROMPT, "--max-new-tokens", "40", "--device", "cpu", *extra]
    assert main(argv) == 0
    return capsys.readouterr().out


def test_a_seed_fixes_the_text(run, capsys):
    folder, _ = run
    first = _generate(capsys, folder, "--seed", "7", "--top-k", "40", "--top-p", "0.95")
    again = _generate(capsys, folder, "--seed", "7", "--top-k", "40", "--top-p", "0.95")
    other = _generate(capsys, folder, "--seed", "8", "--top-k", "40", "--top-p", "0.95")
    assert first.startswith(PROMPT) and len(first) > len(PROMPT)
    assert first == again and first != other


def test_a_prompt_longer_than_the_context_is_one_line(run, capsys):
    folder, _ = run
    assert main(["generate", str(folder), "--prompt", "x" * 33, "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (
        "error: the prompt is 33 tokens and the model's context is 32: shorten the prompt"
    )


def test_generate_uses_one_thread_on_the_cpu_unless_told(run, capsys):
    """torch's default threads are 20-200x slower on busy cores (benchmarks/generate_busy.py): the
    default is one on the CPU whatever the process had; --threads N sets N, and a negative N is one line."""
    folder, _ = run
    torch.set_num_threads(2)  # what torch picks on a 2-core machine; the module fixture restores its own
    argv = ["generate", str(folder), "--max-new-tokens", "4", "--device", "cpu"]
    assert main(argv) == 0
    assert torch.get_num_threads() == 1 and capsys.readouterr().err.rstrip().endswith(", cpu, 1 thread)")
    assert main([*argv, "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2 and capsys.readouterr().err.rstrip().endswith(", cpu, 2 threads)")
    assert main([*argv, "--threads", "-1"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "error: --threads must not be negative, not -1 (0: torch's default)"
