#!/usr/bin/env bash
# The quality benchmark's corpus: the bundled Shakespeare + Debian's documentation sources (English
# prose): Python 3.11 and Linux 6.1 (~32 MB of text, 13.4M GPT-2 tokens), Perl's manual pages
# (8.8 MB of POD, read as text) and git's manual (2.9 MB of AsciiDoc text): about 18M tokens by
# the same ratio, still short of the 30M+ that issue 18's rows need without repeating data.
# GPT-2 tokens in data/quality-gpt2, cut into ~16k-character pieces at paragraph breaks and
# shuffled (seed 0) so every shard mixes the sources. The data is never committed. Needs apt
# (Debian/Ubuntu) and the network; run from the repository root after `make install`.
# `murmur data prepare` prints the size it reaches.
#   bash benchmarks/quality_corpus.sh [OUT_DIR]
set -euo pipefail
out="${1:-data/quality-gpt2}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download python3.11-doc linux-doc-6.1 perl-doc git-doc >/dev/null)
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/x"; done
# POD is plain prose with =head/=item markers; data prepare reads .txt/.md/.rst, so copy it as .txt.
mkdir -p "$work/perl"
find "$work/x/usr/share/perl" -name '*.pod' -print0 | while IFS= read -r -d '' f; do
  cp "$f" "$work/perl/$(basename "$f" .pod).txt"
done
.venv/bin/murmur data prepare --out "$out" --tokenizer gpt2 \
  --shuffle-seed 0 --source murmur/assets/corpus/shakespeare.txt \
  --source "$work/x/usr/share/doc/python3.11/html/_sources" \
  --source "$work/x/usr/share/doc/linux-doc-6.1/html/_sources" \
  --source "$work/perl" \
  --source "$work/x/usr/share/doc/git-doc"
