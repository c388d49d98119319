"""The wire protocol's version: carried by every handshake, refused by name on a mismatch.

Bump PROTOCOL_VERSION whenever a message or a rule changes in a way an older peer would
misread (a renamed field, a new required part, a changed chunking rule). Adding an optional field
that old peers may ignore does not need a bump.

Every RPC carries the version in gRPC metadata under VERSION_METADATA_KEY (and the handshake
messages repeat it in a field), so a mismatch is caught before any payload is read.
"""

from __future__ import annotations

from murmur.errors import MurmurError

PROTOCOL_VERSION = 1
VERSION_METADATA_KEY = "murmur-protocol-version"


class VersionMismatch(MurmurError):
    """The other side speaks a different protocol version; both versions are in the message."""

    def __init__(self, ours: int, theirs: int | str | None, who: str = "peer") -> None:
        self.ours = ours
        self.theirs = theirs
        super().__init__(
            f"protocol version mismatch: this node speaks v{ours}, the {who} speaks "
            f"{'v' + str(theirs) if theirs not in (None, '') else 'no version'}; "
            "run the same murmur release on both sides"
        )


def parse_version(value: int | str | bytes | None) -> int | None:
    """The version a peer sent (metadata values arrive as str); None when absent or unreadable."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def check_version(theirs: int | str | bytes | None, who: str = "peer") -> None:
    """Raise VersionMismatch unless ``theirs`` is exactly this build's PROTOCOL_VERSION."""
    parsed = parse_version(theirs)
    if parsed != PROTOCOL_VERSION:
        raise VersionMismatch(PROTOCOL_VERSION, parsed if parsed is not None else theirs, who)


def version_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata to attach to every outgoing call."""
    return ((VERSION_METADATA_KEY, str(PROTOCOL_VERSION)),)
