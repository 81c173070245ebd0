"""The selection and merge networks of :class:`~adv_jax_math.monoids.topk.TopK`'s
states (each slot a value and its row, best first): k passes of max-and-remove over
candidate lists (:func:`select`), and a bitonic merge of two states, slot by slot
(:func:`merge_sorted`, any engine, kernels included) or on the slots stacked
(:func:`merge_stacked`, outside kernels)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .base import index_dtype

__all__ = ["empty_row", "merge_sorted", "merge_stacked", "select"]


def empty_row() -> Any:
    """The row of an empty slot (its value is 0 and never read): ranked below every
    real row, which no value can be (a NaN, an integer's minimum are real values)."""
    return np.iinfo(index_dtype()).max


def select(k: int, lists: list, key_min: Any) -> tuple:
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
        # (against the rows in one broadcast: Mosaic GPU lays out no (1, n) arrays)
        level = lambda ax, like, top=top: top if ax is None else jnp.broadcast_to(top, like.shape)
        sel = functools.reduce(
            jnp.minimum,
            [
                over(jnp.where(al & (kk == level(ax, kk)), rr, big), ax, jnp.min)
                for kk, rr, al, ax in lists
            ],
        )
        keys.append(top)
        rows.append(sel)
        gone = lambda ax, like, sel=sel: sel if ax is None else jnp.broadcast_to(sel, like.shape)
        lists = [(kk, rr, al & (rr != gone(ax, rr)), ax) for kk, rr, al, ax in lists]
    return tuple(keys), tuple(rows)


def _padded(state: tuple, size: int) -> tuple[list, list]:
    """A state's ``(values, rows)`` padded with empty slots to ``size`` slots."""
    values, rows = state
    pad = size - len(values)
    zeros, empty = jnp.zeros_like(values[0]), jnp.full_like(rows[0], empty_row())
    return list(values) + [zeros] * pad, list(rows) + [empty] * pad


def _rank(key: Any, v: jax.Array, r: jax.Array) -> jax.Array:
    """The key of a slot's value, the lowest for an empty slot."""
    kv = key(v)
    return jnp.where(r == empty_row(), np.iinfo(kv.dtype).min, kv)


def merge_sorted(k: int, a: tuple, b: tuple, key: Any) -> tuple:
    """The ``k`` best of two states ``(values, rows)``, each sorted best first (the
    higher ``key(value)``, then the lower row; empty slots, of row :func:`empty_row`,
    last): a bitonic merge network. ``a`` and ``b`` reversed form a bitonic sequence;
    one compare-exchange of ``a[i]`` with ``b[size - 1 - i]`` keeps the ``size`` best
    (bitonic again), and ``log2(size)`` rounds of compare-exchanges sort them
    (``size``: k rounded up to a power of two, padded with empty slots). That is
    ``k + k/2 log2 k`` compare-exchanges at depth ``1 + log2 k``, elementwise (any
    engine, kernels included); the k passes of max-and-remove (:func:`select`) over
    the 2k slots made XLA:GPU fuse one ``loop_and_maximum_minimum_fusion`` that took
    minutes to compile for k = 16. Keys are recomputed from the values at each
    comparison (a bitcast), not carried: two arrays per slot, as few registers as
    possible on GPU; values move by ``where``, with their derivatives."""
    size = 1 << (k - 1).bit_length()

    def first(vx: jax.Array, rx: jax.Array, vy: jax.Array, ry: jax.Array) -> jax.Array:
        kx, ky = _rank(key, vx, rx), _rank(key, vy, ry)
        return (kx > ky) | ((kx == ky) & (rx < ry))

    (va, ra), (vb, rb) = _padded(a, size), _padded(b, size)
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


def merge_stacked(k: int, a: tuple, b: tuple, key: Any) -> tuple:
    """:func:`merge_sorted`'s network on the slots stacked along a leading axis, each
    round of compare-exchanges as whole-array ops on its pairs (a reshape to
    ``(groups, 2, half, ...)``), the keys computed once and carried: the same slots
    compared, the same ``where``s (same results, same derivatives). Not in kernels
    (Triton, Mosaic: no such reshapes)."""
    size = 1 << (k - 1).bit_length()

    def stacked(state: tuple, reverse: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
        """A state padded to ``size`` empty-last slots (reversed: first), stacked,
        with its slots' keys."""
        values, rows = _padded(state, size)
        order = slice(None, None, -1 if reverse else 1)
        v, r = jnp.stack(values[order]), jnp.stack(rows[order])
        return v, r, _rank(key, v, r)

    def first(kx: jax.Array, rx: jax.Array, ky: jax.Array, ry: jax.Array) -> jax.Array:
        return (kx > ky) | ((kx == ky) & (rx < ry))

    (va, ra, ka), (vb, rb, kb) = stacked(a, False), stacked(b, True)  # b[size - 1 - i]
    take = first(ka, ra, kb, rb)  # the size best
    slots = [jnp.where(take, x, y) for x, y in ((va, vb), (ra, rb), (ka, kb))]
    half = size // 2
    while half:  # bitonic merge, best first: slot i against i + half
        pairs = [s.reshape(size // (2 * half), 2, half, *s.shape[1:]) for s in slots]
        _, r, kk = pairs
        take = first(kk[:, 0], r[:, 0], kk[:, 1], r[:, 1])
        slots = [
            jnp.stack(
                [jnp.where(take, p[:, 0], p[:, 1]), jnp.where(take, p[:, 1], p[:, 0])], 1
            ).reshape(size, *p.shape[3:])
            for p in pairs
        ]
        half //= 2
    values, rows, _ = slots
    return tuple(values[:k]), tuple(rows[:k])
