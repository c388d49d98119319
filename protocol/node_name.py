"""A node's human-readable name (`murmur node run --name`), shown beside its id by `murmur admin`
and the status page. Checked by the node before it joins and by the coordinator at the join: a
name is for people, never an identity (the id comes from the node's key), so it need not be unique.
"""

from __future__ import annotations

import re

from murmur.errors import MurmurError

MAX_NAME_CHARS = 40
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._@'-]*")


def check_node_name(name: str) -> str:
    """``name`` without surrounding spaces, or a one-line error saying what a name may hold."""
    name = name.strip()
    if name and (len(name) > MAX_NAME_CHARS or not _NAME.fullmatch(name)):
        raise MurmurError(
            f"--name {name[:MAX_NAME_CHARS + 5]!r}: at most {MAX_NAME_CHARS} characters, starting with a letter or "
            "digit, then letters, digits, spaces and . _ - @ '"
        )
    return name
