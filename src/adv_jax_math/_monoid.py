"""Monoids: the reductions the engines know how to mask, chunk, fuse and differentiate.

A :class:`Monoid` owns all of its math, so that engines never ask which monoid
they hold: the identity, the dtype partials accumulate in, a numerically stable
reduction and combine (written with operations every backend lowers), the
accumulator that carries partials across chunks, and the tangent rule (ties of
max/min share the derivative evenly, as ``jax.grad(jnp.max)`` does).

A recognized ``(reduction, chunk_reduction)`` pair becomes a
:class:`MonoidReduction`: one :class:`LeafReduction` (monoid, axes, final shape)
per leaf of the result, plus the elementwise prologue the chunk reduction applies
first (see ``_recognize``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

__all__ = [
    "ADD",
    "LOGSUMEXP",
    "MAX",
    "MIN",
    "MONOIDS",
    "RECOMPUTED",
    "LeafReduction",
    "Monoid",
    "MonoidReduction",
    "identity",
]


RECOMPUTED = "adv_jax_math.recomputed"  # checkpoint_name of values a gradient recomputes


def identity(x: Any) -> Any:
    """Return ``x`` unchanged (the default ``chunk_reduction``)."""
    return x


def _lowest(dtype: np.dtype) -> Any:
    if jnp.issubdtype(dtype, jnp.inexact):
        return -np.inf
    if dtype == np.bool_:
        return False
    return jnp.iinfo(dtype).min


def _highest(dtype: np.dtype) -> Any:
    if jnp.issubdtype(dtype, jnp.inexact):
        return np.inf
    if dtype == np.bool_:
        return True
    return jnp.iinfo(dtype).max


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(a + b, the rounding error of a + b)`` (Knuth's TwoSum: exact for finite
    values). The error carries no derivative: ``d(a + b)`` is the whole tangent."""
    t = a + b
    z = t - a
    return t, lax.stop_gradient((a - (t - z)) + (b - z))


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
    # Shift for a stable logsumexp: all -inf (or +inf) rows shift by 0 instead of NaN.
    return jnp.where(jnp.abs(top) < jnp.inf, top, jnp.zeros_like(top))


@dataclass(frozen=True, eq=False)
class Monoid:
    """An associative binary operation with an identity element.

    Monoid objects are callable as their binary ``combine``, so they can be passed
    directly as ``reduction=``, e.g. ``reduction=adv_jax_math.LOGSUMEXP``; with the
    default ``chunk_reduction`` that reduces the mapped axis.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> x = jnp.log(jnp.arange(1.0, 7.0)).reshape(3, 2)
    >>> ajm.batch_map(lambda v: v, x, 2, reduction=ajm.LOGSUMEXP)  # log(1+3+5), log(2+4+6)
    Array([2.1972246, 2.4849067], dtype=float32)
    >>> ajm.MAX.identity(jnp.int32), ajm.LOGSUMEXP(0.0, 0.0)
    (array(-2147483648, dtype=int32), Array(0.6931472, dtype=float32, weak_type=True))
    """

    name: str
    combine: Callable[[Any, Any], Any]
    reduce: Callable[..., Any]
    _identity: Callable[[np.dtype], Any]
    selects: bool = False  # max/min: the result is one of the inputs (ties matter)

    def __call__(self, a: Any, b: Any) -> Any:
        return self.combine(a, b)

    def __repr__(self) -> str:
        return f"adv_jax_math.{self.name.upper()}"

    def identity(self, dtype: Any) -> np.ndarray:
        """The identity element as a 0-d NumPy array of ``dtype``."""
        dtype = np.dtype(dtype)
        return np.asarray(self._identity(dtype), dtype)

    def identity_scalar(self, dtype: Any) -> Any:
        """The identity as a NumPy scalar (a literal inside a kernel, not a constant)."""
        return self.identity(dtype)[()]

    def result_dtype(self, dtype: Any) -> np.dtype:
        """The dtype of a reduction of ``dtype`` values (logsumexp of ints is a float)."""
        dtype = np.dtype(dtype)
        if self is LOGSUMEXP and not jnp.issubdtype(dtype, jnp.inexact):
            return np.dtype(jnp.result_type(dtype, 1.0))
        return dtype

    def acc_dtype(self, dtype: Any) -> np.dtype:
        """The dtype partials accumulate in: 16-bit floats are summed in float32 (as
        ``jnp.sum`` does); max/min select values and stay exact in any dtype."""
        dtype = self.result_dtype(dtype)
        low = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
        return np.dtype(np.float32) if low and not self.selects else dtype

    def mask(self, y: jax.Array, valid: jax.Array | None) -> jax.Array:
        """Replace the rows of ``y`` where ``valid`` (a boolean row mask that
        broadcasts against ``y``) is False with the identity."""
        if valid is None:
            return y
        valid = valid.reshape(valid.shape + (1,) * (y.ndim - valid.ndim))
        return jnp.where(valid, y, self.identity_scalar(y.dtype))

    def reduce_stable(self, y: jax.Array, axis: int | None) -> jax.Array:
        """``reduce(y, axis)`` from elementwise ops and plain reductions only (what
        Pallas kernels lower); logsumexp shifted by its finite maximum."""
        if self is not LOGSUMEXP:
            return self.reduce(y, axis=axis)
        top = _finite_or_zero(jnp.max(y, axis=axis, keepdims=True))
        out = jnp.log(jnp.sum(jnp.exp(y - top), axis=axis, keepdims=True)) + top
        return out.reshape(jnp.sum(y, axis=axis).shape)

    def combine_stable(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """``combine(a, b)``, for logsumexp without ops a kernel may not lower; inf-safe."""
        if self is not LOGSUMEXP:
            return self.combine(a, b)
        top = _finite_or_zero(jnp.maximum(a, b))
        return jnp.log(jnp.exp(a - top) + jnp.exp(b - top)) + top

    def overlapped(self, y: jax.Array, r: int, place: Any) -> jax.Array:
        """``y``, one chunk's rows, weighted so that the ``r`` rows shared by the last
        two chunks count once: ``place`` (traced) is 0 for other chunks, 1 for the
        chunk before the last (its last ``r`` rows), 2 for the last (its first ``r``).

        The weights are a row of a loaded table, so the reduction stays one fused
        pass over the chunk (an iota mask or a select, and two slice reductions,
        measured 8-9x slower on XLA:CPU). max/min are idempotent and ignore repeats.
        Float sums halve the shared rows in both chunks (exact, unlike a 0/1 weight
        that turns inf into NaN; only subnormal values lose their last bit); integer
        sums weight the last chunk's copy 0; logsumexp bounds it by -inf.
        """
        if not r or self.selects:
            return y
        if self is LOGSUMEXP:
            table = np.full((3, y.shape[0]), np.inf, y.dtype)
            table[2, :r] = -np.inf
        else:
            half = jnp.issubdtype(y.dtype, jnp.inexact)
            table = np.ones((3, y.shape[0]), y.dtype)
            table[2, :r] = 0.5 if half else 0
            if half:
                table[1, -r:] = 0.5
        row = lax.dynamic_index_in_dim(table, jnp.asarray(place, jnp.int32), 0, False)
        row = checkpoint_name(row, RECOMPUTED)
        row = row.reshape(row.shape + (1,) * (y.ndim - 1))
        return _bound(y, row) if self is LOGSUMEXP else y * row

    # Accumulator: partials combined across chunks, compensated ----------------
    # Float sums carry the rounding error of each addition (TwoSum, exact in
    # floating point), so the error of a chunked sum does not grow with the number
    # of chunks; logsumexp carries (max, scaled sum, compensation). Integers and
    # max/min are exact and carry the value alone. TwoSum has no branches: once the
    # sum is infinite or NaN the compensation is meaningless, and acc_final returns
    # the sum alone (a running max or sum never returns to finite values).

    def _compensated(self, dtype: Any) -> bool:
        return self in (ADD, LOGSUMEXP) and jnp.issubdtype(dtype, jnp.inexact)

    def acc_init(self, shape: tuple[int, ...], dtype: Any) -> tuple[jax.Array, ...]:
        start = jnp.full(shape, self.identity(dtype))
        if not self._compensated(dtype):
            return (start,)
        zero = jnp.zeros(shape, dtype)
        return (start, zero) if self is ADD else (start, zero, zero)

    def acc_update(self, state: tuple, part: jax.Array) -> tuple:
        if len(state) == 1:
            return (self.combine(state[0], part),)
        if self is ADD:
            s, c = state
            t, lost = _two_sum(s, part)
            return t, c + lost
        m, s, c = state  # total = m + log(s + c), s + c = sum exp(partial - m)
        top = lax.max(m, part)
        shift = _finite_or_zero(top)
        scale = jnp.exp(m - shift)
        t, lost = _two_sum(s * scale, jnp.exp(part - shift))
        return top, t, c * scale + lost

    def acc_final(self, state: tuple) -> jax.Array:
        if len(state) == 1:
            return state[0]
        if self is ADD:
            s, c = state  # (a gradient needs no forward pass for the guard)
            return s + lax.stop_gradient(jnp.where(jnp.isfinite(s), c, 0))
        m, s, c = state
        return jnp.where(jnp.isfinite(m), jnp.log(s + c) + _finite_or_zero(m), m)

    # Tangent rule ------------------------------------------------------------
    # One chunk's contribution to the tangent of ``reduce(y)`` given the final
    # ``total``; contributions of chunks are merged, then finished. add: (sum dy,);
    # logsumexp: (sum softmax * dy,); max/min: (top, sum of dy where y == top, ties),
    # so every tied row, in any chunk, gets an equal share (as jax.grad(jnp.max)).

    def tangent_part(
        self, y: jax.Array, dy: jax.Array, valid: Any, total: jax.Array, axis: int | None
    ) -> tuple[jax.Array, ...]:
        valid = jnp.broadcast_to(valid.reshape(valid.shape + (1,) * (y.ndim - 1)), y.shape)
        if self is ADD:
            return (jnp.sum(jnp.where(valid, dy, 0), axis=axis),)
        if self is LOGSUMEXP:
            weight = jnp.exp(y - (total if axis is None else total[None]))
            return (jnp.sum(jnp.where(valid, weight * dy, 0), axis=axis),)
        top = self.reduce(self.mask(y, valid), axis=axis)
        hit = valid & (y == (top if axis is None else top[None]))
        return top, jnp.sum(jnp.where(hit, dy, 0), axis=axis), jnp.sum(hit.astype(dy.dtype), axis)

    def tangent_start(self, shapes: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        parts = [jnp.zeros(s.shape, s.dtype) for s in shapes]
        if self.selects and parts:
            parts[0] = jnp.full(shapes[0].shape, self.identity_scalar(shapes[0].dtype))
        return tuple(parts)

    def tangent_merge(self, a: tuple, b: tuple) -> tuple:
        if not self.selects or not a:
            return tuple(u + v for u, v in zip(a, b, strict=True))
        (top_a, dy_a, n_a), (top_b, dy_b, n_b) = a, b
        top = self.combine(top_a, top_b)
        in_a, in_b = top_a == top, top_b == top  # both when tied across chunks
        return (
            top,
            jnp.where(in_a, dy_a, 0) + jnp.where(in_b, dy_b, 0),
            jnp.where(in_a, n_a, 0) + jnp.where(in_b, n_b, 0),
        )

    def tangent_finish(self, parts: tuple) -> jax.Array:
        return parts[1] / parts[2] if self.selects else parts[0]


ADD = Monoid("add", jnp.add, jnp.sum, lambda dtype: 0)
MAX = Monoid("max", jnp.maximum, jnp.max, _lowest, selects=True)
MIN = Monoid("min", jnp.minimum, jnp.min, _highest, selects=True)
LOGSUMEXP = Monoid("logsumexp", jnp.logaddexp, jax.nn.logsumexp, lambda dtype: -np.inf)
MONOIDS = (ADD, MAX, MIN, LOGSUMEXP)


@dataclass(frozen=True)
class LeafReduction:
    """How one leaf of the result is computed from the chunk outputs.

    ``source`` is the index of ``fun``'s output leaf it reduces, ``axis`` the axes
    (``0``: the mapped axis only; ``None``: all axes), ``shape``/``dtype`` the final
    result leaf (``keepdims`` reshapes included).
    """

    source: int
    monoid: Monoid
    axis: int | None
    shape: tuple[int, ...]
    dtype: np.dtype
    has_prologue: bool = False

    def __str__(self) -> str:
        axes = "all axes" if self.axis is None else "axis 0"
        pre = " after an elementwise map" if self.has_prologue else ""
        return f"{self.monoid.name} over {axes}{pre}"


def _reduce(y: jax.Array, leaf: LeafReduction, reduce: Any) -> jax.Array:
    """``leaf``'s reduction of ``y``; ``reduce(y, monoid, axis)`` may supply a faster
    equivalent (or None to decline)."""
    out = reduce(y, leaf.monoid, leaf.axis) if reduce is not None else None
    return leaf.monoid.reduce(y, axis=leaf.axis) if out is None else out


@dataclass(frozen=True, eq=False)
class MonoidReduction:
    """A recognized reduction: one :class:`LeafReduction` per result leaf.

    Engines evaluate ``prepare(fun(x))`` (one array per result leaf, rows first),
    reduce each with its monoid, combine partials across chunks, and hand the
    reduced leaves to :meth:`finish` for the result's structure, shapes and dtypes.
    """

    leaves: tuple[LeafReduction, ...]
    out_tree: Any
    prologue: Callable[[Any], list[jax.Array]]
    how: str = ""

    def __str__(self) -> str:
        kinds = sorted({str(leaf) for leaf in self.leaves})
        return kinds[0] if len(kinds) == 1 else "per leaf: " + "; ".join(map(str, self.leaves))

    def prepare(self, fun: Callable) -> Callable[[Any], list[jax.Array]]:
        """``fun`` followed by the prologue: a list of arrays, one per result leaf."""
        return lambda x: self.prologue(fun(x))

    def reduce_rows(self, ys: list[jax.Array], reduce: Any = None) -> list:
        """Reduce each prepared leaf over its axes in its accumulator dtype;
        ``reduce(leaf, monoid, axis)`` may replace the monoid's reduction (an engine's
        faster equivalent)."""
        return [
            _reduce(y.astype(leaf.monoid.acc_dtype(y.dtype)), leaf, reduce)
            for y, leaf in zip(ys, self.leaves, strict=True)
        ]

    def reduce_overlapped(
        self, ys: list[jax.Array], r: int, place: Any, reduce: Any = None
    ) -> list[jax.Array]:
        """Partials of a chunk that shares ``r`` rows with the next or the previous
        chunk, by ``place`` (see :meth:`Monoid.overlapped`)."""
        out = []
        for y, leaf in zip(ys, self.leaves, strict=True):
            y = y.astype(leaf.monoid.acc_dtype(y.dtype))
            out.append(_reduce(leaf.monoid.overlapped(y, r, place), leaf, reduce))
        return out

    def combine(self, a: list, b: list) -> list:
        return [leaf.monoid.combine(u, v) for leaf, u, v in zip(self.leaves, a, b, strict=True)]

    def finish(self, reduced: list[jax.Array]) -> Any:
        """Reduced leaves (any dtype) → the result pytree with its shapes and dtypes."""
        leaves = [
            jnp.asarray(r).astype(leaf.dtype).reshape(leaf.shape)
            for r, leaf in zip(reduced, self.leaves, strict=True)
        ]
        return jax.tree.unflatten(self.out_tree, leaves)

    def identity_result(self) -> Any:
        """The result for ``n == 0``: each leaf's identity."""
        return jax.tree.unflatten(
            self.out_tree,
            [jnp.full(leaf.shape, leaf.monoid.identity(leaf.dtype)) for leaf in self.leaves],
        )
