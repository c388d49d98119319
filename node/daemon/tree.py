"""Walking nested state: the dicts, lists and tuples a state dict or a checkpoint is made of."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


def map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with dicts, lists and tuples rebuilt and every other value replaced by ``fn(value)``."""
    if isinstance(obj, dict):
        return {k: map_leaves(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_leaves(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_leaves(v, fn) for v in obj)
    return fn(obj)


def leaves(obj: Any) -> Iterator[Any]:
    """Every value in ``obj`` that is not a dict, list or tuple, in `map_leaves`' order."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from leaves(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from leaves(v)
    else:
        yield obj
