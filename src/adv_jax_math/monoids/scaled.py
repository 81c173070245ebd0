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
        for attr in ("arity", "halves", "selects", "axes_all", "reads_twice", "native_kernel"):
            setattr(self, attr, getattr(base, attr))
        if base.combine is not None:
            self.combine = lambda a, b: self.scale * base.combine(a / self.scale, b / self.scale)

    def __repr__(self) -> str:
        return f"adv_jax_math.Scaled({self.base!r}, {self.scale!r})"

    def _times(self, result: Any) -> Any:
        return jax.tree.map(lambda r: r * np.asarray(self.scale, r.dtype), result)

    # the state and its folds are the base monoid's
    def init(self, items: Sequence[jax.ShapeDtypeStruct]) -> State:
        return self.base.init(items)

    def fold(self, ys: Any, idx: Any, w: Any) -> State:
        return self.base.fold(ys, idx, w)

    def fold_fast(self, ys: Any, idx: Any, w: Any, again: Any = None) -> State:
        return self.base.fold_fast(ys, idx, w, again)

    def native_dtype(self, dtype: Any) -> np.dtype:
        return self.base.native_dtype(dtype)

    def fold_native(self, ys: Any, w: Any, kernel: Any) -> State:
        return self.base.fold_native(ys, w, kernel)

    def merge(self, a: State, b: State) -> State:
        return self.base.merge(a, b)

    def merge_fast(self, a: State, b: State) -> State:
        return self.base.merge_fast(a, b)

    def check_rows(self, n: int) -> None:
        self.base.check_rows(n)

    def encode(self, keep: Any, dtype: Any, xp: Any = np) -> Any:
        return self.base.encode(keep, dtype, xp)

    def fills(self, dtypes: Sequence[Any]) -> tuple:
        return self.base.fills(dtypes)

    @property
    def tally(self) -> Any:
        return self.base.tally

    # the result and its derivatives, scaled
    def finalize(self, state: State, items: Sequence[jax.ShapeDtypeStruct]) -> Any:
        return self._times(self.base.finalize(state, items))

    def empty(self, items: Sequence[jax.ShapeDtypeStruct]) -> Any:
        return self._times(self.base.empty(items))

    def tangent(self, ys: Any, dys: Any, idx: Any, keep: Any, state: State, items: Any) -> Any:
        return self.base.tangent(ys, dys, idx, keep, state, items)

    def tangent_init(self, raw: Any) -> Any:
        return self.base.tangent_init(raw)

    def tangent_merge(self, a: Any, b: Any) -> Any:
        return self.base.tangent_merge(a, b)

    def tangent_finish(self, raw: Any, state: State, items: Sequence[Any]) -> Any:
        return self._times(self.base.tangent_finish(raw, state, items))

    def cotangent(
        self, ct: Any, ys: Any, idx: Any, keep: Any, state: State, items: Any, tally: Any = None
    ) -> tuple:
        ct = None if ct is None else self._times(ct)
        return self.base.cotangent(ct, ys, idx, keep, state, items, tally)
