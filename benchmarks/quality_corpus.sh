#!/usr/bin/env bash
# The quality benchmark's corpus (issue 18 asks for 30M+ tokens, so that rows do not repeat data):
# the bundled Shakespeare and the English prose of Debian's documentation packages:
#   Python 3.11 and Linux 6.1 (reStructuredText sources), Perl's manual pages (POD, read as text),
#   git's manual (AsciiDoc text), CMake, Sphinx and SQLAlchemy (reStructuredText sources), the
#   Debian Developer's Reference and Policy (reStructuredText sources), and manuals shipped as HTML
#   only, read as their prose (node/model/html_text.py): Django's (without _modules, its
#   highlighted-source pages), the Debian Administrator's Handbook and the Debian Reference (English
#   pages), PostgreSQL 15's, Node.js's API pages, SQLite's, Rust's mdBooks (not its API pages),
#   GNU Octave's, R's manuals and SciPy's.
# GPT-2 tokens in data/quality-gpt2, cut into ~16k-character pieces at paragraph breaks and
# shuffled (seed 0) so every shard mixes the sources. The data is never committed. Needs apt
# (Debian/Ubuntu) and the network; run from the repository root after `make install`.
# `murmur data prepare` prints the size it reaches: 30,403,762 train tokens and 307,100 validation
# tokens (116 shards, 16719 files; measured 2026-12-02; 59 MB, 21.2M before PostgreSQL..SciPy
# were added). Pandas' user guide and release notes would add ~0.8M more.
#   bash benchmarks/quality_corpus.sh [OUT_DIR]
set -euo pipefail
out="${1:-data/quality-gpt2}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download python3.11-doc linux-doc-6.1 perl-doc git-doc \
  cmake-doc sphinx-doc python-sqlalchemy-doc python-django-doc debian-handbook \
  postgresql-doc-15 nodejs-doc sqlite3-doc debian-reference-en rust-doc octave-doc r-doc-html \
  developers-reference debian-policy python-scipy-doc >/dev/null)
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
# Node.js's API pages without all.html (every page again in one); SQLite's pages without c3ref/
# (capi3ref.html holds the same C API in one page).
mkdir -p "$work/node" "$work/sqlite"
find "$work/x/usr/share/doc/nodejs/api" -name '*.html' ! -name all.html -exec cp {} "$work/node/" \;
cp "$work/x/usr/share/doc/sqlite3/"*.html "$work/sqlite/"
# Rust's mdBooks (the book, the reference, the nomicon, Rust by Example, the rustc, embedded and
# edition guides; not the API pages): print.html repeats each book whole, and the <html> element's
# class "sidebar-visible" would make html_text drop the whole page as navigation.
mkdir -p "$work/rust"
for b in book reference nomicon rust-by-example rustc embedded-book edition-guide; do
  cp -r "$work/x/usr/share/doc/rust-doc/html/$b" "$work/rust/"
done
find "$work/rust" -name print.html -delete
find "$work/rust" -name '*.html' -exec sed -i 's/<html lang="en" class="sidebar-visible[^"]*"/<html lang="en"/' {} +
# SciPy's manual without its index and search pages.
mkdir -p "$work/scipy"
cp -r "$work/x/usr/share/doc/python-scipy-doc/html/"{dev,reference,tutorial} "$work/scipy/"
find "$work/x/usr/share/doc/python-scipy-doc/html" -maxdepth 1 -name '*.html' ! -name genindex.html \
  ! -name search.html -exec cp {} "$work/scipy/" \;
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
  --source "$work/x/usr/share/doc/debian-handbook/html/en-US" \
  --source "$work/x/usr/share/doc/postgresql-doc-15/html" \
  --source "$work/node" \
  --source "$work/sqlite" \
  --source "$work/x/usr/share/debian-reference" \
  --source "$work/rust" \
  --source "$work/x/usr/share/doc/octave/octave.html" \
  --source "$work/x/usr/share/doc/r-doc-html/manual" \
  --source "$work/x/usr/share/developers-reference/_sources" \
  --source "$work/x/usr/share/doc/debian-policy/policy.html/_sources" \
  --source "$work/scipy"
