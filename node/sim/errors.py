"""The simulator's one error type, in a module of its own so that `murmur sim`'s command line can
refuse bad input (node/sim/cli.py) without importing torch, which every engine module does."""

from __future__ import annotations

from murmur.errors import MurmurError


class SimError(MurmurError):
    pass
