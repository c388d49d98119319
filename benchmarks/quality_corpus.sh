#!/usr/bin/env bash
# The quality benchmark's corpus (issue 18 asks for 30M+ tokens, so that rows do not repeat data):
# the bundled Shakespeare and the English prose of Debian's documentation packages:
#   Python 3.11 and Linux 6.1 (reStructuredText sources), Perl's manual pages (POD, read as text),
#   git's manual (AsciiDoc text), CMake, Sphinx and SQLAlchemy (reStructuredText sources), and
#   two manuals shipped as HTML only, Django's and the Debian Administrator's Handbook (English
#   pages), read as their prose (node/model/html_text.py; Django's highlighted-source pages
#   under _modules are left out).
# GPT-2 tokens in data/quality-gpt2, cut into ~16k-character pieces at paragraph breaks and
# shuffled (seed 0) so every shard mixes the sources. The data is never committed. Needs apt
# (Debian/Ubuntu) and the network; run from the repository root after `make install`.
# `murmur data prepare` prints the size it reaches: 21,243,841 train tokens (82 shards, 7041 files;
# measured 2026-12-02), still short of the 30M that issue 18 asks for. SciPy's HTML manual would add
# only ~1.6M tokens of prose (102 MB of markup), pandas' user guide and release notes ~0.8M.
#   bash benchmarks/quality_corpus.sh [OUT_DIR]
set -euo pipefail
out="${1:-data/quality-gpt2}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download python3.11-doc linux-doc-6.1 perl-doc git-doc \
  cmake-doc sphinx-doc python-sqlalchemy-doc python-django-doc debian-handbook >/dev/null)
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/x"; done
# POD is plain prose with =head/=item markers; data prepare reads .txt/.md/.rst/.html, so copy it as .txt.
mkdir -p "$work/perl"
find "$work/x/usr/share/perl" -name '*.pod' -print0 | while IFS= read -r -d '' f; do
  cp "$f" "$work/perl/$(basename "$f" .pod).txt"
done
# git's manual ships as AsciiDoc text and as HTML made from it: the text only, once.
mkdir -p "$work/git"
find "$work/x/usr/share/doc/git-doc" -name '*.txt' -exec cp {} "$work/git/" \;
# Django's manual without _modules (its code listings as HTML) and the generated index pages.
mkdir -p "$work/django"
for d in faq howto internals intro misc ref releases topics; do
  cp -r "$work/x/usr/share/doc/python-django-doc/html/$d" "$work/django/"
done
.venv/bin/murmur data prepare --out "$out" --tokenizer gpt2 \
  --shuffle-seed 0 --source murmur/assets/corpus/shakespeare.txt \
  --source "$work/x/usr/share/doc/python3.11/html/_sources" \
  --source "$work/x/usr/share/doc/linux-doc-6.1/html/_sources" \
  --source "$work/perl" \
  --source "$work/git" \
  --source "$work/x/usr/share/doc/cmake-data/html/_sources" \
  --source "$work/x/usr/share/doc/sphinx-doc/html/_sources" \
  --source "$work/x/usr/share/doc/python-sqlalchemy-doc/rst" \
  --source "$work/django" \
  --source "$work/x/usr/share/doc/debian-handbook/html/en-US"
