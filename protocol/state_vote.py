"""Which state a run holds now, from what its members claim: the newest round any of them holds
and, within it, the state hash most of them announce (a lone liar is outvoted). A joiner's fetch
(node/daemon/peer_dataplane.py) and the coordinator's reader pass (coordinator/membership.py) ask
the same question of different records."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


def agreed_state(claims: Iterable[tuple[int, str]]) -> tuple[int, str]:
    """(round, state hash) from (round, state hash) claims; at least one claim."""
    claims = list(claims)
    newest = max(r for r, _ in claims)
    votes = Counter(h for r, h in claims if r == newest)
    return newest, votes.most_common(1)[0][0]
