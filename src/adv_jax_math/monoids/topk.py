"""Top-k: the ``k`` largest (or smallest) rows per trailing element with their global
row indices, as ``lax.top_k`` along the rows (:func:`top_k`). States merge by a
bitonic network; the scan engine folds a chunk with one ``lax.top_k``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .base import Monoid, _col, index_dtype
from .numerics import Items, _full, _inexact, _spread
from .topk_networks import empty_row, merge_sorted, merge_stacked, select

__all__ = ["TopK", "top_k"]


def _slot(a: jax.Array | list, j: int) -> jax.Array:
    """``a[j]`` as a masked sum over the leading axis (exact: one nonzero term), not a
    slice: Pallas Triton has no lowering for ``slice``; of a list (one element's slots,
    in Mosaic GPU's backward kernel), its item."""
    if isinstance(a, list):
        return a[j]
    lead = lax.broadcasted_iota(np.int32, a.shape, 0)
    return jnp.sum(jnp.where(lead == j, a, jnp.zeros_like(a)), axis=0)


def _rows_sharded(y: jax.Array) -> bool:
    """Whether ``y``'s rows are sharded in its type (an Explicit mesh axis)."""
    spec = tuple(getattr(getattr(jax.typeof(y), "sharding", None), "spec", None) or ())
    return bool(spec) and spec[0] is not None


# -- top-k ------------------------------------------------------------------------------
def _order_key(y: jax.Array) -> jax.Array:
    """Integers ordered as XLA's total order of ``y`` (-inf below -0 below +0), the
    order ``lax.top_k`` selects by, except that every NaN, whatever its sign bit, is
    above +inf: XLA does not keep a NaN's sign through arithmetic (``-(0.7 * s)`` may
    be computed as ``-0.7 * s``), so the sign cannot rank it. Bools as int32."""
    if not _inexact(y.dtype):
        return y.astype(jnp.int32) if y.dtype == np.bool_ else y
    wide, ints = (np.float64, np.int64) if y.dtype == np.float64 else (np.float32, np.int32)
    bits = lax.bitcast_convert_type(y.astype(wide), ints)
    key = jnp.where(bits < 0, bits ^ np.iinfo(ints).max, bits)
    return jnp.where(jnp.isnan(y), np.iinfo(ints).max, key)


def _from_key(key: jax.Array, dtype: Any) -> jax.Array:
    """The value of an order key (a NaN's: a NaN)."""
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
    never negated, which wraps); ``(values, indices)``, each ``(k, *t)``. Floats in
    ``lax.top_k``'s order (-0.0 below +0.0), every NaN above +inf whatever its sign
    bit. The state keeps each slot's value and row (its order key is computed from
    the value where slots are compared); derivatives of every order go to the
    selected rows, as ``jax.grad`` of ``lax.top_k``."""

    selects = sorts = True
    native_kernel = "topk"  # kernels.native.topk_fold, in :meth:`fold_into`

    def __init__(self, k: int, smallest: bool = False):
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"top_k(k={k!r}): k must be a positive int")
        self.k, self.smallest = int(k), bool(smallest)
        self.name = f"top_k({self.k}{', smallest=True' if smallest else ''})"

    def __repr__(self) -> str:
        return f"adv_jax_math.{self.name}"

    def _key(self, y: jax.Array) -> jax.Array:
        """The order key of ``y``, the best highest: :func:`_order_key`, bit-inverted
        for ``smallest`` (``~key`` reverses the order exactly, where ``-y`` would wrap
        integers and turn NaN to rank by its sign)."""
        key = _order_key(y)
        return ~key if self.smallest else key

    def _value(self, key: jax.Array, dtype: Any) -> jax.Array:
        """The value of a key of :meth:`_key` (a slot's dtype, :meth:`_value_dtype`)."""
        value = _from_key(~key if self.smallest else key, dtype)
        return value.astype(self._value_dtype(dtype))

    def _key_min(self, dtype: Any) -> Any:
        return np.iinfo(jax.eval_shape(self._key, jax.ShapeDtypeStruct((1,), dtype)).dtype).min

    @staticmethod
    def _value_dtype(dtype: Any) -> np.dtype:
        """A slot's value: at least 32 bits (Mosaic makes scalars of 32-bit vectors)."""
        dtype = np.dtype(dtype)
        if dtype.itemsize >= 4:
            return dtype
        return np.dtype(np.float32 if _inexact(dtype) else np.int32)

    def fill(self, dtype: Any) -> Any:
        return np.zeros((), dtype)[()]  # never selected: fold leaves out weight-0 rows

    def init(self, items: Items) -> Any:
        dtype = items[0].dtype
        slots = lambda value, dt: tuple(_full(items[0], value, dt) for _ in range(self.k))
        # an empty slot: row EMPTY (ranked below every row, whatever its value)
        return slots(0, self._value_dtype(dtype)), slots(empty_row(), index_dtype())

    def fold(self, ys, idx, w) -> Any:
        """k passes of max-and-remove (any engine, kernels included); the values are
        read back from the keys (exact, with no derivative: kernels are never
        differentiated, :meth:`fold_fast` is)."""
        y = ys[0]
        key = self._key(y)
        rows = jnp.broadcast_to(_col(idx.astype(index_dtype()), y), y.shape)
        alive = jnp.ones(y.shape, bool) if w is None else jnp.broadcast_to(_col(w > 0, y), y.shape)
        keys, sel = select(self.k, [(key, rows, alive, 0)], self._key_min(y.dtype))
        fill = lambda v, r: jnp.where(r == empty_row(), jnp.zeros_like(v), v)  # as init's
        values = [self._value(kk, y.dtype) for kk in keys]
        return tuple(fill(v, r) for v, r in zip(values, sel, strict=True)), sel

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
        # a - (p - p), not a + (p - p): -0.0 + 0.0 is +0.0, and -0.0 ranks below +0.0
        tie = lambda a, p: jnp.where(jnp.isfinite(a), a - (lax.stop_gradient(p) - p), a)
        return tuple(tie(a, pick(s)) for a, s in zip(values, sel, strict=True)), sel

    def fold_fast(self, ys, idx, w, again=None) -> Any:
        """One ``lax.top_k`` over the rows (XLA's TopK, the lower row first on equal
        values) instead of k passes of max-and-remove; not in kernels. Floats of 32
        bits or fewer are ranked as float32 (XLA:CPU sorts integer keys in full; the
        total order is the same), others by their keys. Rows of weight 0 (repeated)
        rank last: floats leave the slots they still take empty, as those past a
        block of fewer rows than k; integers (where a row may tie with them) take
        :meth:`fold` there. The values are gathered from ``y``: differentiable
        (second derivatives)."""
        y = ys[0]
        slow = lambda: self._picked(y, idx, self.fold(ys, idx, w))
        floats = _inexact(y.dtype) and np.dtype(y.dtype).itemsize <= 4
        if (y.shape[0] < self.k and not floats) or _rows_sharded(y):  # lax.top_k: unsharded
            return slow()
        rank = self._key(y)
        if floats:  # every NaN as +NaN (above +inf), or -NaN (below -inf) for smallest
            f = y.astype(np.float32)
            nan = np.float32(-np.nan if self.smallest else np.nan)
            rank = jnp.where(jnp.isnan(f), nan, -f if self.smallest else f)
        alive = None if w is None else jnp.broadcast_to(_col(w > 0, y), y.shape)
        if alive is not None:  # below everything: a -NaN of all bits set, or the lowest key
            low = np.array(-1, np.int32).view(np.float32) if floats else self._key_min(y.dtype)
            rank = jnp.where(alive, rank, low)
        rows = jnp.broadcast_to(_col(idx.astype(index_dtype()), y), y.shape)
        _, pos = lax.top_k(jnp.moveaxis(rank, 0, -1), min(self.k, y.shape[0]))  # (*t, k)
        take = lambda a: tuple(jnp.moveaxis(jnp.take_along_axis(a, pos, axis=-1), -1, 0))
        v = y.astype(self._value_dtype(y.dtype))
        fast = take(jnp.moveaxis(v, 0, -1)), take(jnp.moveaxis(rows, 0, -1))
        if alive is not None and floats:
            # the left-out rows rank below every row (a NaN no value ranks as): those
            # chosen come last, empty slots (as fold's, and those past the rows)
            chosen = take(jnp.moveaxis(alive, 0, -1))
            emptied = lambda part, e: tuple(
                jnp.where(c, a, jnp.full_like(a, e)) for a, c in zip(part, chosen, strict=True)
            )
            fast = emptied(fast[0], 0), emptied(fast[1], empty_row())
        if floats:  # slots past the rows: empty
            empty = self.init([jax.ShapeDtypeStruct(y.shape[1:], y.dtype)])
            fast = tuple(f + e[len(f) :] for f, e in zip(fast, empty, strict=True))
        if alive is None or floats:
            return fast
        picked = jnp.take_along_axis(jnp.moveaxis(alive, 0, -1), pos, axis=-1)
        return lax.cond(jnp.all(picked), lambda: fast, slow)

    def fold_into(self, acc, ys, idx, w, native=None) -> Any:
        """:meth:`merge_fast` of :meth:`fold_fast`, or, given the native kernel (an
        engine's ``kernels.native.topk_fold``), one pass of it on the CPU: a block
        row enters an item's state only where it beats the k-th slot, where
        ``lax.top_k`` sorts the block and the network merges it (k-NN top-10, the
        CPU tiles: 1.8-4.3x faster at D = 3, 16 and 128). Floats of 32 bits or fewer
        (ranked as float32, as :meth:`fold_fast` ranks them), rows and weights one
        per row, ``y`` not split by rows; its derivatives (any order) are those of
        the plain-JAX pass, whose selection is the same."""
        y = ys[0]
        plain = lambda acc, y, idx, w: self.merge_fast(acc, self.fold_fast([y], idx, w))
        takes = (
            native is not None
            and _inexact(y.dtype)
            and np.dtype(y.dtype).itemsize <= 4
            and jnp.ndim(idx) == 1
            and (w is None or jnp.ndim(w) == 1)
            and index_dtype() == np.int32
            and not _rows_sharded(y)
        )
        if not takes:
            return plain(acc, y, idx, w)
        items = y.shape[1:]

        def kernel(acc: Any, y: jax.Array, idx: jax.Array, w: Any) -> Any:
            flat = lambda a, dt: jnp.stack(a).astype(dt).reshape(self.k, -1)
            alive = jnp.ones(y.shape[:1], np.int32) if w is None else (w > 0).astype(np.int32)
            vals, rows = native(
                y.astype(np.float32).reshape(y.shape[0], -1),
                idx.astype(np.int32),
                alive,
                flat(acc[0], np.float32),
                flat(acc[1], np.int32),
                smallest=self.smallest,
            )
            slots = lambda a, like: tuple(
                s.reshape(items).astype(t.dtype) for s, t in zip(a, like, strict=True)
            )
            return slots(vals, acc[0]), slots(rows, acc[1])

        # every argument passed, none closed over: the rule is traced apart
        on_cpu = lambda *a: lax.platform_dependent(*a, cpu=kernel, default=plain)
        run = jax.custom_jvp(on_cpu)
        run.defjvp(lambda primals, tangents: jax.jvp(plain, primals, tangents))
        return run(acc, y, idx, w)

    def merge(self, a: Any, b: Any) -> Any:
        return merge_sorted(self.k, a, b, self._key)

    def merge_fast(self, a: Any, b: Any) -> Any:
        """:meth:`merge` by the same network, each round one whole-array op on the
        slots stacked (not in kernels): unrolled, XLA fused the k slots' dependency
        chains apart and took 85 s to compile the merge at k = 32 (here 6 s)."""
        return merge_stacked(self.k, a, b, self._key)

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


def top_k(k: int, smallest: bool = False) -> TopK:
    """The ``k`` largest rows (``smallest=True``: smallest) per trailing element, with
    their global row indices, as ``lax.top_k`` along axis 0 (of ``-y`` for smallest).

    The result is ``(values, indices)``, each ``(k, *t)`` for ``fun`` rows of shape
    ``t``: largest first (smallest first with ``smallest=True``), ties to the lower row,
    indices int32. Floats rank as in ``lax.top_k`` (-0.0 below +0.0), every NaN above
    +inf whatever its sign bit (first; last with ``smallest=True``). Integers and bools
    (False below True) are compared as they are, never negated: ``smallest=True`` on
    unsigned ints, ``iinfo.min`` or bools is the stable ascending order (where
    ``lax.top_k(-y)`` wraps, or raises on bools).
    Gradients go to the selected rows, as ``jax.grad`` of ``lax.top_k``.
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
