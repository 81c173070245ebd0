"""The logsumexp family: ``LOGSUMEXP`` (``jax.nn.logsumexp``) and the weighted,
signed ``WEIGHTED_LOGSUMEXP`` (:func:`weighted_logsumexp`); ``monoids.softmax`` holds
the softmax-weighted sums, over the same two leaves per row (exponent and
companion). They shift by their running maximum (an online softmax) and sum
compensated; a non-finite maximum finalizes as itself, with the derivative autodiff of
the shifted formula gives: NaN at a +inf row, 0 beside it (jax < 0.12.1's
``jax.grad(jax.nn.logsumexp)``; 0.12.1's is NaN at every row, docs/guides/gradients.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .base import Monoid, _col
from .numerics import Items, _float, _full, _inexact, _spread, _weigh, _wide
from .shifted import (
    _at_least_one,
    _at_most_0,
    _bound,
    _drop,
    _finite_or_zero,
    _log_shifted,
    _merge_sums,
    _native_top,
    _own_init,
    _own_merge,
    _own_softmax,
    _shifted,
    _softmax,
    _top,
    _two_passes,
)

__all__ = [
    "LOGSUMEXP",
    "WEIGHTED_LOGSUMEXP",
    "LogSumExp",
    "WeightedLogSumExp",
    "weighted_logsumexp",
]


class LogSumExp(Monoid):
    """``jax.nn.logsumexp(y, 0)``: shifted by the running maximum, compensated; ints
    become floats. The scan engine may fold a chunk with the native CPU kernel
    (:meth:`fold_native`)."""

    name, reads_twice, native_kernel = "logsumexp", True, "logsumexp"
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
        if again is None:  # the rows computed once (_ExponentAndCompanion.fold_fast)
            return self.fold([lax.optimization_barrier(ys[0])], idx, w)
        # two passes, each reading the rows as fun makes them
        top, s = _two_passes(self._rows(ys, w), self._rows(again, w))
        return top, s, jnp.zeros_like(s)

    def fold(self, ys, idx, w) -> Any:
        y = self._rows(ys, w)
        top = _top(y)  # (jnp.max, its derivative NaN only on the rows at an infinite top)
        s = jnp.sum(jnp.exp(_at_most_0(_shifted(y, _spread(top, y)))), axis=0)
        return top, _at_least_one(s, top), jnp.zeros_like(s)

    def merge(self, a: Any, b: Any) -> Any:
        return _merge_sums(a, b)

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

    def fold_fast(self, ys, idx, w, again=None) -> Any:
        # The exponents computed once: XLA fuses a cheap fun into both passes (the
        # maximum, the exponentials), where it may round differently (contracted
        # multiply-adds); at scores of 1e9 an ulp (128) is beyond exp's range, and
        # every row's weight came out 0 (0 / 0) or inf (inf / inf).
        return self.fold([lax.optimization_barrier(ys[0]), ys[1]], idx, w)

    @staticmethod
    def _cotangents(cts: tuple, ys: Sequence[jax.Array]) -> tuple:
        """The rows' cotangents in their dtypes (None for integer leaves)."""
        pairs = zip(cts, ys, strict=True)
        return tuple(c.astype(y.dtype) if _inexact(y.dtype) else None for c, y in pairs)


class WeightedLogSumExp(_ExponentAndCompanion):
    """``jax.nn.logsumexp(a, 0, b=b, return_sign=...)`` for ``fun`` returning
    ``(a (n, *t), b (n, *u))``: ``log |sum_i b_i exp(a_i)|`` (NaN where the sum is
    negative), ``t`` and ``u`` broadcast as ``jax.nn.logsumexp``'s ``a`` and ``b``
    (a weight per row, ``b (n,)`` or ``(n, 1)``, against vectors ``a``), with
    ``return_sign=True`` also its sign. Rows of weight 0 are left out (their ``a`` may
    be anything), as jax does; the running maximum of the kept ``a`` shifts the
    signed, compensated sum, and its derivative is ``jax.nn``'s (through the sum
    only)."""

    broadcasts = True

    def __init__(self, return_sign: bool = False):
        self.return_sign = bool(return_sign)
        self.name = "weighted_logsumexp" + ("(return_sign=True)" if return_sign else "")

    def __repr__(self) -> str:
        return "adv_jax_math." + (self.name if self.return_sign else "WEIGHTED_LOGSUMEXP")

    def _dtypes(self, items: Items) -> tuple[np.dtype, np.dtype]:
        self._shape(items)
        out = _float(jnp.result_type(items[0].dtype, items[1].dtype))
        return out, _wide(out)

    def _shape(self, items: Items) -> tuple[int, ...]:
        """The shape of one row's result: ``a``'s and ``b``'s, broadcast (as
        ``jax.nn.logsumexp``'s ``b``: a weight per row against a vector ``a``)."""
        a, b = items
        try:
            return tuple(np.broadcast_shapes(tuple(a.shape), tuple(b.shape)))
        except ValueError:
            raise ValueError(
                f"{self!r}: fun returns (a, b) with rows of shapes {tuple(a.shape)} and "
                f"{tuple(b.shape)}, which do not broadcast; b weighs a as "
                "jax.nn.logsumexp's b does: give each row of b a shape that broadcasts "
                "against a's (a weight per row: shape (), or (1,))"
            ) from None

    def init(self, items: Items) -> Any:
        _, acc = self._dtypes(items)
        row = jax.ShapeDtypeStruct(self._shape(items), acc)
        return _full(row, -np.inf), _full(row, 0), _full(row, 0)

    def _kept(self, ys: Sequence[jax.Array], acc: Any, w: Any = None) -> tuple:
        """``a`` where ``b != 0`` (else -inf) and ``b``, rows dropped by ``w`` (the
        encoded weights: inf keeps a row, -inf drops it) weighted 0; both broadcast
        to one shape."""
        a, b = (y.astype(acc) for y in _broadcast(ys))
        if w is not None:
            b = jnp.where(_col(w, b) == np.inf, b, jnp.zeros_like(b))
        return jnp.where(b != 0, a, jnp.full_like(a, -np.inf)), b

    def fold(self, ys, idx, w) -> Any:
        acc = self._dtypes([jax.ShapeDtypeStruct(y.shape[1:], y.dtype) for y in ys])[1]
        a, b = self._kept(ys, acc, w)
        top = lax.stop_gradient(jnp.max(a, axis=0))  # as jax.nn.logsumexp
        s = jnp.sum(b * jnp.exp(a - _spread(_finite_or_zero(top), a)), axis=0)
        return top, s, jnp.zeros_like(s)

    def merge(self, a: Any, b: Any) -> Any:
        return _merge_sums(a, b)

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
        da, db = (d.astype(a.dtype) for d in _broadcast(dys))
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
        cts = (jnp.where(b != 0, g * b, 0), g)
        return self._cotangents(tuple(_unbroadcast(c, y) for c, y in zip(cts, ys, strict=True)), ys)


def _broadcast(ys: Sequence[jax.Array]) -> list[jax.Array]:
    """Rows ``(rows, *t)`` of several shapes ``t`` broadcast to one, as NumPy
    broadcasts the shapes ``t`` (aligned at their last axes); as they are if equal
    (inside the kernels, always)."""
    if all(y.shape == ys[0].shape for y in ys):
        return list(ys)
    t = np.broadcast_shapes(*(y.shape[1:] for y in ys))
    lift = lambda y: y.reshape(y.shape[:1] + (1,) * (len(t) + 1 - y.ndim) + y.shape[1:])
    return [jnp.broadcast_to(lift(y), y.shape[:1] + t) for y in ys]


def _unbroadcast(ct: jax.Array, y: jax.Array) -> jax.Array:
    """The cotangent ``(rows, *t)`` of rows ``y`` that :func:`_broadcast` spread to
    ``t``: summed back over the axes it spread them along."""
    if ct.shape == y.shape:
        return ct
    lead = ct.ndim - y.ndim
    spread = [lead + i for i in range(1, y.ndim) if y.shape[i] == 1 and ct.shape[lead + i] != 1]
    return jnp.sum(ct, axis=(*range(1, lead + 1), *spread)).reshape(y.shape)


LOGSUMEXP = LogSumExp()
WEIGHTED_LOGSUMEXP = WeightedLogSumExp()


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
