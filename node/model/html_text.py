"""The prose of a generated documentation page (Sphinx, DocBook/Publican), for `murmur data prepare`.

Much of the English prose that Debian packages ship is HTML only (Django's manual, the Debian
Administrator's Handbook). A corpus needs its text, not its markup, and not the navigation that
every page repeats (sidebars, "previous/next" bars, search boxes, headers and footers): a model
would learn those by heart. So this keeps the text of the page and drops what is inside
``script``/``style``/``nav``/``header``/``footer`` elements and inside elements whose class or id
names navigation. Block elements end lines; runs of spaces collapse except inside ``pre``.
Built on the standard library's tolerant HTMLParser: no new dependency for a small job.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

SKIP_TAGS = frozenset({"script", "style", "nav", "header", "footer", "head", "noscript", "form", "button"})
# Class or id words of navigation in Sphinx and Publican pages (matched as substrings).
SKIP_MARKS = ("sidebar", "related", "nav", "headerlink", "search", "footer", "banner", "breadcrumb")
VOID_TAGS = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
                       "track", "wbr"})
BLOCK_TAGS = frozenset({"p", "div", "section", "article", "li", "ul", "ol", "dl", "dt", "dd", "pre", "table",
                        "tr", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "br", "hr", "title"})


class _Extractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool]] = []  # open elements: (tag, skipped)
        self.parts: list[str] = []
        self.pre = 0

    def _skipping(self) -> bool:
        return bool(self.stack) and self.stack[-1][1]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in BLOCK_TAGS and not self._skipping():
            self.parts.append("\n")
        if tag in VOID_TAGS:
            return
        marks = " ".join(v or "" for k, v in attrs if k in ("class", "id", "role")).lower()
        skip = self._skipping() or tag in SKIP_TAGS or any(m in marks for m in SKIP_MARKS)
        self.stack.append((tag, skip))
        if tag == "pre":
            self.pre += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID_TAGS or not any(t == tag for t, _ in self.stack):
            return  # a stray end tag: nothing to close
        while self.stack:
            t, skipped = self.stack.pop()
            if t == "pre":
                self.pre -= 1
            if t == tag:
                if tag in BLOCK_TAGS and not skipped:
                    self.parts.append("\n")
                return

    def handle_data(self, data: str) -> None:
        if self._skipping():
            return
        self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_text(markup: str) -> str:
    """The page's text: paragraphs on their own lines, navigation and scripts left out."""
    parser = _Extractor()
    parser.feed(markup)
    parser.close()
    lines = [line.rstrip() for line in "".join(parser.parts).splitlines()]
    text = "\n".join(line if line.strip() else "" for line in lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
