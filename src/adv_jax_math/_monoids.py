"""The monoids: sums, extrema, logsumexp, arg-extrema, top-k, softmax-weighted sums,
means and variances. Each is one object of :class:`~._monoid.Monoid`; its
docstring names the plain-JAX expression it equals.

Written with operations every engine lowers (Pallas kernels included: reductions
over the rows, elementwise ops, comparisons, ``dot_general``), stable and
compensated: float sums carry the rounding error of every merge (TwoSum), so a
chunked sum is as exact as ``jnp.sum``; logsumexp and softmax-weighted sums shift
by their running maximum; means and variances merge by Chan's update.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._monoid import Monoid, _col, index_dtype
from .kernels import native

__all__ = [
    "ADD",
    "ARGMAX",
    "ARGMIN",
    "LOGSUMEXP",
    "MAX",
    "MAX_ARGMAX",
    "MEAN",
    "MEAN_VAR",
    "MIN",
    "MIN_ARGMIN",
    "MONOIDS",
    "SOFTMAX_WEIGHTED",
    "VAR",
    "nan_weights",
    "softmax_weighted",
    "top_k",
    "var",
]

Items = Sequence[jax.ShapeDtypeStruct]


# -- numerics ---------------------------------------------------------------------------
def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(a + b, the rounding error of a + b)`` (Knuth's TwoSum: exact in floating
    point). The error carries no derivative: ``d(a + b)`` is the whole tangent. Where
    ``a + b`` is infinite or NaN the error is 0, not the NaN of ``inf - inf``: it would
    turn an infinite total into NaN once added back."""
    t = a + b
    z = t - a
    lost = (a - (t - z)) + (b - z)
    return t, lax.stop_gradient(jnp.where(jnp.isfinite(t), lost, jnp.zeros_like(lost)))


@jax.custom_jvp
def _bound(y: jax.Array, high: jax.Array) -> jax.Array:
    """``min(y, high)``, where ``high`` passes a row (inf) or drops it (-inf)."""
    return jnp.minimum(y, high)


@_bound.defjvp
def _bound_jvp(primals: tuple, tangents: tuple) -> tuple:
    # A row passes with its derivative or is dropped: one multiply (the JVP of
    # min would add comparisons and selects to every chunk's gradient).
    y, high = primals
    return _bound(y, high), tangents[0] * (high == np.inf).astype(y.dtype)


def _finite_or_zero(top: jax.Array) -> jax.Array:
    # Shift for a stable exponential: all -inf (or +inf) rows shift by 0, not NaN.
    return jnp.where(jnp.abs(top) < jnp.inf, top, jnp.zeros_like(top))


def _shifted(v: jax.Array, top: jax.Array) -> jax.Array:
    """``v - top``, the exponent of a shifted exponential, where ``top`` is the
    maximum of the ``v``. Where ``top`` is infinite (every value -inf, or some +inf) it
    is 0 for the values equal to ``top`` and -inf for the others: no ``inf - inf`` and
    no overflow, so that ``exp`` of it and its derivative are finite (a state of
    non-finite top finalizes as the top itself). A NaN top stays NaN, and so do the
    derivatives of its rows."""
    fallback = jnp.where(v == top, jnp.zeros_like(v), jnp.full_like(v, -np.inf))
    return jnp.where(jnp.isinf(top), fallback, v - top)


@jax.custom_jvp
def _two_passes(y: jax.Array, again: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(top, sum(exp(again - top)))`` over axis 0, ``top`` the maximum of ``y``, where
    ``again`` is ``y`` computed a second time: two reductions with no select per
    element, each of which XLA:CPU fuses with the ``fun`` that makes its operand. A
    non-finite top shifts by 0 (the sum is then a placeholder: such a state
    finalizes as its top).

    Derivatives come from ``again`` only (``y``'s are never computed): ``top + log
    sum`` does not change with a finite top, so its tangent is 0 and the sum's is
    ``sum(exp(again - top) * dagain)``; a non-finite top takes the tangent of the
    rows equal to it (every row for NaN), which finalize turns into NaN, as
    ``jax.grad(jax.nn.logsumexp)`` gives."""
    top = jnp.max(y, axis=0)
    return top, jnp.sum(jnp.exp(again - _finite_or_zero(top)[None]), axis=0)


@_two_passes.defjvp
def _two_passes_jvp(primals: tuple, tangents: tuple) -> tuple:
    (y, again), (_, dagain) = primals, tangents
    top, s = _two_passes(y, again)
    finite = jnp.isfinite(top)
    # exp(again - top) <= 1 (a recomputed row may exceed top by an ulp); never inf
    # where the top is not finite, so that a zero cotangent stays zero
    e = jnp.exp(jnp.minimum(again - _finite_or_zero(top)[None], 0))
    ds = jnp.where(finite, jnp.sum(e * dagain, axis=0), 0)
    # only ever multiplied by NaN (finalize), so a sum of the tied rows' tangents serves
    tied = (again == top[None]) | jnp.isnan(top)[None]
    dtop = jnp.where(finite, 0, jnp.sum(jnp.where(tied, dagain, 0), axis=0))
    return (top, s), (dtop.astype(top.dtype), ds.astype(s.dtype))


def _rescale(tops: Sequence[jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
    """The running maximum of several shifted states and each one's factor
    ``exp(top_i - max)`` onto it: 0 for the identity's -inf (never ``exp(0 - max)``,
    which overflows once every value seen is below about -88.7 in float32)."""
    top = functools.reduce(jnp.maximum, tops)
    return top, [jnp.exp(_shifted(t, top)) for t in tops]


@jax.custom_jvp
def _undefined_derivative(top: jax.Array) -> jax.Array:
    """``top``, whose derivative is NaN where it is not finite (0 elsewhere: the
    branch of :func:`_log_shifted` it serves is not taken there)."""
    return top


@_undefined_derivative.defjvp
def _undefined_derivative_jvp(primals: tuple, tangents: tuple) -> tuple:
    (top,), (dt,) = primals, tangents
    return top, dt * jnp.where(jnp.isfinite(top), 0, jnp.nan).astype(dt.dtype)


def _log_shifted(total: jax.Array, top: jax.Array) -> jax.Array:
    """``log(total) + top``, or ``top`` itself where it is not finite; there the
    derivative is NaN, as ``jax.grad(jax.nn.logsumexp)`` (``exp(inf - inf)``), never
    a share that depends on how rows were chunked. ``total`` is read as 1 there, so
    that the branch not taken has a finite derivative."""
    finite = jnp.isfinite(top)
    shifted = jnp.log(jnp.where(finite, total, 1)) + _finite_or_zero(top)
    return jnp.where(finite, shifted, _undefined_derivative(top))


def nan_weights(hit: jax.Array, total: jax.Array) -> jax.Array:
    """The weights of the rows tied for a max/min ``total`` (``hit``: 1 or 0), NaN for
    every row when the total is NaN: then no row ties, and ``jax.grad(jnp.max)`` is NaN
    everywhere (0/0). Written as a NaN weight, not left to ``0 * (1 / 0)``: XLA may
    rewrite a product with a 0/1 indicator as a select, which drops the NaN."""
    return jnp.where(jnp.isnan(total), jnp.nan, hit).astype(hit.dtype)


def _inexact(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _wide(dtype: Any) -> np.dtype:
    """16-bit floats accumulate in float32 (as ``jnp.sum`` does)."""
    dtype = np.dtype(dtype)
    low = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
    return np.dtype(np.float32) if low else dtype


def _float(dtype: Any) -> np.dtype:
    """The float type a mean or a softmax of ``dtype`` values has."""
    return np.dtype(dtype) if _inexact(dtype) else np.dtype(jnp.result_type(dtype, 1.0))


def _lowest(dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    if _inexact(dtype):
        return -np.inf
    return False if dtype == np.bool_ else jnp.iinfo(dtype).min


def _highest(dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    if _inexact(dtype):
        return np.inf
    return True if dtype == np.bool_ else jnp.iinfo(dtype).max


def _drop(keep: Any, dtype: Any, xp: Any) -> Any:
    """Weights as bounds: ``inf`` keeps a row, ``-inf`` drops it (any weight > 0 keeps)."""
    return xp.where(xp.asarray(keep) > 0, np.inf, -np.inf).astype(dtype)


def _weigh(ct_y: jax.Array, keep: Any) -> jax.Array:
    """A row cotangent times its weight (None: every row counts once)."""
    return ct_y if keep is None else ct_y * _col(keep, ct_y).astype(ct_y.dtype)


def _spread(a: jax.Array, like: jax.Array) -> jax.Array:
    """A per-element value ``(*t)`` (or a scalar) against rows ``(rows, *t)``."""
    return jnp.broadcast_to(a[None] if a.ndim else a, like.shape)


def _scalar_safe(y: jax.Array) -> jax.Array:
    """Rows reduced to a 0-d state, in a 32-bit type where they are narrower (exact:
    16-bit floats to float32, 8/16-bit integers to int32): Mosaic makes scalars of
    32-bit vectors only ("Only arrays with 32-bit element types can be converted to
    scalars")."""
    dtype = np.dtype(y.dtype)
    if y.ndim != 1 or dtype.itemsize >= 4 or dtype == np.bool_:
        return y
    return y.astype(np.float32 if _inexact(dtype) else np.int32)


def _slot(a: jax.Array, j: int) -> jax.Array:
    """``a[j]`` as a masked sum over the leading axis (exact: one nonzero term), not a
    slice: Pallas Triton has no lowering for ``slice``."""
    lead = lax.broadcasted_iota(np.int32, a.shape, 0)
    return jnp.sum(jnp.where(lead == j, a, jnp.zeros_like(a)), axis=0)


def _rows_sharded(y: jax.Array) -> bool:
    """Whether ``y``'s rows are sharded in its type (an Explicit mesh axis)."""
    spec = tuple(getattr(getattr(jax.typeof(y), "sharding", None), "spec", None) or ())
    return bool(spec) and spec[0] is not None


def _full(item: jax.ShapeDtypeStruct, value: Any, dtype: Any = None) -> jax.Array:
    return jnp.full(item.shape, value, dtype or item.dtype)


# -- sum ----------------------------------------------------------------------------
class Sum(Monoid):
    """``jnp.sum(y, 0)``: promotes like ``jnp.sum`` (bool and narrow integers to the
    default integer), accumulates 16-bit floats in float32, compensated."""

    name, halves, axes_all = "add", True, True
    combine, reduce = staticmethod(jnp.add), staticmethod(jnp.sum)

    def result_dtype(self, dtype: Any) -> np.dtype:
        return np.dtype(jax.eval_shape(jnp.sum, jax.ShapeDtypeStruct((1,), dtype)).dtype)

    def _acc(self, dtype: Any) -> np.dtype:
        return _wide(self.result_dtype(dtype))

    def init(self, items: Items) -> Any:
        acc = self._acc(items[0].dtype)
        zero = _full(items[0], 0, acc)
        return (zero, jnp.zeros_like(zero)) if _inexact(acc) else (zero,)

    def encode(self, keep: Any, dtype: Any, xp: Any = np) -> Any:
        return xp.asarray(keep).astype(self._acc(dtype))

    def fold(self, ys: Sequence[jax.Array], idx: jax.Array, w: jax.Array | None) -> Any:
        y = ys[0].astype(self._acc(ys[0].dtype))
        s = jnp.sum(y if w is None else y * _col(w, y), axis=0)
        return (s, jnp.zeros_like(s)) if _inexact(s.dtype) else (s,)

    def merge(self, a: Any, b: Any) -> Any:
        if len(a) == 1:
            return (a[0] + b[0],)
        t, lost = _two_sum(a[0], b[0])
        return t, a[1] + b[1] + lost

    def finalize(self, state: Any, items: Items) -> Any:
        out = state[0]
        if len(state) == 2:  # once infinite or NaN, the compensation means nothing
            out = out + lax.stop_gradient(jnp.where(jnp.isfinite(out), state[1], 0))
        return out.astype(self.result_dtype(items[0].dtype))

    def cotangent(self, ct, ys, idx, keep, state, items, tally=None) -> tuple:
        y = ys[0]
        if ct is None:
            return (None,)
        return (_weigh(_spread(ct, y).astype(y.dtype), keep),)

    def tangent(self, ys, dys, idx, keep, state, items) -> Any:
        dy = dys[0].astype(state[0].dtype)
        return jnp.sum(dy if keep is None else dy * _col(keep, dy), axis=0)


# -- max / min --------------------------------------------------------------------------
class Extremum(Monoid):
    """``jnp.max(y, 0)`` (``largest``) or ``jnp.min(y, 0)``; the derivative is shared
    evenly by every tied row, as ``jax.grad(jnp.max)``, and is NaN everywhere when
    the result is NaN."""

    selects, axes_all = True, True

    def __init__(self, largest: bool):
        self.largest = largest
        self.name = "max" if largest else "min"
        self._join, self._pick = (jnp.maximum, jnp.max) if largest else (jnp.minimum, jnp.min)
        self.combine, self.reduce = self._join, self._pick

    def result_dtype(self, dtype: Any) -> np.dtype:
        return np.dtype(dtype)

    def fill(self, dtype: Any) -> Any:
        return np.asarray(_lowest(dtype) if self.largest else _highest(dtype), dtype)[()]

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
    is NaN (then no row ties and the derivative is NaN everywhere, 0/0)."""
    top = pick(y, axis=0)
    hit = (y == top[None]).astype(dy.dtype)
    if keep is not None:
        hit = hit * _col(keep, hit).astype(dy.dtype)
    weights = nan_weights(hit, jnp.broadcast_to(total[None], hit.shape))
    return top, jnp.sum(dy * weights, axis=0), jnp.sum(hit, axis=0)


def _tie_init(fill: Any, raw: Any) -> Any:
    top, s, n = raw
    return jnp.full(top.shape, fill(top.dtype), top.dtype), jnp.zeros_like(s), jnp.zeros_like(n)


def _merge_ties(join: Any, a: Any, b: Any) -> tuple:
    (ta, sa, na), (tb, sb, nb) = a, b
    top = join(ta, tb)
    in_a = (ta == top).astype(sa.dtype)  # both when tied across blocks
    in_b = (tb == top).astype(sb.dtype)
    return top, sa * in_a + sb * in_b, na * in_a + nb * in_b


class Tally(Monoid):
    """Per element, the extremum of the rows, the first row holding it and how many
    rows do: what a max/min's reverse pass selects rows by (``Monoid.tally``). A
    row is selected by its index when it alone holds the extremum, and only among
    ties by its value (the reverse pass recomputes ``fun``, possibly a last bit off:
    see :meth:`selected`)."""

    def __init__(self, largest: bool):
        self.largest = largest
        self.name = "tally_max" if largest else "tally_min"
        self._join, self._pick = (jnp.maximum, jnp.max) if largest else (jnp.minimum, jnp.min)

    def fill(self, dtype: Any) -> Any:
        return np.asarray(_lowest(dtype) if self.largest else _highest(dtype), dtype)[()]

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
        hit = y == top[None]
        first = jnp.min(jnp.where(hit, rows, big), axis=0)
        count = hit.astype(_wide(_float(y.dtype)))
        count = jnp.sum(count if w is None else count * _col(w, count), axis=0)
        return top, first, count

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


# -- logsumexp --------------------------------------------------------------------------
class LogSumExp(Monoid):
    """``jax.nn.logsumexp(y, 0)``: shifted by the running maximum, compensated; ints
    become floats."""

    name, axes_all, reads_twice = "logsumexp", True, True
    combine, reduce = staticmethod(jnp.logaddexp), staticmethod(jax.nn.logsumexp)

    def result_dtype(self, dtype: Any) -> np.dtype:
        return _float(dtype)

    def fill(self, dtype: Any) -> Any:
        return np.asarray(-np.inf, self.result_dtype(dtype))[()]

    def init(self, items: Items) -> Any:
        acc = _wide(self.result_dtype(items[0].dtype))
        return (_full(items[0], -np.inf, acc), _full(items[0], 0, acc), _full(items[0], 0, acc))

    def encode(self, keep: Any, dtype: Any, xp: Any = np) -> Any:
        return _drop(keep, _wide(self.result_dtype(dtype)), xp)

    def native_decision(self, shape: Sequence[int], dtype: Any) -> tuple[bool, str]:
        """Whether :meth:`fold_fast` reduces rows of ``shape`` and ``dtype`` with the
        native CPU kernel, and why (``explain()`` shows it)."""
        return native.decision(shape, _wide(self.result_dtype(dtype)))

    def _rows(self, ys: Sequence[jax.Array], w: Any) -> jax.Array:
        y = ys[0].astype(_wide(self.result_dtype(ys[0].dtype)))
        return y if w is None else _bound(y, _col(w, y))

    def fold_fast(self, ys, idx, w, again=None) -> Any:
        y = self._rows(ys, w)
        if again is not None:  # two passes, each reading the rows as fun makes them
            top, s = _two_passes(y, self._rows(again, w))
            return top, s, jnp.zeros_like(s)
        if not self.native_decision(y.shape, y.dtype)[0]:
            return self.fold([y], idx, None)
        top = native.logsumexp(y, 0)  # one native pass (CPU), as a state of one row
        return top, jnp.ones_like(top), jnp.zeros_like(top)

    def fold(self, ys, idx, w) -> Any:
        y = self._rows(ys, w)
        top = jnp.max(y, axis=0)
        s = jnp.sum(jnp.exp(_shifted(y, top[None])), axis=0)
        return top, s, jnp.zeros_like(s)

    def merge(self, a: Any, b: Any) -> Any:
        top, (ea, eb) = _rescale([a[0], b[0]])
        t, lost = _two_sum(a[1] * ea, b[1] * eb)
        return top, t, a[2] * ea + b[2] * eb + lost

    def finalize(self, state: Any, items: Items) -> Any:
        m, s, c = state
        out = _log_shifted(s + c, m)
        return out.astype(self.result_dtype(items[0].dtype))

    def cotangent(self, ct, ys, idx, keep, state, items, tally=None) -> tuple:
        y = ys[0]
        if ct is None or not _inexact(y.dtype):
            return (None,)
        total = LogSumExp.finalize(self, state, [jax.ShapeDtypeStruct((), state[0].dtype)])
        weight = jnp.exp(y.astype(total.dtype) - _spread(total, y))
        return (_weigh(_spread(ct, y) * weight, keep).astype(y.dtype),)

    def tangent(self, ys, dys, idx, keep, state, items) -> Any:
        total = LogSumExp.finalize(self, state, [jax.ShapeDtypeStruct((), state[0].dtype)])
        y, dy = ys[0].astype(total.dtype), dys[0].astype(total.dtype)
        weight = jnp.exp(y - total[None])
        if keep is not None:
            weight = weight * _col(keep, weight).astype(weight.dtype)
        return jnp.sum(weight * dy, axis=0)


# -- argmin / argmax --------------------------------------------------------------------
class ArgExtremum(Monoid):
    """``jnp.argmin(y, 0)`` / ``jnp.argmax`` (indices: global rows, the first on
    ties, the first NaN if any), with ``values`` also ``(jnp.min(y, 0), indices)``."""

    selects = True

    def __init__(self, largest: bool, values: bool):
        self.largest, self.values = largest, values
        base = "max" if largest else "min"
        self.name = f"{base}_arg{base}" if values else f"arg{base}"
        self._join, self._pick = (jnp.maximum, jnp.max) if largest else (jnp.minimum, jnp.min)

    def fill(self, dtype: Any) -> Any:
        return np.asarray(_lowest(dtype) if self.largest else _highest(dtype), dtype)[()]

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
        first = jnp.min(jnp.where(y == best[None], rows, big), axis=0)
        if _inexact(y.dtype):  # NaN wins (numpy's rule): the first NaN
            # No jnp.any over the rows: Pallas Triton has no reduce_or.
            first_nan = jnp.min(jnp.where(jnp.isnan(y), rows, big), axis=0)
            first = jnp.where(first_nan < big, first_nan, first)
        return best.astype(ys[0].dtype), first

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


# -- top-k ------------------------------------------------------------------------------
def _order_key(y: jax.Array) -> jax.Array:
    """Integers ordered as XLA's total order of ``y`` (NaN above inf, -NaN below -inf,
    -0 below +0), the order ``lax.top_k`` selects by."""
    if not _inexact(y.dtype):
        return y.astype(jnp.int32) if y.dtype == np.bool_ else y
    wide, ints = (np.float64, np.int64) if y.dtype == np.float64 else (np.float32, np.int32)
    bits = lax.bitcast_convert_type(y.astype(wide), ints)
    return jnp.where(bits < 0, bits ^ np.iinfo(ints).max, bits)


def _from_key(key: jax.Array, dtype: Any) -> jax.Array:
    if not _inexact(dtype):
        return key.astype(dtype)
    ints = key.dtype
    bits = jnp.where(key < 0, key ^ np.iinfo(ints).max, key)
    wide = np.float64 if ints == np.int64 else np.float32
    return lax.bitcast_convert_type(bits, wide).astype(dtype)


class TopK(Monoid):
    """``lax.top_k`` along the rows: the ``k`` largest rows per trailing element,
    largest first, ties to the lower row (``smallest=True``: the ``k`` smallest,
    smallest first, ties to the lower row; integers and bools compared as they are,
    never negated, which wraps); ``(values, indices)``, each ``(k, *t)``. The state
    keeps each slot's value and row (its order key is computed from the value where
    slots are compared); derivatives of every order go to the selected rows, as
    ``jax.grad`` of ``lax.top_k``."""

    selects = True

    def __init__(self, k: int, smallest: bool = False):
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"top_k(k={k!r}): k must be a positive int")
        self.k, self.smallest = int(k), bool(smallest)
        self.name = f"top_k({self.k}{', smallest=True' if smallest else ''})"

    def __repr__(self) -> str:
        return f"adv_jax_math.{self.name}"

    def _flip(self, y: Any) -> Any:
        """``y`` reversed in order for ``smallest`` (exact and its own inverse: ``-y``
        for floats, ``~y`` for integers and bools)."""
        if not self.smallest:
            return y
        return -y if _inexact(y.dtype) else ~y

    def _key(self, y: jax.Array) -> jax.Array:
        return _order_key(self._flip(y))

    def _key_min(self, dtype: Any) -> Any:
        return np.iinfo(jax.eval_shape(self._key, jax.ShapeDtypeStruct((1,), dtype)).dtype).min

    @staticmethod
    def _value_dtype(dtype: Any) -> np.dtype:
        """A slot's value: at least 32 bits (Mosaic makes scalars of 32-bit vectors)."""
        dtype = np.dtype(dtype)
        if dtype.itemsize >= 4:
            return dtype
        return np.dtype(np.float32 if _inexact(dtype) else np.int32)

    def _empty(self, dtype: Any) -> Any:
        """The value of an empty slot: the one whose key is the lowest (for floats a
        NaN whose bits are all ones, before :meth:`_flip`)."""
        vd = self._value_dtype(dtype)
        if _inexact(vd):
            low = np.array(-1, np.int64 if vd.itemsize == 8 else np.int32).view(vd)
        else:
            low = np.array(np.iinfo(vd).min, vd)
        return self._flip(low)[()]

    def fill(self, dtype: Any) -> Any:
        return np.zeros((), dtype)[()]  # never selected: fold leaves out weight-0 rows

    def init(self, items: Items) -> Any:
        dtype = items[0].dtype
        slots = lambda value, dt: tuple(_full(items[0], value, dt) for _ in range(self.k))
        empty = self._empty(dtype)
        return slots(empty, empty.dtype), slots(np.iinfo(index_dtype()).max, index_dtype())

    def fold(self, ys, idx, w) -> Any:
        """k passes of max-and-remove (any engine, kernels included); the values are
        read back from the keys (exact, with no derivative: kernels are never
        differentiated, :meth:`fold_fast` is)."""
        y = ys[0]
        key = self._key(y)
        rows = jnp.broadcast_to(_col(idx.astype(index_dtype()), y), y.shape)
        alive = jnp.ones(y.shape, bool) if w is None else jnp.broadcast_to(_col(w > 0, y), y.shape)
        keys, sel = _select(self.k, [(key, rows, alive, 0)], self._key_min(y.dtype))
        vd = self._value_dtype(y.dtype)
        return tuple(self._flip(_from_key(kk, y.dtype)).astype(vd) for kk in keys), sel

    def _picked(self, y: jax.Array, idx: jax.Array, state: Any) -> Any:
        """``state`` whose values have the derivatives of their rows of ``y``: each
        finite value plus ``p - stop_gradient(p)`` for ``p`` its row picked by a 0/1
        mask (infinities and NaN zeroed first; a select would need the mask sharded as
        ``y`` on Explicit meshes). NaN and infinite values are left as they are:
        arithmetic may turn a NaN's sign, and with it its rank."""
        values, sel = state
        if not _inexact(y.dtype):
            return state
        rows = _col(idx.astype(index_dtype()), y)
        v = y.astype(self._value_dtype(y.dtype))
        v = jnp.where(jnp.isfinite(v), v, jnp.zeros_like(v))
        pick = lambda s: jnp.sum(v * (rows == s[None]).astype(v.dtype), axis=0)
        tie = lambda a, p: jnp.where(jnp.isfinite(a), a + (p - lax.stop_gradient(p)), a)
        return tuple(tie(a, pick(s)) for a, s in zip(values, sel, strict=True)), sel

    def fold_fast(self, ys, idx, w, again=None) -> Any:
        """One ``lax.top_k`` over the rows (XLA's TopK, the lower row first on equal
        values) instead of k passes of max-and-remove; not in kernels. Floats of 32
        bits or fewer are ranked as float32 (XLA:CPU sorts integer keys in full; the
        total order is the same), others by their keys. Rows of weight 0 (repeated)
        rank last; where one is still selected, the block takes :meth:`fold`. The
        values are gathered from ``y``: differentiable (second derivatives)."""
        y = ys[0]
        slow = lambda: self._picked(y, idx, self.fold(ys, idx, w))
        if y.shape[0] < self.k or _rows_sharded(y):  # lax.top_k: unsharded along its axis
            return slow()
        floats = _inexact(y.dtype) and np.dtype(y.dtype).itemsize <= 4
        rank = self._flip(y).astype(np.float32) if floats else self._key(y)
        alive = None if w is None else jnp.broadcast_to(_col(w > 0, y), y.shape)
        if alive is not None:  # below everything: -NaN, or the lowest key
            low = np.float32(-np.nan) if floats else self._key_min(y.dtype)
            rank = jnp.where(alive, rank, low)
        rows = jnp.broadcast_to(_col(idx.astype(index_dtype()), y), y.shape)
        _, pos = lax.top_k(jnp.moveaxis(rank, 0, -1), self.k)  # (*t, k)
        take = lambda a: tuple(jnp.moveaxis(jnp.take_along_axis(a, pos, axis=-1), -1, 0))
        v = y.astype(self._value_dtype(y.dtype))
        fast = take(jnp.moveaxis(v, 0, -1)), take(jnp.moveaxis(rows, 0, -1))
        if alive is None:
            return fast
        chosen = jnp.take_along_axis(jnp.moveaxis(alive, 0, -1), pos, axis=-1)
        return lax.cond(jnp.all(chosen), lambda: fast, slow)

    def merge(self, a: Any, b: Any) -> Any:
        return _merge_sorted(self.k, a, b, self._key, self._empty(a[0][0].dtype))

    def finalize(self, state: Any, items: Items) -> Any:
        values, rows = (jnp.stack(part) for part in state)
        # int32 indices, as lax.top_k gives them (also under x64)
        return values.astype(items[0].dtype), rows.astype(np.int32)

    def check_rows(self, n: int) -> None:
        if n < self.k:
            raise ValueError(
                f"{self!r} needs at least k={self.k} rows, got {n} (lax.top_k raises too); "
                "use a smaller k"
            )

    def cotangent(self, ct, ys, idx, keep, state, items, tally=None) -> tuple:
        y = ys[0]
        if ct is None or ct[0] is None or not _inexact(y.dtype):
            return (None,)
        rows = jnp.broadcast_to(_col(idx.astype(index_dtype()), y), y.shape)
        out = jnp.zeros(y.shape, y.dtype)
        for j, sel in enumerate(state[1]):  # the row selected in slot j gets slot j's
            slot = _slot(ct[0], j)
            out = out + jnp.where(rows == _spread(sel, y), _spread(slot, y), 0).astype(y.dtype)
        return (out if keep is None else out * (_col(keep, out) > 0).astype(y.dtype),)

    def tangent(self, ys, dys, idx, keep, state, items) -> Any:
        dy = dys[0]
        if not _inexact(dy.dtype):
            return ()
        rows = _col(idx.astype(index_dtype()), dy)
        if keep is not None:  # a repeated row's copy adds nothing
            dy = dy * _col(keep > 0, dy).astype(dy.dtype)
        return tuple(jnp.sum(jnp.where(rows == sel[None], dy, 0), axis=0) for sel in state[1])

    def tangent_finish(self, raw: Any, state: Any, items: Items) -> Any:
        index = np.zeros((self.k, *state[1][0].shape), jax.dtypes.float0)
        if not raw:
            return np.zeros((self.k, *state[1][0].shape), jax.dtypes.float0), index
        return jnp.stack(raw), index


def _select(k: int, lists: list, key_min: Any) -> tuple:
    """The ``k`` best ``(key, row)`` pairs of candidate ``lists`` (each ``(keys, rows,
    alive, axis)``: ``axis`` 0 for a block of rows, None for one slot of a state),
    highest key first, the lower row on ties; k passes of max-and-remove."""
    big = np.iinfo(lists[0][1].dtype).max

    def over(values: jax.Array, axis: int | None, reduce: Any) -> jax.Array:
        return reduce(values, axis=axis) if axis is not None else values

    keys, rows = [], []
    for _ in range(k):
        top = functools.reduce(
            jnp.maximum,
            [over(jnp.where(al, kk, key_min), ax, jnp.max) for kk, rr, al, ax in lists],
        )
        level = lambda ax, top=top: top if ax is None else top[None]
        sel = functools.reduce(
            jnp.minimum,
            [
                over(jnp.where(al & (kk == level(ax)), rr, big), ax, jnp.min)
                for kk, rr, al, ax in lists
            ],
        )
        keys.append(top)
        rows.append(sel)
        gone = lambda ax, sel=sel: sel if ax is None else sel[None]
        lists = [(kk, rr, al & (rr != gone(ax)), ax) for kk, rr, al, ax in lists]
    return tuple(keys), tuple(rows)


def _merge_sorted(k: int, a: tuple, b: tuple, key: Any, empty: Any) -> tuple:
    """The ``k`` best of two states ``(values, rows)``, each sorted best first (the
    higher ``key(value)``, then the lower row; empty slots ``(empty, big)``, of the
    lowest key, last): a bitonic merge network. ``a`` and ``b`` reversed form a bitonic
    sequence; one compare-exchange of ``a[i]`` with ``b[size - 1 - i]`` keeps the
    ``size`` best (bitonic again), and ``log2(size)`` rounds of compare-exchanges sort
    them (``size``: k rounded up to a power of two, padded with empty slots). That is
    ``k + k/2 log2 k`` compare-exchanges at depth ``1 + log2 k``, elementwise (any
    engine, kernels included); the k passes of max-and-remove (:func:`_select`) over
    the 2k slots made XLA:GPU fuse one ``loop_and_maximum_minimum_fusion`` that took
    minutes to compile for k = 16. Keys are recomputed from the values at each
    comparison (a bitcast), not carried: two arrays per slot, as few registers as
    possible on GPU; values move by ``where``, with their derivatives."""
    size = 1 << (k - 1).bit_length()
    big = np.iinfo(a[1][0].dtype).max

    def padded(state: tuple) -> tuple[list, list]:
        values, rows = state
        pad = size - k
        return (
            list(values) + [jnp.full_like(values[0], empty)] * pad,
            list(rows) + [jnp.full_like(rows[0], big)] * pad,
        )

    def first(vx: jax.Array, rx: jax.Array, vy: jax.Array, ry: jax.Array) -> jax.Array:
        kx, ky = key(vx), key(vy)
        return (kx > ky) | ((kx == ky) & (rx < ry))

    (va, ra), (vb, rb) = padded(a), padded(b)
    values, rows = [], []
    for i in range(size):  # the better of a[i] and b[size - 1 - i]: the size best
        j = size - 1 - i
        take = first(va[i], ra[i], vb[j], rb[j])
        values.append(jnp.where(take, va[i], vb[j]))
        rows.append(jnp.where(take, ra[i], rb[j]))
    half = size // 2
    while half:  # bitonic merge, best first
        for i in (i for i in range(size) if not i & half):
            j = i + half
            take = first(values[i], rows[i], values[j], rows[j])
            values[i], values[j] = (
                jnp.where(take, values[i], values[j]),
                jnp.where(take, values[j], values[i]),
            )
            rows[i], rows[j] = jnp.where(take, rows[i], rows[j]), jnp.where(take, rows[j], rows[i])
        half //= 2
    return tuple(values[:k]), tuple(rows[:k])


# -- softmax-weighted sums --------------------------------------------------------------
class SoftmaxWeighted(Monoid):
    """``jnp.tensordot(jax.nn.softmax(scores, 0), values, ([0], [0]))`` for ``fun``
    returning ``(scores (n, *s), values (n, *v))``: the result is ``(*s, *v)``
    (attention for ``s = (queries,)``); with ``return_lse=True`` also
    ``jax.nn.logsumexp(scores, 0)``, to combine partial results across calls. An
    online softmax (Milakov & Gimelshein 2018), compensated."""

    arity = 2

    def __init__(self, return_lse: bool = False):
        self.return_lse = bool(return_lse)
        self.name = "softmax_weighted" + ("(return_lse=True)" if return_lse else "")

    def __repr__(self) -> str:
        return "adv_jax_math." + (
            "softmax_weighted(return_lse=True)" if self.return_lse else "SOFTMAX_WEIGHTED"
        )

    def _dtypes(self, items: Items) -> tuple[np.dtype, np.dtype]:
        out = _float(jnp.result_type(items[0].dtype, items[1].dtype))
        return out, _wide(out)

    def fills(self, dtypes: Sequence[Any]) -> tuple:
        return np.asarray(-np.inf, _float(dtypes[0]))[()], np.zeros((), dtypes[1])[()]

    def init(self, items: Items) -> Any:
        _, acc = self._dtypes(items)
        s, v = items
        both = jax.ShapeDtypeStruct(s.shape + v.shape, acc)
        zero = lambda it: _full(it, 0, acc)
        return _full(s, -np.inf, acc), zero(s), zero(s), zero(both), zero(both)

    def encode(self, keep: Any, dtype: Any, xp: Any = np) -> Any:
        return _drop(keep, _wide(_float(dtype)), xp)

    def fold(self, ys, idx, w) -> Any:
        acc = self._dtypes([jax.ShapeDtypeStruct((), y.dtype) for y in ys])[1]
        s, v = (y.astype(acc) for y in ys)
        if w is not None:
            s = _bound(s, _col(w, s))
        top = jnp.max(s, axis=0)
        # an infinite top is not shifted away: exp(inf - inf) is NaN, as jax.nn.softmax
        e = jnp.exp(s - _finite_or_zero(top)[None])
        if e.ndim == 1 or v.ndim == 1:  # one score or one value per row: no matvec
            # (Pallas Triton's dot takes 2-D operands only; Mosaic's fails on vectors)
            ev = e if e.ndim > 1 or v.ndim == 1 else lax.broadcast_in_dim(e, v.shape, (0,))
            ve = v if v.ndim > 1 or e.ndim == 1 else lax.broadcast_in_dim(v, e.shape, (0,))
            weighted = jnp.sum(ev * ve, axis=0)
        else:
            weighted = jnp.tensordot(e, v, axes=([0], [0]))
        return top, jnp.sum(e, axis=0), jnp.zeros_like(top), weighted, jnp.zeros_like(weighted)

    def merge(self, a: Any, b: Any) -> Any:
        top, (ea, eb) = _rescale([a[0], b[0]])
        spread = lambda e, x: e.reshape(e.shape + (1,) * (x.ndim - e.ndim))
        norm, lost = _two_sum(a[1] * ea, b[1] * eb)
        acc, lost2 = _two_sum(a[3] * spread(ea, a[3]), b[3] * spread(eb, b[3]))
        lc = a[2] * ea + b[2] * eb + lost
        ac = a[4] * spread(ea, a[4]) + b[4] * spread(eb, b[4]) + lost2
        return top, norm, lc, acc, ac

    def _parts(self, state: Any) -> tuple[jax.Array, jax.Array]:
        m, norm, lc, acc, ac = state
        total = norm + lc
        out = (acc + ac) / total.reshape(total.shape + (1,) * (acc.ndim - total.ndim))
        lse = _log_shifted(total, m)
        return out, lse

    def finalize(self, state: Any, items: Items) -> Any:
        dtype = self._dtypes(items)[0]
        out, lse = self._parts(state)
        return (out.astype(dtype), lse.astype(dtype)) if self.return_lse else out.astype(dtype)

    def empty(self, items: Items) -> Any:
        dtype = self._dtypes(items)[0]
        out = jnp.zeros(items[0].shape + items[1].shape, dtype)  # a sum over no rows
        return (out, jnp.full(items[0].shape, -jnp.inf, dtype)) if self.return_lse else out

    def cotangent(self, ct, ys, idx, keep, state, items, tally=None) -> tuple:
        out, lse = self._parts(state)
        s, v = (y.astype(out.dtype) for y in ys)
        ct_out, ct_lse = ct if self.return_lse else (ct, None)
        p = jnp.exp(s - lse[None])
        if keep is not None:
            p = p * _col(keep, p).astype(p.dtype)
        ns, nv = s.ndim - 1, v.ndim - 1
        # out[S, V] = sum_i p_i[S] v_i[V]: d/dv_i = sum over S of p_i ct, and
        # d/ds_i = p_i (<ct, v_i - out> over V + ct_lse)
        ct_v = jnp.tensordot(p, ct_out, axes=(list(range(1, ns + 1)), list(range(ns))))
        spread = lambda a, k: a.reshape(a.shape + (1,) * k)
        centered = v.reshape(v.shape[:1] + (1,) * ns + v.shape[1:]) - out[None]
        ct_s = p * jnp.sum(
            spread(ct_out, 0)[None] * centered, axis=tuple(range(ns + 1, ns + nv + 1))
        )
        if ct_lse is not None:
            ct_s = ct_s + p * ct_lse[None]
        cast = lambda c, y: c.astype(y.dtype) if _inexact(y.dtype) else None
        return cast(ct_s, ys[0]), cast(ct_v, ys[1])

    def tangent(self, ys, dys, idx, keep, state, items) -> Any:
        out, lse = self._parts(state)
        s, v = (y.astype(out.dtype) for y in ys)
        ds, dv = (d.astype(out.dtype) for d in dys)
        p = jnp.exp(s - lse[None])
        if keep is not None:
            p = p * _col(keep, p).astype(p.dtype)
        pds = p * ds
        dot = lambda a, b: jnp.tensordot(a, b, axes=([0], [0]))
        return dot(p, dv), dot(pds, v), jnp.sum(pds, axis=0)

    def tangent_finish(self, raw: Any, state: Any, items: Items) -> Any:
        out, _ = self._parts(state)
        via_v, via_s, d_lse = raw
        d_out = via_v + via_s - d_lse.reshape(d_lse.shape + (1,) * (out.ndim - d_lse.ndim)) * out
        return (d_out, d_lse) if self.return_lse else d_out


# -- mean and variance ------------------------------------------------------------------
class Moments(Monoid):
    """``jnp.mean(y, 0)`` and ``jnp.var(y, 0, ddof=ddof)``: Welford per block, Chan's
    merge between blocks (stable for data with a large offset), compensated."""

    halves = True

    def __init__(self, mean: bool, variance: bool, ddof: int = 0):
        if isinstance(ddof, bool) or not isinstance(ddof, int | np.integer) or ddof < 0:
            raise ValueError(f"var(ddof={ddof!r}): ddof must be a non-negative int")
        self.mean, self.variance, self.ddof = mean, variance, int(ddof)
        parts = (["mean"] if mean else []) + (["var"] if variance else [])
        self.name = "_".join(parts) + (f"(ddof={self.ddof})" if self.ddof else "")

    def __repr__(self) -> str:
        if self.ddof:
            return f"adv_jax_math.var(ddof={self.ddof})"
        return f"adv_jax_math.{self.name.upper()}"

    def result_dtype(self, dtype: Any) -> np.dtype:
        return np.dtype(jax.eval_shape(jnp.mean, jax.ShapeDtypeStruct((1,), dtype)).dtype)

    def _acc(self, dtype: Any) -> np.dtype:
        return _wide(self.result_dtype(dtype))

    def init(self, items: Items) -> Any:
        acc = self._acc(items[0].dtype)
        zero = _full(items[0], 0, acc)
        return _full(items[0], 0, index_dtype()), zero, zero, zero, zero

    def encode(self, keep: Any, dtype: Any, xp: Any = np) -> Any:
        return xp.asarray(keep).astype(self._acc(dtype))

    def fold(self, ys, idx, w) -> Any:
        y = ys[0].astype(self._acc(ys[0].dtype))
        rows = y.shape[0]
        if w is None:  # the count per trailing element (the same for all of them)
            halves = jnp.full(y.shape[1:], 2 * rows, index_dtype())
            total, count = jnp.sum(y, axis=0), jnp.full(y.shape[1:], rows, y.dtype)
        else:  # weights are 0, 1/2 or 1: counted in half rows, exactly
            w = jnp.broadcast_to(_col(w, y), y.shape).astype(y.dtype)
            # 2w is 0, 1 or 2 exactly (no jnp.round: Pallas Triton has no round)
            halves = jnp.sum((2 * w + 0.5).astype(index_dtype()), axis=0)
            # y * w summed at once: not held whole in a kernel across the other sums
            total, count = jnp.sum(y * w, axis=0), jnp.sum(w, axis=0)
        safe = jnp.where(count > 0, count, 1)
        mean = total / safe
        d = y - mean[None]
        m2 = jnp.sum(d * d if w is None else d * d * w, axis=0)
        return halves, mean, jnp.zeros_like(mean), m2, jnp.zeros_like(m2)

    def merge(self, a: Any, b: Any) -> Any:
        ha, ma, ca, qa, cqa = a
        hb, mb, cb, qb, cqb = b
        h = ha + hb
        na, nb = ha.astype(ma.dtype) / 2, hb.astype(ma.dtype) / 2
        n = jnp.where(h > 0, h.astype(ma.dtype) / 2, 1)
        delta = (mb - ma) + (cb - ca)
        mean, lost = _two_sum(ma, delta * (nb / n))
        # Chan's update reads inf - inf as NaN: an infinite mean is the plain weighted
        # one (inf with finite values, NaN with both infinities, as jnp.mean)
        finite = jnp.isfinite(ma) & jnp.isfinite(mb)
        mean = jnp.where(finite, mean, (ma * na + mb * nb) / n)
        # delta * (delta * w), not delta**2 * w: a state of no rows (w = 0) stays exact
        # where delta**2 overflows (inf * 0)
        m2, lost2 = _two_sum(qa, qb + delta * (delta * (na * nb / n)))
        return h, mean, ca + lost, m2, cqa + cqb + lost2

    def _stats(self, state: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        h, m, c, q, cq = state
        n = h.astype(m.dtype) / 2
        mean = jnp.where(n > 0, m + c, jnp.nan)
        var = (q + cq) / self._dof(n)
        # an infinite mean: the variance is NaN (inf - inf), and so is its derivative
        return n, mean, var * jnp.where(jnp.isfinite(mean), 1, jnp.nan).astype(var.dtype)

    def _dof(self, n: jax.Array) -> jax.Array:
        """``n - ddof`` where positive, else NaN (``jnp.var`` is NaN for ``ddof >= n``)."""
        return jnp.where(n > self.ddof, n - self.ddof, jnp.nan)

    def finalize(self, state: Any, items: Items) -> Any:
        dtype = self.result_dtype(items[0].dtype)
        _, mean, var = self._stats(state)
        parts = ([mean.astype(dtype)] if self.mean else []) + (
            [var.astype(dtype)] if self.variance else []
        )
        return tuple(parts) if len(parts) == 2 else parts[0]

    def cotangent(self, ct, ys, idx, keep, state, items, tally=None) -> tuple:
        y = ys[0]
        if ct is None or not _inexact(y.dtype):
            return (None,)
        n, mean, _ = self._stats(state)
        parts = list(ct) if isinstance(ct, tuple) else [ct]
        out = jnp.zeros(y.shape, mean.dtype)
        if self.mean:
            out = out + _spread(parts.pop(0) / n, y)
        if self.variance:
            scale = 2 * parts.pop(0) / self._dof(n)
            out = out + _spread(scale, y) * (y.astype(mean.dtype) - _spread(mean, y))
        return (_weigh(out, keep).astype(y.dtype),)

    def tangent(self, ys, dys, idx, keep, state, items) -> Any:
        _, mean, _ = self._stats(state)
        y, dy = ys[0].astype(mean.dtype), dys[0].astype(mean.dtype)
        if keep is not None:
            dy = dy * _col(keep, dy).astype(dy.dtype)
        return jnp.sum(dy, axis=0), jnp.sum((y - mean[None]) * dy, axis=0)

    def tangent_finish(self, raw: Any, state: Any, items: Items) -> Any:
        n, _, _ = self._stats(state)
        d_mean = raw[0] / n
        d_var = 2 * raw[1] / self._dof(n)
        parts = ([d_mean] if self.mean else []) + ([d_var] if self.variance else [])
        return tuple(parts) if len(parts) == 2 else parts[0]


ADD = Sum()
MAX = Extremum(largest=True)
MIN = Extremum(largest=False)
LOGSUMEXP = LogSumExp()
ARGMIN = ArgExtremum(largest=False, values=False)
ARGMAX = ArgExtremum(largest=True, values=False)
MIN_ARGMIN = ArgExtremum(largest=False, values=True)
MAX_ARGMAX = ArgExtremum(largest=True, values=True)
SOFTMAX_WEIGHTED = SoftmaxWeighted()
MEAN = Moments(mean=True, variance=False)
VAR = Moments(mean=False, variance=True)
MEAN_VAR = Moments(mean=True, variance=True)
MONOIDS = (ADD, MAX, MIN, LOGSUMEXP)  # the ones recognized from plain-JAX reductions


def top_k(k: int, smallest: bool = False) -> TopK:
    """The ``k`` largest rows (``smallest=True``: smallest) per trailing element, with
    their global row indices, as ``lax.top_k`` along axis 0 (of ``-y`` for smallest).

    The result is ``(values, indices)``, each ``(k, *t)`` for ``fun`` rows of shape
    ``t``: largest first (smallest first with ``smallest=True``), ties to the lower row,
    indices int32. Gradients go to the selected rows, as ``jax.grad`` of ``lax.top_k``.
    ``batch_map`` raises when there are fewer than ``k`` rows.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> d = jnp.array([4.0, 1.0, 3.0, 0.5, 2.0])
    >>> ajm.batch_map(lambda r: r, d, 2, reduction=ajm.top_k(2, smallest=True))
    (Array([0.5, 1. ], dtype=float32), Array([3, 1], dtype=int32))
    """
    return TopK(k, smallest)


def softmax_weighted(return_lse: bool = False) -> SoftmaxWeighted:
    """Softmax-weighted sums of ``fun``'s ``(scores, values)`` over the rows, as
    ``jnp.tensordot(jax.nn.softmax(scores, 0), values, ([0], [0]))``.

    ``fun`` returns ``scores`` of shape ``(n, *s)`` and ``values`` of ``(n, *v)``; the
    result has shape ``(*s, *v)`` (attention over keys for ``s = (queries,)``), computed
    as an online softmax without the ``(n, *s)`` weights. With ``return_lse=True`` the
    result is ``(weighted sum, jax.nn.logsumexp(scores, 0))``, so that partial results
    of several calls or devices can be combined. ``SOFTMAX_WEIGHTED`` is
    ``softmax_weighted()``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> scores = jnp.log(jnp.array([1.0, 1.0, 2.0]))     # weights 1/4, 1/4, 1/2
    >>> values = jnp.array([4.0, 8.0, 2.0])
    >>> out, lse = ajm.batch_map(lambda r: r, (scores, values), 2,
    ...                          reduction=ajm.softmax_weighted(return_lse=True))
    >>> print(round(float(out), 4), round(float(jnp.exp(lse)), 4))
    4.0 4.0
    """
    return SOFTMAX_WEIGHTED if not return_lse else SoftmaxWeighted(return_lse=True)


def var(ddof: int = 0) -> Moments:
    """The variance over the rows with ``ddof`` delta degrees of freedom, as
    ``jnp.var(y, 0, ddof=ddof)``: one pass (Welford within a chunk, Chan's merge
    between chunks), stable for data with a large offset. ``VAR`` is ``var()``;
    ``MEAN_VAR`` gives ``(mean, variance)``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> y = jnp.array([1000.0, 1001.0, 1002.0, 1003.0, 1004.0])
    >>> ajm.batch_map(lambda r: r, y, 2, reduction=ajm.var(ddof=1))
    Array(2.5, dtype=float32)
    >>> ajm.batch_map(lambda r: r, y, 2, reduction=ajm.MEAN_VAR)
    (Array(1002., dtype=float32), Array(2., dtype=float32))
    """
    return VAR if ddof == 0 else Moments(mean=False, variance=True, ddof=ddof)
