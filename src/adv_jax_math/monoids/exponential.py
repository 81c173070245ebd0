"""Exponential families: ``LOGSUMEXP`` (``jax.nn.logsumexp``) and softmax-weighted
sums (``SOFTMAX_WEIGHTED``, :func:`softmax_weighted`). Both shift by their running
maximum (an online softmax) and sum compensated; a non-finite maximum finalizes as
itself, with the derivative ``jax.grad(jax.nn.logsumexp)`` gives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .base import Monoid, _col
from .numerics import Items, _float, _full, _inexact, _spread, _two_sum, _weigh, _wide
from .shifted import (
    _at_least_one,
    _at_most_0,
    _bound,
    _drop,
    _finite_or_zero,
    _log_shifted,
    _native_top,
    _own_init,
    _own_merge,
    _own_softmax,
    _rescale,
    _shifted,
    _softmax,
    _top,
    _two_passes,
)

__all__ = [
    "LOGSUMEXP",
    "SOFTMAX_WEIGHTED",
    "WEIGHTED_LOGSUMEXP",
    "LogSumExp",
    "SoftmaxWeighted",
    "WeightedLogSumExp",
    "softmax_weighted",
    "weighted_logsumexp",
]


# -- logsumexp --------------------------------------------------------------------------
class LogSumExp(Monoid):
    """``jax.nn.logsumexp(y, 0)``: shifted by the running maximum, compensated; ints
    become floats. The scan engine may fold a chunk with the native CPU kernel
    (:meth:`fold_native`)."""

    name, axes_all, reads_twice, native_kernel = "logsumexp", True, True, "logsumexp"
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

    def native_dtype(self, dtype: Any) -> np.dtype:
        return _wide(self.result_dtype(dtype))

    def _rows(self, ys: Sequence[jax.Array], w: Any) -> jax.Array:
        y = ys[0].astype(_wide(self.result_dtype(ys[0].dtype)))
        return y if w is None else _bound(y, _col(w, y))

    def fold_native(self, ys, w, kernel) -> Any:
        y = self._rows(ys, w)
        top = _native_top(kernel(y), y)  # one native pass, as a state of one row
        return top, jnp.ones_like(top), jnp.zeros_like(top)

    def fold_fast(self, ys, idx, w, again=None) -> Any:
        if again is None:  # the rows computed once (SoftmaxWeighted.fold_fast)
            return self.fold([lax.optimization_barrier(ys[0])], idx, w)
        # two passes, each reading the rows as fun makes them
        top, s = _two_passes(self._rows(ys, w), self._rows(again, w))
        return top, s, jnp.zeros_like(s)

    def fold(self, ys, idx, w) -> Any:
        y = self._rows(ys, w)
        top = _top(y)  # (jnp.max, its derivative NaN only on the rows at an infinite top)
        s = jnp.sum(jnp.exp(_at_most_0(_shifted(y, top[None]))), axis=0)
        return top, _at_least_one(s, top), jnp.zeros_like(s)

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
        weight = _softmax(y.astype(state[0].dtype), state[0], state[1] + state[2])
        return (_weigh(_spread(ct, y) * weight, keep).astype(y.dtype),)

    def tangent(self, ys, dys, idx, keep, state, items) -> Any:
        y, dy = ys[0].astype(state[0].dtype), dys[0].astype(state[0].dtype)
        return _own_softmax(y, jnp.ones_like(y), dy, keep)

    tangent_init = staticmethod(lambda raw: _own_init(raw))
    tangent_merge = staticmethod(lambda a, b: _own_merge(a, b))

    def tangent_finish(self, raw: Any, state: Any, items: Items) -> Any:
        _, norm, d = raw
        ok = jnp.isfinite(state[0]) & (norm > 0)  # else no derivative, as jax's
        return d * jnp.where(ok, 1 / jnp.where(ok, norm, 1), jnp.nan).astype(d.dtype)


# -- softmax-weighted sums --------------------------------------------------------------
class _ExponentAndCompanion(Monoid):
    """A monoid over two leaves per row, an exponent and what it weighs (softmax
    scores and values; logsumexp exponents and weights): a row that does not exist
    has exponent -inf and a zero companion, a row dropped by the weights an exponent
    bounded to -inf."""

    arity = 2

    def fills(self, dtypes: Sequence[Any]) -> tuple:
        return np.asarray(-np.inf, _float(dtypes[0]))[()], np.zeros((), dtypes[1])[()]

    def encode(self, keep: Any, dtype: Any, xp: Any = np) -> Any:
        return _drop(keep, _wide(_float(dtype)), xp)


class SoftmaxWeighted(_ExponentAndCompanion):
    """``jnp.tensordot(jax.nn.softmax(scores, 0), values, ([0], [0]))`` for ``fun``
    returning ``(scores (n, *s), values (n, *v))``: the result is ``(*s, *v)``
    (attention for ``s = (queries,)``); with ``return_lse=True`` also
    ``jax.nn.logsumexp(scores, 0)``, to combine partial results across calls. An
    online softmax (Milakov & Gimelshein 2018), compensated."""

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

    def init(self, items: Items) -> Any:
        _, acc = self._dtypes(items)
        s, v = items
        both = jax.ShapeDtypeStruct(s.shape + v.shape, acc)
        zero = lambda it: _full(it, 0, acc)
        return _full(s, -np.inf, acc), zero(s), zero(s), zero(both), zero(both)

    def fold(self, ys, idx, w) -> Any:
        acc = self._dtypes([jax.ShapeDtypeStruct((), y.dtype) for y in ys])[1]
        s, v = (y.astype(acc) for y in ys)
        if w is not None:
            s = _bound(s, _col(w, s))
            if w.ndim == 1 or w.shape == v.shape:  # a dropped row's inf value: 0, not NaN
                v = jnp.where(_col(w, v) == np.inf, v, jnp.zeros_like(v))
        top = _top(s)  # (as LogSumExp.fold's: the lse's NaN derivative at an infinite top)
        # an infinite top is not shifted away: exp(inf - inf) is NaN, as jax.nn.softmax
        e = jnp.exp(s - _finite_or_zero(top)[None])
        weighted = self._weigh(e, v)
        return top, jnp.sum(e, axis=0), jnp.zeros_like(top), weighted, jnp.zeros_like(weighted)

    def fold_fast(self, ys, idx, w, again=None) -> Any:
        # The scores computed once: XLA fuses a cheap fun into both passes (the
        # maximum, the exponentials), where it may round differently (contracted
        # multiply-adds); at scores of 1e9 an ulp (128) is beyond exp's range, and
        # every row's weight came out 0 (0 / 0) or inf (inf / inf).
        return self.fold([lax.optimization_barrier(ys[0]), ys[1]], idx, w)

    @staticmethod
    def _weigh(e: jax.Array, v: jax.Array) -> jax.Array:
        """The values summed with the weights ``e`` over the rows: items ``(*s, *v)``."""
        if e.ndim == 1 or v.ndim == 1:  # one score or one value per row: no matvec
            # (Pallas Triton's dot takes 2-D operands only; Mosaic's fails on vectors)
            ev = e if e.ndim > 1 or v.ndim == 1 else lax.broadcast_in_dim(e, v.shape, (0,))
            ve = v if v.ndim > 1 or e.ndim == 1 else lax.broadcast_in_dim(v, e.shape, (0,))
            return jnp.sum(ev * ve, axis=0)
        return jnp.tensordot(e, v, axes=([0], [0]))

    def paired(self) -> SoftmaxWeighted:
        """This sum with values that share the scores' items (each item's score
        weighs its own value, not every item's): the tile kernels' fold of one score
        and one value per pair, the x rows the items of both."""
        return _Paired(self.return_lse)

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
        out, _ = self._parts(state)
        s, v = (y.astype(out.dtype) for y in ys)
        ct_out, ct_lse = ct if self.return_lse else (ct, None)
        p = _softmax(s, state[0], state[1] + state[2])
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
        out, _ = self._parts(state)
        s, v = (y.astype(out.dtype) for y in ys)
        ds, dv = (d.astype(out.dtype) for d in dys)
        p = _softmax(s, state[0], state[1] + state[2])
        if keep is not None:
            p = p * _col(keep, p).astype(p.dtype)
        pds = p * ds
        # d out = sum_i p_i (dv_i + ds_i (v_i - out)), each row's value centered
        # first: sum_i p_i ds_i v_i - d_lse * out cancels (a peaked softmax at scores
        # of 1e4: an error of 1e-3 where the derivative is 0)
        ns, nv = s.ndim - 1, v.ndim - 1
        centered = v.reshape(v.shape[:1] + (1,) * ns + v.shape[1:]) - out[None]
        via_s = jnp.sum(pds.reshape(pds.shape + (1,) * nv) * centered, axis=0)
        return jnp.tensordot(p, dv, axes=([0], [0])) + via_s, jnp.sum(pds, axis=0)

    def tangent_finish(self, raw: Any, state: Any, items: Items) -> Any:
        d_out, d_lse = raw
        return (d_out, d_lse) if self.return_lse else d_out


class _Paired(SoftmaxWeighted):
    """:meth:`SoftmaxWeighted.paired`: items ``s`` (the values' as well); in the tile
    kernels, the x rows of a tile's scores and of one of its values."""

    @staticmethod
    def _weigh(e: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(e * v, axis=0)


class WeightedLogSumExp(_ExponentAndCompanion):
    """``jax.nn.logsumexp(a, 0, b=b, return_sign=...)`` for ``fun`` returning
    ``(a (n, *t), b (n, *t))``: ``log |sum_i b_i exp(a_i)|`` (NaN where the sum is
    negative), with ``return_sign=True`` also its sign. Rows of weight 0 are left
    out (their ``a`` may be anything), as jax does; the running maximum of the kept
    ``a`` shifts the signed, compensated sum, and its derivative is ``jax.nn``'s
    (through the sum only)."""

    def __init__(self, return_sign: bool = False):
        self.return_sign = bool(return_sign)
        self.name = "weighted_logsumexp" + ("(return_sign=True)" if return_sign else "")

    def __repr__(self) -> str:
        return "adv_jax_math." + (
            "weighted_logsumexp(return_sign=True)" if self.return_sign else "WEIGHTED_LOGSUMEXP"
        )

    def _dtypes(self, items: Items) -> tuple[np.dtype, np.dtype]:
        a, b = items
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(
                f"{self!r}: fun returns (a, b) with rows of shapes {tuple(a.shape)} and "
                f"{tuple(b.shape)}; each row of a needs a weight in b of the same shape"
            )
        out = _float(jnp.result_type(a.dtype, b.dtype))
        return out, _wide(out)

    def init(self, items: Items) -> Any:
        _, acc = self._dtypes(items)
        return _full(items[0], -np.inf, acc), _full(items[0], 0, acc), _full(items[0], 0, acc)

    def _kept(self, ys: Sequence[jax.Array], acc: Any, w: Any = None) -> tuple:
        """``a`` where ``b != 0`` (else -inf) and ``b``, rows dropped by ``w`` (the
        encoded weights: inf keeps a row, -inf drops it) weighted 0."""
        a, b = (y.astype(acc) for y in ys)
        if w is not None:
            b = jnp.where(_col(w, b) == np.inf, b, jnp.zeros_like(b))
        return jnp.where(b != 0, a, jnp.full_like(a, -np.inf)), b

    def fold(self, ys, idx, w) -> Any:
        acc = self._dtypes([jax.ShapeDtypeStruct(y.shape[1:], y.dtype) for y in ys])[1]
        a, b = self._kept(ys, acc, w)
        top = lax.stop_gradient(jnp.max(a, axis=0))  # as jax.nn.logsumexp
        s = jnp.sum(b * jnp.exp(a - _finite_or_zero(top)[None]), axis=0)
        return top, s, jnp.zeros_like(s)

    def fold_fast(self, ys, idx, w, again=None) -> Any:
        # the exponents computed once, as SoftmaxWeighted.fold_fast's scores
        return self.fold([lax.optimization_barrier(ys[0]), ys[1]], idx, w)

    def merge(self, a: Any, b: Any) -> Any:
        # (a state of non-finite top summed with a shift of 0, as jax does: _rescale
        # keeps it whole, factor 1, and drops the others)
        top, (ea, eb) = _rescale([a[0], b[0]])
        t, lost = _two_sum(a[1] * ea, b[1] * eb)
        return top, t, a[2] * ea + b[2] * eb + lost

    def _parts(self, state: Any) -> tuple[jax.Array, jax.Array]:
        top, s, c = state
        total = s + c
        return jnp.log(jnp.abs(total)) + _finite_or_zero(top), jnp.sign(total)

    def finalize(self, state: Any, items: Items) -> Any:
        dtype = self._dtypes(items)[0]
        out, sign = self._parts(state)
        if self.return_sign:
            return out.astype(dtype), sign.astype(dtype)
        return jnp.where(sign < 0, jnp.full_like(out, np.nan), out).astype(dtype)

    def _weights(self, ys, keep, state) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``exp(a_i - top) / total`` per row (the derivative of the result by ``b_i``:
        0 for rows of weight 0 unless the total is 0, then NaN, as jax's), ``b``, and
        where the result has no derivative (a NaN for a negative sum: jax's where)."""
        top, s, c = state
        a, b = self._kept(ys, s.dtype)
        exponent = a - _spread(_finite_or_zero(top), a)  # at most 0 if top is finite
        exponent = jnp.where(_spread(jnp.isfinite(top), a), _at_most_0(exponent), exponent)
        p = jnp.exp(exponent) / _spread(s + c, a)
        if keep is not None:
            p = p * _col(keep, p).astype(p.dtype)
        return p, b, (jnp.sign(s + c) < 0) & (not self.return_sign)

    def tangent(self, ys, dys, idx, keep, state, items) -> Any:
        a, b = self._kept(ys, state[1].dtype)
        da, db = (d.astype(a.dtype) for d in dys)
        # a row of weight 0 takes no derivative by its a (jax's where), even a NaN one
        return _own_softmax(a, b, jnp.where(b != 0, b * da, 0) + db, keep)

    tangent_init = staticmethod(lambda raw: _own_init(raw))
    tangent_merge = staticmethod(lambda a, b: _own_merge(a, b))

    def tangent_finish(self, raw: Any, state: Any, items: Items) -> Any:
        _, total, d = raw  # (a total of 0: 0 / 0, NaN, as jax's)
        none = (jnp.sign(state[1] + state[2]) < 0) & (not self.return_sign)
        d = d * jnp.where(none, 0, 1 / jnp.where(none, 1, total)).astype(d.dtype)
        return (d, jnp.zeros_like(d)) if self.return_sign else d

    def cotangent(self, ct, ys, idx, keep, state, items, tally=None) -> tuple:
        p, b, none = self._weights(ys, keep, state)
        ct = jnp.where(none, 0, ct[0] if self.return_sign else ct)
        g = _spread(ct, p) * p
        cast = lambda c, y: c.astype(y.dtype) if _inexact(y.dtype) else None
        return cast(jnp.where(b != 0, g * b, 0), ys[0]), cast(g, ys[1])


LOGSUMEXP = LogSumExp()
SOFTMAX_WEIGHTED = SoftmaxWeighted()
WEIGHTED_LOGSUMEXP = WeightedLogSumExp()


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


def weighted_logsumexp(return_sign: bool = False) -> WeightedLogSumExp:
    """``jax.nn.logsumexp(a, 0, b=b, return_sign=return_sign)`` of ``fun`` returning
    ``(a, b)`` per row: a weighted, signed logsumexp (OTT-JAX's Sinkhorn steps with
    marginal weights; ``WEIGHTED_LOGSUMEXP`` is ``return_sign=False``).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> a, b = jnp.array([0.0, 1.0, 2.0]), jnp.array([1.0, -1.0, 2.0])
    >>> out, sign = ajm.batch_map(lambda r: r, (a, b), 2, reduction=ajm.weighted_logsumexp(True))
    >>> bool(jnp.allclose(out, jnp.log(jnp.abs(1 - jnp.e + 2 * jnp.e**2)))), float(sign)
    (True, 1.0)
    """
    return WeightedLogSumExp(return_sign)
