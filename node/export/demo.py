"""The end of `murmur testnet up` (so of `make demo`): the run's model exported, and a few lines of
what it writes.

Seconds at most: the tiny and small presets export in well under a second and sample ~100 tokens
with the KV cache in a fraction of one; importing torch in the testnet's own process is the rest.
"""

from __future__ import annotations

from pathlib import Path

import torch

from murmur.node.export.generate import Sampling, generate
from murmur.node.export.source import Source, load_source
from murmur.node.export.write import export
from murmur.node.model.tokenizer import get_tokenizer

SAMPLE_TOKENS = 120
SAMPLING = Sampling(temperature=0.8, top_k=40)


def export_and_sample(run_folder: Path, *, tokens: int = SAMPLE_TOKENS, seed: int = 0) -> tuple[Path, Source, str]:
    """Export the newest node's state of the testnet at ``run_folder`` to ``run_folder/model`` and
    sample ``tokens`` tokens from it, starting a new document."""
    threads = torch.get_num_threads()
    # One thread: a demo model's ops are too small to split, and threads that wait on each other
    # on a busy machine cost seconds (measured: 7 s against 1.1-1.7 s for this, at load 15 on 2 cores).
    torch.set_num_threads(1)
    try:
        source = load_source(run_folder)
        out = export(source, run_folder / "model", dtype=torch.float32, force=True)
        tok = get_tokenizer(source.tokenizer)
        model = source.build_model()
        ids = generate(model, [tok.eot], max_new_tokens=tokens, sampling=SAMPLING, seed=seed,
                       vocab_size=tok.vocab_size, stop_token=tok.eot)
        return out, source, tok.decode(list(ids))
    finally:
        torch.set_num_threads(threads)
