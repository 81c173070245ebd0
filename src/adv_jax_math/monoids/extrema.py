"""Extrema and arg-extrema: ``MAX``, ``MIN`` (derivatives shared evenly by tied
rows), ``ARGMIN``, ``ARGMAX``, ``MIN_ARGMIN``, ``MAX_ARGMAX`` (global row indices,
the first on ties), and the :class:`Tally` a max/min's reverse pass selects rows by."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .base import Monoid, _col, index_dtype
from .numerics import Items, _float, _full, _inexact, _spread, _weigh, _wide

__all__ = [
    "ARGMAX",
    "ARGMIN",
    "MAX",
    "MAX_ARGMAX",
    "MIN",
    "MIN_ARGMIN",
    "ArgExtremum",
    "Extremum",
    "Tally",
    "nan_weights",
]


def nan_weights(hit: jax.Array, total: jax.Array) -> jax.Array:
    """The weights of the rows tied for a max/min ``total`` (``hit``: 1 or 0), NaN for
    every row when the total is NaN: then no row ties, and ``jax.grad(jnp.max)`` is NaN
    everywhere (0/0). Written as a NaN weight, not left to ``0 * (1 / 0)``: XLA may
    rewrite a product with a 0/1 indicator as a select, which drops the NaN."""
    return jnp.where(jnp.isnan(total), jnp.nan, hit).astype(hit.dtype)


def _extreme(dtype: Any, lowest: bool) -> Any:
    """The lowest (or highest) value of ``dtype``: -inf for floats."""
    dtype = np.dtype(dtype)
    if _inexact(dtype):
        return -np.inf if lowest else np.inf
    if dtype == np.bool_:
        return not lowest
    return jnp.iinfo(dtype).min if lowest else jnp.iinfo(dtype).max


def _scalar_safe(y: jax.Array) -> jax.Array:
    """Rows reduced to a 0-d state, in a 32-bit type where they are narrower (exact:
    16-bit floats to float32, 8/16-bit integers to int32): Mosaic makes scalars of
    32-bit vectors only ("Only arrays with 32-bit element types can be converted to
    scalars")."""
    dtype = np.dtype(y.dtype)
    if y.ndim != 1 or dtype.itemsize >= 4 or dtype == np.bool_:
        return y
    return y.astype(np.float32 if _inexact(dtype) else np.int32)


class _Ordered(Monoid):
    """A monoid of the largest (``largest``) or smallest rows: ``_join`` and ``_pick``
    the elementwise and the reducing max (or min); rows that do not exist hold the
    lowest (highest) value of their dtype."""

    def __init__(self, largest: bool, name: str):
        self.largest, self.name = largest, name
        self._join, self._pick = (jnp.maximum, jnp.max) if largest else (jnp.minimum, jnp.min)

    def fill(self, dtype: Any) -> Any:
        return np.asarray(_extreme(dtype, lowest=self.largest), dtype)[()]


# -- max / min --------------------------------------------------------------------------
class Extremum(_Ordered):
    """``jnp.max(y, 0)`` (``largest``) or ``jnp.min(y, 0)``; the derivative is shared
    evenly by every tied row, as ``jax.grad(jnp.max)``, and is NaN everywhere when
    the result is NaN."""

    # halves: on the scan engine's overlapping chunks a shared row's two copies each
    # take half its share of the derivative (exact), not all of it and none: a copy
    # of cotangent 0 meets fun's infinite partial derivatives there (a tied row's
    # t * log(0)) as 0 * inf = NaN in reverse mode. The values ignore repeats.
    selects, halves = True, True

    def __init__(self, largest: bool):
        super().__init__(largest, "max" if largest else "min")
        self.combine, self.reduce = self._join, self._pick

    def result_dtype(self, dtype: Any) -> np.dtype:
        return np.dtype(dtype)

    def init(self, items: Items) -> Any:
        return (_full(items[0], self.fill(items[0].dtype)),)

    def encode(self, keep: Any, dtype: Any, xp: Any = np) -> Any:
        return None  # idempotent: a row seen twice changes nothing

    def fold(self, ys, idx, w) -> Any:
        return (self._pick(_scalar_safe(ys[0]), axis=0).astype(ys[0].dtype),)

    def merge(self, a: Any, b: Any) -> Any:
        return (self._join(a[0], b[0]),)

    def finalize(self, state: Any, items: Items) -> Any:
        return state[0]

    @property
    def tally(self) -> Any:
        return Tally(self.largest)

    def cotangent(self, ct, ys, idx, keep, state, items, tally=None) -> tuple:
        y = ys[0]
        if ct is None or not _inexact(y.dtype):
            return (None,)
        share = nan_weights(self.tally.selected(y, idx, tally), _spread(state[0], y))
        share = share * _spread(tally[3], y)
        return (_weigh(_spread(ct, y) * share.astype(y.dtype), keep),)

    def tangent(self, ys, dys, idx, keep, state, items) -> Any:
        return _tie_shares(self._pick, ys[0], dys[0], keep, state[0])

    def tangent_init(self, raw: Any) -> Any:
        return _tie_init(self.fill, raw)

    def tangent_merge(self, a: Any, b: Any) -> Any:
        return _merge_ties(self._join, a, b)

    def tangent_finish(self, raw: Any, state: Any, items: Items) -> Any:
        return raw[1] / raw[2]


# The derivative of a max (min): every row equal to it shares the derivative evenly,
# as jax.grad(jnp.max) shares it. The tied rows are found among the values the tangent
# pass computes itself (a block's top, merged across blocks), never by comparing them
# with the forward pass's result: two compilations of fun may differ in the last bit.
def _tie_shares(pick: Any, y: jax.Array, dy: jax.Array, keep: Any, total: jax.Array) -> tuple:
    """``(top, sum of dy over the rows equal to top, their count)`` of one block (a
    repeated row's copy, keep 0, counts 0); every row is NaN when the forward result
    is NaN (then no row ties and the derivative is NaN everywhere, 0/0). The rows are
    stored once: XLA fused a cheap ``fun`` into each reduction reading them, rounded
    differently in each, and a row tied in the count was not in the sum (0)."""
    y = lax.optimization_barrier(y)
    top = pick(y, axis=0)
    hit = (y == _spread(top, y)).astype(dy.dtype)
    if keep is not None:
        hit = hit * _col(keep, hit).astype(dy.dtype)
    weights = nan_weights(hit, _spread(total, hit))
    return top, jnp.sum(_times(dy, weights), axis=0), jnp.sum(hit, axis=0)


def _times(t: jax.Array, weight: jax.Array) -> jax.Array:
    """``t * weight`` where a weight 0 drops ``t`` even when it is infinite or NaN (the
    tangent ``t * log(0)`` of a row not selected), as ``jax.jvp(jnp.max)``."""
    return jnp.where(weight == 0, jnp.zeros_like(t), t * weight)


def _tie_init(fill: Any, raw: Any) -> Any:
    top, s, n = raw
    return jnp.full(top.shape, fill(top.dtype), top.dtype), jnp.zeros_like(s), jnp.zeros_like(n)


def _merge_ties(join: Any, a: Any, b: Any) -> tuple:
    (ta, sa, na), (tb, sb, nb) = a, b
    top = join(ta, tb)
    in_a = (ta == top).astype(sa.dtype)  # both when tied across blocks
    in_b = (tb == top).astype(sb.dtype)
    return top, _times(sa, in_a) + _times(sb, in_b), na * in_a + nb * in_b


class Tally(_Ordered):
    """Per element, the extremum of the rows, the first row holding it and how many
    rows do: what a max/min's reverse pass selects rows by (``Monoid.tally``). A
    row is selected by its index when it alone holds the extremum, and only among
    ties by its value (the reverse pass recomputes ``fun``, possibly a last bit off:
    see :meth:`selected`)."""

    def __init__(self, largest: bool):
        super().__init__(largest, "tally_max" if largest else "tally_min")

    def init(self, items: Items) -> Any:
        big = np.iinfo(index_dtype()).max
        count = _full(items[0], 0, _wide(_float(items[0].dtype)))
        return (
            _full(items[0], self.fill(items[0].dtype)),
            _full(items[0], big, index_dtype()),
            count,
        )

    def encode(self, keep: Any, dtype: Any, xp: Any = np) -> Any:
        return xp.asarray(keep).astype(_wide(_float(dtype)))

    def fold(self, ys, idx, w) -> Any:
        y = ys[0]
        big = np.iinfo(index_dtype()).max
        rows = jnp.broadcast_to(_col(idx.astype(index_dtype()), y), y.shape)
        top = self._pick(y, axis=0)
        hit = y == _spread(top, y)
        first = jnp.min(jnp.where(hit, rows, big), axis=0)
        count = hit.astype(_wide(_float(y.dtype)))
        count = jnp.sum(count if w is None else count * _col(w, count), axis=0)
        return top, first, count

    def fold_fast(self, ys, idx, w, again=None) -> Any:
        """:meth:`fold` over values computed once (outside kernels: an optimization
        barrier). XLA may compute them again in each of the three reductions, in loops
        that can round differently: at -O0 (``jax_disable_most_optimizations``) a
        tile's count came out 0 for a top whose first row was found, and the max's
        gradient NaN (tests/test_pairwise.py)."""
        return self.fold([lax.optimization_barrier(ys[0])], idx, w)

    def merge(self, a: Any, b: Any) -> Any:
        (ta, fa, na), (tb, fb, nb) = a, b
        top = self._join(ta, tb)
        big = np.iinfo(index_dtype()).max
        in_a, in_b = ta == top, tb == top  # both when tied across blocks
        first = jnp.minimum(jnp.where(in_a, fa, big), jnp.where(in_b, fb, big))
        return top, first, na * in_a.astype(na.dtype) + nb * in_b.astype(nb.dtype)

    def finalize(self, state: Any, items: Items) -> Any:
        return state

    def shares(self, state: Any, over_all: bool) -> tuple:
        """The final state (per element) with each element's share of the derivative
        appended: ``1 / count``, or over every axis ``1 / (rows tied anywhere)`` for
        the elements holding the overall extremum and 0 for the others."""
        top, first, count = state
        if not over_all:
            return top, first, count, 1 / count
        held = (top == self._pick(top)).astype(count.dtype)
        return top, first, count, held / jnp.sum(count * held)

    def selected(self, y: jax.Array, idx: Any, tally: Any) -> jax.Array:
        """1 for the rows of ``y`` the tally selects: the first row when no other
        ties (by index: exact whatever the last bit of a recomputation), else every
        row equal to the extremum."""
        top, first, count = (_spread(t, y) for t in tally[:3])
        alone = (count == 1) & (
            jnp.broadcast_to(_col(idx, y), y.shape).astype(first.dtype) == first
        )
        return (alone | ((count > 1) & (y == top))).astype(count.dtype)


# -- argmin / argmax --------------------------------------------------------------------
class ArgExtremum(_Ordered):
    """``jnp.argmin(y, 0)`` / ``jnp.argmax`` (indices: global rows, the first on
    ties, the first NaN if any), with ``values`` also ``(jnp.min(y, 0), indices)``."""

    selects, halves = True, True  # halves: as Extremum's (the values ignore repeats)

    def __init__(self, largest: bool, values: bool):
        base = "max" if largest else "min"
        super().__init__(largest, f"{base}_arg{base}" if values else f"arg{base}")
        self.values = values

    def init(self, items: Items) -> Any:
        big = np.iinfo(index_dtype()).max
        return _full(items[0], self.fill(items[0].dtype)), _full(items[0], big, index_dtype())

    def encode(self, keep: Any, dtype: Any, xp: Any = np) -> Any:
        return None  # a repeated row has the same index: it changes nothing

    def fold(self, ys, idx, w) -> Any:
        y = _scalar_safe(ys[0])
        big = np.iinfo(index_dtype()).max
        rows = jnp.broadcast_to(_col(idx.astype(index_dtype()), y), y.shape)
        best = self._pick(y, axis=0)
        first = jnp.min(jnp.where(y == _spread(best, y), rows, big), axis=0)
        if _inexact(y.dtype):  # NaN wins (numpy's rule): the first NaN
            # No jnp.any over the rows: Pallas Triton has no reduce_or.
            first_nan = jnp.min(jnp.where(jnp.isnan(y), rows, big), axis=0)
            first = jnp.where(first_nan < big, first_nan, first)
        return best.astype(ys[0].dtype), first

    def fold_fast(self, ys, idx, w, again=None) -> Any:
        """:meth:`fold` over values computed once (see :meth:`Tally.fold_fast`): XLA
        fused a cheap ``fun`` into the maximum and into the comparison with it, rounded
        differently in each, and no row matched (the CPU tiles' index was 2^31 - 1)."""
        return self.fold([lax.optimization_barrier(ys[0])], idx, w)

    def merge(self, a: Any, b: Any) -> Any:
        (va, ia), (vb, ib) = a, b
        better = (va > vb) if self.largest else (va < vb)
        same = va == vb
        if _inexact(va.dtype):
            na, nb = jnp.isnan(va), jnp.isnan(vb)
            better = (na & ~nb) | (better & ~nb)
            same = same | (na & nb)
        take_a = better | (same & (ia < ib))
        return jnp.where(take_a, va, vb), jnp.where(take_a, ia, ib)

    def finalize(self, state: Any, items: Items) -> Any:
        return state if self.values else state[1]

    def check_rows(self, n: int) -> None:
        if n == 0:
            raise ValueError(
                f"{self!r} of zero rows is undefined (jnp.{self.name.split('_')[-1]} of an "
                "empty array raises); give at least one row"
            )

    @property
    def tally(self) -> Any:
        return Tally(self.largest) if self.values else None

    def cotangent(self, ct, ys, idx, keep, state, items, tally=None) -> tuple:
        y = ys[0]
        if not self.values or ct is None or ct[0] is None or not _inexact(y.dtype):
            return (None,)
        share = nan_weights(self.tally.selected(y, idx, tally), _spread(state[0], y))
        share = share * _spread(tally[3], y)
        return (_weigh(_spread(ct[0], y) * share.astype(y.dtype), keep),)

    def tangent(self, ys, dys, idx, keep, state, items) -> Any:
        if not self.values or not _inexact(dys[0].dtype):
            return ()
        return _tie_shares(self._pick, ys[0], dys[0], keep, state[0])

    def tangent_init(self, raw: Any) -> Any:
        return _tie_init(self.fill, raw) if raw else raw

    def tangent_merge(self, a: Any, b: Any) -> Any:
        return _merge_ties(self._join, a, b) if a else a

    def tangent_finish(self, raw: Any, state: Any, items: Items) -> Any:
        index = np.zeros(state[1].shape, jax.dtypes.float0)
        if not self.values:
            return index
        if not raw:
            return np.zeros(state[0].shape, jax.dtypes.float0), index
        return raw[1] / raw[2], index


MAX = Extremum(largest=True)
MIN = Extremum(largest=False)
ARGMIN = ArgExtremum(largest=False, values=False)
ARGMAX = ArgExtremum(largest=True, values=False)
MIN_ARGMIN = ArgExtremum(largest=False, values=True)
MAX_ARGMAX = ArgExtremum(largest=True, values=True)
