"""Argument checks shared by every public entry point."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

__all__ = ["batch_size_from"]


def batch_size_from(batch_size: Any, kwargs: Mapping[str, Any]) -> int | None:
    """Validate ``batch_size`` and the ``chunk_size`` alias; reject other kwargs.

    ``chunk_size`` is used only when ``batch_size`` is None (``batch_size`` wins).
    """
    unexpected = sorted(set(kwargs) - {"chunk_size"})
    if unexpected:
        raise ValueError(
            f"unexpected keyword argument(s) {', '.join(map(repr, unexpected))}; "
            "the only extra keyword accepted is 'chunk_size' (an alias of batch_size)"
        )
    if batch_size is None:
        batch_size = kwargs.get("chunk_size")
        name = "chunk_size"
    else:
        name = "batch_size"
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not _is_integer(batch_size):
        raise TypeError(
            f"{name}={batch_size!r} must be a positive int or None, not {type(batch_size).__name__}"
        )
    batch_size = operator.index(batch_size)
    if batch_size < 1:
        raise ValueError(f"{name}={batch_size} must be a positive int or None")
    return batch_size


def _is_integer(x: Any) -> bool:
    try:
        operator.index(x)
    except TypeError:
        return False
    return True
