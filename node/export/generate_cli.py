"""`murmur generate SOURCE --prompt TEXT`: sample from a checkpoint or export, streaming the text
(node/export/generate.py). Light to import: torch and the model come in once the arguments hold up.
"""

from __future__ import annotations

import argparse
import sys

from murmur.node.export.threads import add_threads_flag, check_threads


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a checkpoint or export",
        description="SOURCE: a checkpoint file, a run or testnet folder, or an export (murmur export). "
        "Prints the prompt, then the sampled text as it comes; the rate goes to stderr.",
    )
    p.add_argument("source", metavar="SOURCE", help="checkpoint file, run folder or export folder")
    p.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample among the fewest tokens whose probability sums to p")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same text (default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context per token (slow; a check)")
    add_threads_flag(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import time

    from murmur.errors import MurmurError

    if args.max_new_tokens < 0:
        raise MurmurError("--max-new-tokens must not be negative")
    check_threads(args.threads)
    from murmur.node.export.generate import Sampling, generate
    from murmur.node.export.source import load_source
    from murmur.node.export.threads import use_threads
    from murmur.node.model.tokenizer import get_tokenizer
    from murmur.node.train.build import resolve_device

    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    device = resolve_device(args.device)
    threads = use_threads(args.threads, device)
    source = load_source(args.source)  # an export's or a checkpoint's checksum is checked here
    source.check_finite()
    tok = get_tokenizer(source.tokenizer)
    model = source.build_model(device)
    prompt = tok.encode(args.prompt) if args.prompt else [tok.eot]
    tokens = generate(
        model, prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
        use_cache=not args.no_cache, vocab_size=tok.vocab_size, stop_token=tok.eot,
    )
    counted = [0]

    def count(it):
        for t in it:
            counted[0] += 1
            yield t

    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    t0 = time.perf_counter()
    for text in stream_text(tok, count(tokens)):
        sys.stdout.write(text)
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    print()
    cache = "no cache" if args.no_cache else "KV cache"
    n = counted[0]
    print(f"{n} tokens in {dt:.2f}s ({n / dt if dt > 0 else 0:,.1f} tok/s, {cache}, {device}, "
          f"{threads} thread{'' if threads == 1 else 's'})", file=sys.stderr)
    return 0


def stream_text(tok, tokens):  # a murmur Tokenizer, an iterator of ids
    """Text as the tokens come; a token that ends inside a UTF-8 character waits for the rest."""
    pending: list[int] = []
    for t in tokens:
        pending.append(t)
        text = tok.decode(pending)
        if not text.endswith("\ufffd"):
            yield text
            pending.clear()
    if pending:
        yield tok.decode(pending)

