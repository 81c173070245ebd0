"""Softmax-weighted sums: ``SOFTMAX_WEIGHTED`` (:func:`softmax_weighted`), the
values ``fun`` returns weighted by the softmax of its scores over the rows
(attention), with the logsumexp of the scores on request. An online softmax, shifted
by the running maximum and summed compensated as the logsumexp family
(``monoids.exponential``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .base import _col
from .exponential import _ExponentAndCompanion
from .numerics import Items, _float, _full, _spread, _two_sum, _wide
from .shifted import _bound, _finite_or_zero, _log_shifted, _rescale, _softmax, _top

__all__ = ["SOFTMAX_WEIGHTED", "SoftmaxWeighted", "softmax_weighted"]


class SoftmaxWeighted(_ExponentAndCompanion):
    """``jnp.tensordot(jax.nn.softmax(scores, 0), values, ([0], [0]))`` for ``fun``
    returning ``(scores (n, *s), values (n, *v))``: the result is ``(*s, *v)``
    (attention for ``s = (queries,)``); with ``heads=k``, the scores' last ``k`` axes
    pair with the values' first ``k`` (heads: ``s = (*a, *h)``, ``v = (*h, *u)``, the
    result ``(*a, *h, *u)``); with ``return_lse=True`` also
    ``jax.nn.logsumexp(scores, 0)``, to combine partial results across calls. An
    online softmax (Milakov & Gimelshein 2018), compensated."""

    def __init__(self, return_lse: bool = False, heads: int = 0):
        if isinstance(heads, bool):
            heads = int(heads)
        if not isinstance(heads, int) or heads < 0:
            raise TypeError(
                f"softmax_weighted: heads={heads!r}; pass True (the scores' last axis "
                "pairs with the values' first: one score per head), or the number of "
                "axes that pair"
            )
        self.return_lse, self.heads = bool(return_lse), heads
        options = [f"heads={heads}"] * bool(heads) + ["return_lse=True"] * self.return_lse
        self.name = "softmax_weighted" + (f"({', '.join(options)})" if options else "")

    def __repr__(self) -> str:
        return "adv_jax_math." + (
            self.name if self.name != "softmax_weighted" else "SOFTMAX_WEIGHTED"
        )

    def _paired_shape(self, s: tuple, v: tuple) -> tuple:
        """The result's shape for rows of scores ``s`` and values ``v``: ``(*s, *v)``, or
        with heads ``(*s, *v[heads:])``, the heads checked."""
        k = self.heads
        if k and (len(s) < k or len(v) < k or tuple(s[len(s) - k :]) != tuple(v[:k])):
            raise ValueError(
                f"{self!r}: fun returns (scores, values) with rows of shapes {tuple(s)} and "
                f"{tuple(v)}; with heads={k} the scores' last {k} axes pair with the values' "
                f"first {k} and must be equal (scores (..., heads), values (heads, ...))"
            )
        return (*s, *v[k:])

    def _dtypes(self, items: Items) -> tuple[np.dtype, np.dtype]:
        out = _float(jnp.result_type(items[0].dtype, items[1].dtype))
        return out, _wide(out)

    def init(self, items: Items) -> Any:
        _, acc = self._dtypes(items)
        s, v = items
        both = jax.ShapeDtypeStruct(self._paired_shape(s.shape, v.shape), acc)
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
        e = jnp.exp(s - _spread(_finite_or_zero(top), s))  # (one broadcast: Mosaic GPU)
        weighted = self._weigh(e, v) if not self.heads else self._pair(e, v)
        return top, jnp.sum(e, axis=0), jnp.zeros_like(top), weighted, jnp.zeros_like(weighted)

    @staticmethod
    def _weigh(e: jax.Array, v: jax.Array) -> jax.Array:
        """The values summed with the weights ``e`` over the rows: items ``(*s, *v)``."""
        if e.ndim == 1 or v.ndim == 1:  # one score or one value per row: no matvec
            # (Pallas Triton's dot takes 2-D operands only; Mosaic's fails on vectors)
            ev = e if e.ndim > 1 or v.ndim == 1 else lax.broadcast_in_dim(e, v.shape, (0,))
            ve = v if v.ndim > 1 or e.ndim == 1 else lax.broadcast_in_dim(v, e.shape, (0,))
            return jnp.sum(ev * ve, axis=0)
        return jnp.tensordot(e, v, axes=([0], [0]))

    def _pair(self, p: jax.Array, v: jax.Array) -> jax.Array:
        """With heads: ``sum_i p[i, *a, *h] v[i, *h, *u]``, ``(*a, *h, *u)``: one
        matmul per head."""
        k, na = self.heads, p.ndim - 1 - self.heads
        h_p, h_v = list(range(1 + na, p.ndim)), list(range(1, 1 + k))
        out = lax.dot_general(p, v, (([0], [0]), (h_p, h_v)))  # (*h, *a, *u)
        return jnp.moveaxis(out, list(range(k)), list(range(na, na + k)))

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
        out = jnp.zeros(self._paired_shape(items[0].shape, items[1].shape), dtype)  # no rows
        return (out, jnp.full(items[0].shape, -jnp.inf, dtype)) if self.return_lse else out

    def _centered(self, ys: Any, keep: Any, state: Any) -> tuple[jax.Array, jax.Array]:
        """What both derivatives are made of: the rows' softmax weights ``p``, ``(rows,
        *s)`` (times ``keep``), and each row's value less the result, ``(rows, *s, *v)``."""
        out, _ = self._parts(state)
        s, v = (y.astype(out.dtype) for y in ys)
        p = _softmax(s, state[0], state[1] + state[2])
        if keep is not None:
            p = p * _col(keep, p).astype(p.dtype)
        lift = (1,) * (s.ndim - 1 - self.heads)
        return p, v.reshape(v.shape[:1] + lift + v.shape[1:]) - out[None]

    def cotangent(self, ct, ys, idx, keep, state, items, tally=None) -> tuple:
        p, centered = self._centered(ys, keep, state)
        ct_out, ct_lse = ct if self.return_lse else (ct, None)
        ns, nv = p.ndim - 1, centered.ndim - p.ndim
        # out[S, V] = sum_i p_i[S] v_i[V]: d/dv_i = sum over S of p_i ct, and
        # d/ds_i = p_i (<ct, v_i - out> over V + ct_lse)
        if self.heads:  # the same per head: matmuls batched over the heads
            ct_v, ct_s = self._heads_cotangents(p, ys[1].astype(p.dtype), ct_out, state)
        elif ns and nv:  # every score with every value: <ct, v_i> - <ct, out> as matmuls
            # (flash attention's dO V^T - delta), not (rows, *s, *v) centered values
            ct_v = jnp.tensordot(p, ct_out, axes=(list(range(1, ns + 1)), list(range(ns))))
            v = ys[1].astype(p.dtype)
            over_v = list(range(ns, ns + nv))
            delta = jnp.sum(ct_out * self._parts(state)[0], axis=tuple(over_v))
            ct_s = p * (jnp.tensordot(v, ct_out, axes=(list(range(1, nv + 1)), over_v)) - delta)
        else:
            ct_v = jnp.tensordot(p, ct_out, axes=(list(range(1, ns + 1)), list(range(ns))))
            ct_s = p * jnp.sum(ct_out[None] * centered, axis=tuple(range(p.ndim, centered.ndim)))
        if ct_lse is not None:
            ct_s = ct_s + p * _spread(ct_lse, p)
        return self._cotangents((ct_s, ct_v), ys)

    def _heads_cotangents(self, p, v, ct, state) -> tuple[jax.Array, jax.Array]:
        """With heads (``p (i, *a, *h)``, ``v (i, *h, *u)``, ``ct (*a, *h, *u)``): the
        values' cotangents ``sum_a p ct`` and the scores' ``p (<v_i, ct> - delta)``
        over ``u`` (flash attention's ``dO V^T - delta``), matmuls per head."""
        k, na = self.heads, p.ndim - 1 - self.heads
        a_p, h_p = list(range(1, 1 + na)), list(range(1 + na, p.ndim))
        a_c, h_c = list(range(na)), list(range(na, na + k))
        u_c = list(range(na + k, ct.ndim))
        ct_v = lax.dot_general(p, ct, ((a_p, a_c), (h_p, h_c)))  # (*h, i, *u)
        ct_v = jnp.moveaxis(ct_v, k, 0)
        u_v = list(range(1 + k, v.ndim))
        vc = lax.dot_general(v, ct, ((u_v, u_c), (list(range(1, 1 + k)), h_c)))  # (*h, i, *a)
        vc = jnp.moveaxis(vc, list(range(k)), list(range(1 + na, 1 + na + k)))
        delta = jnp.sum(ct * self._parts(state)[0], axis=tuple(u_c))
        return ct_v, p * (vc - _spread(delta, vc))

    def tangent(self, ys, dys, idx, keep, state, items) -> Any:
        p, centered = self._centered(ys, keep, state)
        ds, dv = (d.astype(p.dtype) for d in dys)
        pds = p * ds
        # d out = sum_i p_i (dv_i + ds_i (v_i - out)), each row's value centered
        # first: sum_i p_i ds_i v_i - d_lse * out cancels (a peaked softmax at scores
        # of 1e4: an error of 1e-3 where the derivative is 0)
        spread = pds.reshape(pds.shape + (1,) * (centered.ndim - p.ndim))
        via_s = jnp.sum(spread * centered, axis=0)
        via_v = self._pair(p, dv) if self.heads else jnp.tensordot(p, dv, axes=([0], [0]))
        return via_v + via_s, jnp.sum(pds, axis=0)

    def tangent_finish(self, raw: Any, state: Any, items: Items) -> Any:
        d_out, d_lse = raw
        return (d_out, d_lse) if self.return_lse else d_out


class _Paired(SoftmaxWeighted):
    """:meth:`SoftmaxWeighted.paired`: items ``s`` (the values' as well); in the tile
    kernels, the x rows of a tile's scores and of one of its values."""

    @staticmethod
    def _weigh(e: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(e * v, axis=0)


SOFTMAX_WEIGHTED = SoftmaxWeighted()


def softmax_weighted(return_lse: bool = False, heads: bool | int = False) -> SoftmaxWeighted:
    """Softmax-weighted sums of ``fun``'s ``(scores, values)`` over the rows, as
    ``jnp.tensordot(jax.nn.softmax(scores, 0), values, ([0], [0]))``.

    ``fun`` returns ``scores`` of shape ``(n, *s)`` and ``values`` of ``(n, *v)``; the
    result has shape ``(*s, *v)`` (attention over keys for ``s = (queries,)``), computed
    as an online softmax without the ``(n, *s)`` weights. With ``return_lse=True`` the
    result is ``(weighted sum, jax.nn.logsumexp(scores, 0))``, so that partial results
    of several calls or devices can be combined. ``SOFTMAX_WEIGHTED`` is
    ``softmax_weighted()``.

    ``heads=True`` pairs scores and values head by head: the scores' last axis with the
    values' first, scores ``(n, *a, h)`` and values ``(n, h, *u)`` giving
    ``(*a, h, *u)`` (multi-head attention: one score per head, ``(h,)``, and a value
    vector per head, ``(h, d)``: the result ``(h, d)``, not every score with every
    value's ``(h, h, d)``). An int pairs that many axes.

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

    Two heads, each with its own scores and 2-vectors:

    >>> s2 = jnp.stack([scores, -scores], 1)              # (3 rows, 2 heads)
    >>> v2 = jnp.stack([jnp.stack([values, values], 1), jnp.ones((3, 2))], 1)
    >>> ajm.batch_map(lambda r: r, (s2, v2), 2, reduction=ajm.softmax_weighted(heads=True))
    Array([[4., 4.],
           [1., 1.]], dtype=float32)
    """
    if not return_lse and not heads:
        return SOFTMAX_WEIGHTED
    return SoftmaxWeighted(return_lse=return_lse, heads=heads)
