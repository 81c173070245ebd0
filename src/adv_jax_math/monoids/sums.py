"""Sums and moments: ``ADD`` (``jnp.sum``), ``MEAN``, ``VAR``, ``MEAN_VAR`` and
:func:`var`. Float sums carry the rounding error of every merge (TwoSum), so a
chunked sum is as exact as ``jnp.sum``; means and variances merge by Chan's update."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .base import Monoid, _col, index_dtype
from .numerics import Items, _full, _inexact, _spread, _two_sum, _weigh, _wide

__all__ = ["ADD", "MEAN", "MEAN_VAR", "VAR", "Moments", "Sum", "var"]


# -- sum ----------------------------------------------------------------------------
class Sum(Monoid):
    """``jnp.sum(y, 0)``: promotes like ``jnp.sum`` (bool and narrow integers to the
    default integer), accumulates 16-bit floats in float32, compensated."""

    name, halves = "add", True
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
        zero = _full(items[0], 0, self._acc(items[0].dtype))
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
        d = y - _spread(mean, y)
        # d * (d * w): a padded row (w = 0) far from the mean adds 0, not inf * 0
        m2 = jnp.sum(d * d if w is None else d * (d * w), axis=0)
        return halves, mean, jnp.zeros_like(mean), m2, jnp.zeros_like(m2)

    def merge(self, a: Any, b: Any) -> Any:
        ha, ma, ca, qa, cqa = a
        hb, mb, cb, qb, cqb = b
        h = ha + hb
        na, nb = ha.astype(ma.dtype) / 2, hb.astype(ma.dtype) / 2
        n = jnp.where(h > 0, h.astype(ma.dtype) / 2, 1)
        delta = (mb - ma) + (cb - ca)
        mean, lost = _chan_mean(ma, mb, delta, na / n, nb / n)
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
            # an infinite mean: NaN, as the variance's (not inf from y - mean)
            scale = scale * jnp.where(jnp.isfinite(mean), 1, jnp.nan).astype(scale.dtype)
            out = out + _spread(scale, y) * (y.astype(mean.dtype) - _spread(mean, y))
        return (_weigh(out, keep).astype(y.dtype),)

    def tangent(self, ys, dys, idx, keep, state, items) -> Any:
        _, mean, _ = self._stats(state)
        y, dy = ys[0].astype(mean.dtype), _weigh(dys[0].astype(mean.dtype), keep)
        return jnp.sum(dy, axis=0), jnp.sum((y - _spread(mean, y)) * dy, axis=0)

    def tangent_finish(self, raw: Any, state: Any, items: Items) -> Any:
        n, _, _ = self._stats(state)
        d_mean = raw[0] / n
        d_var = 2 * raw[1] / self._dof(n)
        parts = ([d_mean] if self.mean else []) + ([d_var] if self.variance else [])
        return tuple(parts) if len(parts) == 2 else parts[0]


@jax.custom_jvp
def _chan_mean(ma: jax.Array, mb: jax.Array, delta: jax.Array, wa: Any, wb: Any) -> tuple:
    """Chan's merged mean ``ma + delta * wb`` (``delta = mb - ma``, compensated; ``wa``,
    ``wb`` each state's share of the rows) and its rounding error (TwoSum)."""
    return _two_sum(ma, delta * wb)


@_chan_mean.defjvp
def _chan_mean_jvp(primals: tuple, tangents: tuple) -> tuple:
    # The weighted mean's tangent dma wa + dmb wb (each 0 where its share is): Chan's
    # own, dma + (dmb - dma) wb, is inf - inf = NaN for a row's infinite tangent
    # (jax.jvp(jnp.mean) of sqrt at 0 is inf). The error has none (TwoSum's).
    wa, wb = primals[3:]
    dma, dmb = tangents[:2]
    mean, lost = _chan_mean(*primals)
    share = lambda d, w: jnp.where(w == 0, jnp.zeros_like(d), d * w)
    return (mean, lost), (share(dma, wa) + share(dmb, wb), jnp.zeros_like(lost))


ADD = Sum()
MEAN = Moments(mean=True, variance=False)
VAR = Moments(mean=False, variance=True)
MEAN_VAR = Moments(mean=True, variance=True)


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
