#!/usr/bin/env bash
# The quality benchmark's corpus: the bundled Shakespeare + Debian's Python 3.11 and Linux 6.1
# documentation sources (English prose, ~32 MB of text), as GPT-2 tokens in data/quality-gpt2, cut
# into ~16k-character pieces at paragraph breaks and shuffled (seed 0) so every shard mixes them.
# Needs apt (Debian/Ubuntu) and the network; run from the repository root after `make install`.
#   bash benchmarks/quality_corpus.sh [OUT_DIR]
set -euo pipefail
out="${1:-data/quality-gpt2}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download python3.11-doc linux-doc-6.1 >/dev/null)
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/x"; done
.venv/bin/murmur data prepare --out "$out" --tokenizer gpt2 \
  --shuffle-seed 0 --source murmur/assets/corpus/shakespeare.txt \
  --source "$work/x/usr/share/doc/python3.11/html/_sources" \
  --source "$work/x/usr/share/doc/linux-doc-6.1/html/_sources"
