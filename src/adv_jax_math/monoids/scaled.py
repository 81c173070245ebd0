"""A monoid's result times a constant: ``eps * logsumexp(s / eps)`` (a temperature).

OTT-JAX's Sinkhorn step reduces ``eps * jax.nn.logsumexp(s / eps, axis=0)``. The
``s / eps`` is an elementwise prologue (``analysis.recognize``); the ``eps *`` after the
reduction is what :class:`Scaled` adds: the state is the base monoid's (of the
prologue's values), the result ``scale`` times its result, and the derivatives
scaled alike (``scale`` a constant: it gets no derivative of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .base import Monoid, State

__all__ = ["Scaled"]


class Scaled(Monoid):
    """``scale * base``'s result, ``scale`` a concrete float (``base`` a monoid whose
    result is one float array: the logsumexp)."""

    def __init__(self, base: Monoid, scale: float):
        self.base, self.scale = base, float(scale)
        self.name = f"{self.scale:g} * {base.name}"
        for attr in ("arity", "halves", "selects", "reads_twice", "native_kernel"):
            setattr(self, attr, getattr(base, attr))
        if base.combine is not None:
            self.combine = lambda a, b: self.scale * base.combine(a / self.scale, b / self.scale)

    def __repr__(self) -> str:
        return f"adv_jax_math.Scaled({self.base!r}, {self.scale!r})"

    def _times(self, result: Any) -> Any:
        return jax.tree.map(lambda r: r * np.asarray(self.scale, r.dtype), result)

    @property
    def tally(self) -> Any:
        return self.base.tally

    # the result and its derivatives, scaled
    def finalize(self, state: State, items: Sequence[jax.ShapeDtypeStruct]) -> Any:
        return self._times(self.base.finalize(state, items))

    def empty(self, items: Sequence[jax.ShapeDtypeStruct]) -> Any:
        return self._times(self.base.empty(items))

    def tangent_finish(self, raw: Any, state: State, items: Sequence[Any]) -> Any:
        return self._times(self.base.tangent_finish(raw, state, items))

    def cotangent(
        self, ct: Any, ys: Any, idx: Any, keep: Any, state: State, items: Any, tally: Any = None
    ) -> tuple:
        ct = None if ct is None else self._times(ct)
        return self.base.cotangent(ct, ys, idx, keep, state, items, tally)


def _delegated(name: str) -> Any:
    def method(self: Scaled, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.base, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


# the state, its folds and merges, the row weights and the tangent's shares are the
# base monoid's (only the result and its derivatives are scaled)
_BASE = (
    "init",
    "fold",
    "fold_fast",
    "fold_into",
    "native_dtype",
    "fold_native",
    "merge",
    "merge_fast",
)
for _name in (*_BASE, "check_rows", "encode", "fills", "tangent", "tangent_init", "tangent_merge"):
    setattr(Scaled, _name, _delegated(_name))
