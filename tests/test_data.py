import itertools
import json

import numpy as np
import pytest
import torch

from murmur.node.model.data import BatchLoader, DataError, Dataset, Position, eval_batches, prepare


def _files(root):
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_prepare_is_deterministic(tmp_path):
    a = prepare(tmp_path / "a", shard_tokens=1 << 16)
    b = prepare(tmp_path / "b", shard_tokens=1 << 16)
    assert a == b
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_manifest_describes_the_shards(byte_dataset):
    m = byte_dataset.manifest
    assert m["tokenizer"] == "byte" and m["vocab_size"] == 256
    assert sum(s["tokens"] for s in m["shards"]) == m["total_train_tokens"]
    assert all(s["tokens"] == 1 << 16 for s in m["shards"][:-1])
    byte_dataset.verify()
    # The tokens are the corpus itself (byte tokenizer): readable text comes back.
    text = bytes(byte_dataset.shard(0)[:200].tolist()).decode()
    assert "ACT I" in text


def test_resume_from_position_yields_the_same_batches(byte_dataset):
    shards = [3, 1, 4]
    straight = BatchLoader(byte_dataset, shards, batch_size=4, seq_len=64)
    expected = [next(straight) for _ in range(600)]  # crosses shard boundaries
    first = BatchLoader(byte_dataset, shards, batch_size=4, seq_len=64)
    got = [next(first) for _ in range(250)]
    resumed = BatchLoader(byte_dataset, shards, batch_size=4, seq_len=64, position=Position(**first.position.to_dict()))
    got += [next(resumed) for _ in range(350)]
    for (ex, ey), (gx, gy) in zip(expected, got, strict=True):
        assert torch.equal(ex, gx) and torch.equal(ey, gy)
    assert {b[0].shape for b in got} == {(4, 64)}


def test_targets_are_inputs_shifted_by_one(byte_dataset):
    x, y = next(BatchLoader(byte_dataset, [0], batch_size=2, seq_len=16))
    raw = torch.from_numpy(byte_dataset.shard(0)[:33].astype(np.int64))
    assert torch.equal(x.flatten(), raw[:32]) and torch.equal(y.flatten(), raw[1:33])


def test_loader_without_cycle_stops_at_the_end_of_its_shard(byte_dataset):
    loader = BatchLoader(byte_dataset, [0], batch_size=8, seq_len=128, cycle=False)
    n = sum(1 for _ in itertools.islice(loader, 10_000))
    assert n == (byte_dataset.shard_size(0) - 1) // (8 * 128)


def test_eval_batches_are_fixed(byte_dataset):
    a, b = eval_batches(byte_dataset, 4, 64, 3), eval_batches(byte_dataset, 4, 64, 3)
    assert len(a) == 3 and all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, b, strict=True))


def test_user_sources_and_gpt2_tokenizer(tmp_path):
    src = tmp_path / "docs"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("To be, or not to be, that is the question. " * 400)
    (src / "sub" / "b.md").write_text("# Notes\nSome *markdown* prose about murmur. " * 400)
    (src / "sub" / "c.rst").write_text("Title\n=====\nreStructuredText too. " * 400)
    (src / "skip.py").write_text("print('not text')\n" * 1000)
    m = prepare(tmp_path / "ds", sources=[src], tokenizer="gpt2", shard_tokens=2048)
    assert m["source_files"] == 3 and m["vocab_size"] == 50257
    ds = Dataset.open(tmp_path / "ds")
    tokens = np.concatenate([ds.shard(i) for i in range(ds.num_shards)])
    assert tokens.max() < 50257 and (tokens == 50256).sum() >= 2  # documents are separated


def test_corrupted_shard_is_a_clear_error(tmp_path):
    prepare(tmp_path / "ds", shard_tokens=1 << 16)
    shard = tmp_path / "ds" / "shard_00002.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    ds = Dataset.open(tmp_path / "ds")
    ds.shard(1)  # the others are fine
    with pytest.raises(DataError, match=r"shard 2 .*sha256"):
        ds.shard(2)


def test_missing_or_malformed_dataset_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        Dataset.open(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no manifest.json"):
        Dataset.open(tmp_path / "empty")
    (tmp_path / "empty" / "manifest.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(DataError, match="malformed"):
        Dataset.open(tmp_path / "empty")
    with pytest.raises(DataError, match="no .txt"):
        prepare(tmp_path / "out", sources=[tmp_path / "empty"])


def test_validation_split_covers_every_source(tmp_path):
    """Held out from the whole stream, not its tail: with two sources, both are in the split,
    and a few evaluation batches already read from both."""
    first, last = tmp_path / "first", tmp_path / "last"
    first.mkdir()
    last.mkdir()
    (first / "a.txt").write_text("a" * 300_000)
    (last / "b.txt").write_text("b" * 300_000)
    m = prepare(tmp_path / "ds", sources=[first, last], tokenizer="byte", shard_tokens=1 << 16)
    ds = Dataset.open(tmp_path / "ds")
    val = ds.val()
    assert m["val"]["blocks"] == 2 and len(val) == m["val"]["tokens"] == 6000
    assert set(np.unique(val)) >= {ord("a"), ord("b")}
    train = np.concatenate([ds.shard(i) for i in range(ds.num_shards)])
    assert len(train) + len(val) == 600_002  # two documents, each ended by the end-of-text token
    batches = eval_batches(ds, 2, 64, 2)
    assert len(batches) == 2
    assert (batches[0][0] == ord("a")).all() and (batches[-1][0] == ord("b")).all()
    assert torch.equal(batches[0][0][:, 1:], batches[0][1][:, :-1])  # targets are the inputs shifted


def test_shuffled_prepare_mixes_the_sources_into_every_shard(tmp_path):
    """--shuffle-seed: files cut at paragraph breaks and shuffled, so shards (and the workers that
    read them) no longer see one source after the other; the same seed gives the same dataset."""
    first, last = tmp_path / "first", tmp_path / "last"
    first.mkdir()
    last.mkdir()
    (first / "a.txt").write_text("\n\n".join(["a" * 500] * 600))  # ~300k characters, paragraphs of 500
    (last / "b.txt").write_text("\n\n".join(["b" * 500] * 600))
    args = dict(sources=[first, last], tokenizer="byte", shard_tokens=1 << 16)
    plain = prepare(tmp_path / "plain", **args)
    mixed = prepare(tmp_path / "mixed", **args, shuffle_seed=0, piece_chars=2048)
    again = prepare(tmp_path / "again", **args, shuffle_seed=0, piece_chars=2048)
    assert plain["order"] == "files" and mixed["order"]["shuffle_seed"] == 0 and mixed["order"]["pieces"] > 100
    assert [s["sha256"] for s in mixed["shards"]] == [s["sha256"] for s in again["shards"]]
    assert mixed["total_train_tokens"] + mixed["val"]["tokens"] > plain["total_train_tokens"] + plain["val"]["tokens"]
    ds_plain, ds_mixed = Dataset.open(tmp_path / "plain"), Dataset.open(tmp_path / "mixed")
    assert set(np.unique(ds_plain.shard(0))) == {ord("a"), ord("\n")}  # in order: the first source only
    for i in range(ds_mixed.num_shards):
        assert {ord("a"), ord("b")} <= set(np.unique(ds_mixed.shard(i)))
    text = "".join(map(chr, ds_mixed.shard(0)[:20000].tolist()))
    assert "ab" not in text and "ba" not in text  # cut only at paragraph breaks


def test_cut_pieces_keeps_every_character():
    from murmur.node.model.data import cut_pieces

    text = "one\n\ntwo two\n\nthree three three\n\n" * 50 + "tail without a break " * 40
    pieces = cut_pieces(text, 64)
    assert "".join(pieces) == text and len(pieces) > 10
    assert all(p.endswith("\n\n") for p in pieces[:-1])


PAGE = """<!DOCTYPE html><html><head><title>Site - Page</title><style>p {color: red}</style>
<script>var nav = "menu";</script></head><body>
<div class="related" role="navigation"><ul><li><a href="prev.html">previous</a></li></ul></div>
<div id="banner">Site banner</div>
<div class="body" role="main"><h1>Writing views<a class="headerlink" href="#v">&para;</a></h1>
<p>A view   takes a <em>Web</em>
request &amp; returns a response.<br>It can live anywhere.</p>
<pre>def view(request):
    return HttpResponse("hi")</pre>
<img src="x.png"></p></span><p>Caf&eacute; &lt;tags&gt; stay text.</p></div>
<div class="sphinxsidebar"><h3>Search</h3><form><input name="q"></form></div>
<footer>Copyright</footer></body></html>"""


def test_html_pages_are_read_as_their_prose_without_navigation():
    """Much of the prose Debian ships is HTML only (benchmarks/quality_corpus.sh): its text is
    kept, paragraphs on their own lines and code blocks as they are; the navigation every page
    repeats, scripts and styles are left out; stray end tags do no harm."""
    from murmur.node.model.html_text import html_text

    text = html_text(PAGE)
    assert text == (
        "Writing views\n\nA view takes a Web request & returns a response.\nIt can live anywhere.\n\n"
        'def view(request):\n    return HttpResponse("hi")\n\nCafé <tags> stay text.\n'
    )


def test_prepare_reads_html_sources(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    (src / "page.html").write_text(PAGE.replace("It can live anywhere.", "It can live anywhere. " * 300))
    (src / "a.txt").write_text("To be, or not to be, that is the question. " * 400)
    m = prepare(tmp_path / "ds", sources=[src], tokenizer="byte", shard_tokens=2048)
    assert m["source_files"] == 2
    ds = Dataset.open(tmp_path / "ds")
    raw = bytes(np.concatenate([ds.shard(i) for i in range(ds.num_shards)] + [ds.val()]).astype(np.uint8))
    assert b"It can live anywhere." in raw and b"sphinxsidebar" not in raw and b"previous" not in raw
