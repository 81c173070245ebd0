"""Shifted exponentials, what the logsumexp family (``monoids.exponential``,
``monoids.softmax``) folds, merges and differentiates by: sums of ``exp(y - top)``
for the maximum ``top`` of the rows, never NaN or overflowing where a maximum is
infinite or a row computed again rounds a few ulps off it, and softmax weights from
a state or from the rows as a derivative pass computes them."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .base import _col
from .numerics import _spread, _two_sum


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
def _at_most_0(exponent: jax.Array) -> jax.Array:
    """An exponent shifted by the maximum, at most 0 even for a row computed again a
    few ulps above it. Its derivative is the exponent's everywhere: the clamp only
    undoes rounding, and a row a last bit above the maximum (the row at the top,
    computed again) is still the top row; cut there (``lax.select``'s derivative),
    the softmax weights' derivative lost that row's share (second derivatives of
    SOFTMAX_WEIGHTED through the fused kernel's tangent off by 0.4)."""
    # (lax.select: jnp.where failed to linearize on rows without elements under vmap)
    return lax.select(exponent > 0, jnp.zeros_like(exponent), exponent)


@_at_most_0.defjvp
def _at_most_0_jvp(primals: tuple, tangents: tuple) -> tuple:
    return _at_most_0(primals[0]), tangents[0]


def _at_least_one(s: jax.Array, top: jax.Array) -> jax.Array:
    """A shifted sum of finite ``top``, at least the 1 of the row at the top. Less only
    when that row was computed again, rounded a few ulps below ``top`` (two fusions
    of a cheap ``fun``): at values of 1e9 an ulp (128) is beyond exp's range and
    every row's term was 0 (a logsumexp of -inf)."""
    return lax.select(jnp.isfinite(top) & (s < 1), jnp.ones_like(s), s)


def _shares(y: jax.Array, top: jax.Array, dy: jax.Array) -> jax.Array:
    """``dy`` on the rows of ``y`` equal to ``top`` (every row where ``top`` is NaN),
    each divided by how many are, 0 on the others: a tangent of ``top``."""
    tied = (y == _spread(top, y)) | _spread(jnp.isnan(top), y)
    count = jnp.sum(tied, axis=0).astype(dy.dtype)
    return jnp.sum(jnp.where(tied, dy, jnp.zeros_like(dy)), axis=0) / count


@jax.custom_jvp
def _two_passes(y: jax.Array, again: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(top, sum(exp(again - top)))`` over axis 0, ``top`` the maximum of ``y``, where
    ``again`` is ``y`` computed a second time: two reductions with no select per
    element, each of which XLA:CPU fuses with the ``fun`` that makes its operand. A
    non-finite top shifts by 0 (the sum is then a placeholder: such a state
    finalizes as its top). A recomputed row may round a few ulps off ``top``: its
    exponent is at most 0 and the sum at least 1 (:func:`_at_least_one`).

    Derivatives come from ``again`` only (``y``'s are never computed): ``top + log
    sum`` does not change with a finite top, so its tangent is 0 and the sum's is
    ``sum * softmax(again) . dagain``; a non-finite top takes the tangent of the
    rows equal to it (every row for NaN), which finalize turns into NaN, as
    ``jax.grad(jax.nn.logsumexp)`` gives."""
    top = jnp.max(y, axis=0)
    s = jnp.sum(jnp.exp(_at_most_0(again - _spread(_finite_or_zero(top), again))), axis=0)
    return top, _at_least_one(s, top)


@_two_passes.defjvp
def _two_passes_jvp(primals: tuple, tangents: tuple) -> tuple:
    (y, again), (_, dagain) = primals, tangents
    top, s = _two_passes(y, again)
    finite = jnp.isfinite(top)
    # The softmax of the rows as computed here, stored once (read by two passes):
    # its weights sum to 1 whatever the rounding of y's other computations.
    once = lax.optimization_barrier(again)
    own = jnp.max(once, axis=0)
    e = jnp.exp(once - _spread(_finite_or_zero(own), once))
    norm = jnp.where(finite, s / jnp.sum(e, axis=0), 0)  # never 0 / 0: its transpose
    ds = norm * jnp.sum(e * dagain, axis=0)
    # (only ever multiplied by NaN: finalize's _undefined_derivative)
    dtop = jnp.where(finite, 0, _shares(again, top, dagain))
    return (top, s), (dtop.astype(top.dtype), ds.astype(s.dtype))


# The maxima that shift the sums, with jnp.max's and jnp.maximum's derivatives (the
# tied rows share the tangent evenly; every row for a NaN maximum) written as selects,
# not products with a 0/1 indicator. A non-finite maximum's derivative is NaN
# (_undefined_derivative): in reverse mode that NaN cotangent must reach only the rows
# holding the maximum, as in jax.grad(jax.nn.logsumexp) (0 elsewhere). jax's rules
# transpose to NaN * 0 = NaN on every other row, and on every row of a chunk whose
# own finite maximum lost the merge (the scan engine's gradient by y of a pairwise
# logsumexp was NaN at each chunk's top beside a +inf pair).
@jax.custom_jvp
def _top(y: jax.Array) -> jax.Array:
    """``jnp.max(y, axis=0)`` as the shift of a sum of ``exp(y - top)``: no derivative
    where it is finite (``jax.nn.logsumexp``'s ``stop_gradient``; the shift cancels,
    and the top row's infinite tangent would meet itself, inf - inf), else a select of
    the tied rows' tangents (:func:`_two_passes`'s ``dtop``)."""
    return jnp.max(y, axis=0)


@_top.defjvp
def _top_jvp(primals: tuple, tangents: tuple) -> tuple:
    (y,), (dy,) = primals, tangents
    top = _top(y)
    dtop = jnp.where(jnp.isfinite(top), jnp.zeros_like(top), _shares(y, top, dy))
    return top, dtop.astype(dy.dtype)


@jax.custom_jvp
def _join(a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.maximum(a, b)``, its derivative a select of the tied sides' tangents."""
    return jnp.maximum(a, b)


@_join.defjvp
def _join_jvp(primals: tuple, tangents: tuple) -> tuple:
    (a, b), (da, db) = primals, tangents
    top = _join(a, b)
    return top, _shares(jnp.stack([a, b]), top, jnp.stack([da, db]))


@jax.custom_jvp
def _native_top(lse: jax.Array, y: jax.Array) -> jax.Array:
    """``lse``, the logsumexp of the rows ``y`` (one native pass: a state of top
    ``lse`` and sum 1), whose tangent where it is not finite is :func:`_top`'s over
    ``y``: the native kernel's own (the softmax weights times the rows' tangents)
    would transpose the NaN cotangent of an infinite logsumexp onto every row of
    the chunk (0 weights times NaN)."""
    return lse


@_native_top.defjvp
def _native_top_jvp(primals: tuple, tangents: tuple) -> tuple:
    (lse, y), (dlse, dy) = primals, tangents
    return lse, jnp.where(jnp.isfinite(lse), dlse, _shares(y, lse, dy))


def _rescale(tops: Sequence[jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
    """The running maximum of several shifted states and each one's factor
    ``exp(top_i - max)`` onto it: 0 for the identity's -inf (never ``exp(0 - max)``,
    which overflows once every value seen is below about -88.7 in float32)."""
    top = functools.reduce(_join, tops)
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


def _softmax(y: jax.Array, top: jax.Array, total: jax.Array) -> jax.Array:
    """``exp(y - logsumexp)`` per row from the state of the rows ``y`` (their maximum
    ``top`` and shifted sum ``total``), as ``jax.grad(jax.nn.logsumexp)``: ``exp(y -
    top) / total``, never ``exp(y - (log(total) + top))``, whose rounded exponent is
    off by an ulp of the result (0.1% at scores of 1e4, all of it from 1e9 on). The
    exponent is at most 0 (a row computed again may exceed ``top`` by an ulp). A
    non-finite ``top`` gives JAX's ``exp(y - top)``: NaN on the rows equal to it (their
    exponents NaN, which the clamp keeps), 0 on the others (-inf). One exponential per
    value and a product by its row's reciprocal: the matmul tiles' reverse pass is
    made of these per pair."""
    scale = 1 / jnp.where(jnp.isfinite(top), total, jnp.ones_like(total))
    return jnp.exp(_at_most_0(y - _spread(top, y))) * _spread(scale, y)


def _own_softmax(y: jax.Array, b: jax.Array, dy: jax.Array, keep: Any) -> tuple:
    """A block's share of a logsumexp's tangent, ``sum_i b_i exp(y_i) dy_i`` over
    ``sum_i b_i exp(y_i)`` once merged, as ``(top, sum b exp(y - top), sum exp(y - top)
    dy)``: shifted by the maximum of the rows as this pass computes them, never by
    the forward pass's (another compilation of ``fun``, a last bit apart: 3e-4 off
    at values of 1e4, all of it from 1e9 on). Rows of ``keep`` 0 are left out."""
    y = lax.optimization_barrier(y)  # once: the maximum and the exponentials agree
    if keep is not None:
        y = jnp.where(_col(keep, y) > 0, y, jnp.full_like(y, -np.inf))
    top = jnp.max(y, axis=0)
    e = jnp.exp(y - _spread(_finite_or_zero(top), y))
    return top, jnp.sum(b * e, axis=0), jnp.sum(e * dy, axis=0)


def _own_init(raw: tuple) -> tuple:
    top, norm, d = raw
    return jnp.full_like(top, -np.inf), jnp.zeros_like(norm), jnp.zeros_like(d)


def _own_merge(a: tuple, b: tuple) -> tuple:
    top, (ea, eb) = _rescale([a[0], b[0]])
    return top, a[1] * ea + b[1] * eb, a[2] * ea + b[2] * eb


def _merge_sums(a: tuple, b: tuple) -> tuple:
    """Two ``(top, shifted sum, its rounding error)`` states merged: each rescaled onto
    the larger top, the sums added compensated (TwoSum). A state of non-finite top
    (summed with a shift of 0, as jax does) is kept whole, factor 1, and the others
    dropped (:func:`_rescale`)."""
    top, (ea, eb) = _rescale([a[0], b[0]])
    t, lost = _two_sum(a[1] * ea, b[1] * eb)
    return top, t, a[2] * ea + b[2] * eb + lost


def _drop(keep: Any, dtype: Any, xp: Any) -> Any:
    """Weights as bounds: ``inf`` keeps a row, ``-inf`` drops it (any weight > 0 keeps)."""
    return xp.where(xp.asarray(keep) > 0, np.inf, -np.inf).astype(dtype)
