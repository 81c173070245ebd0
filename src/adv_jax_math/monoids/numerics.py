"""Numerics the monoid families share (``_monoids_*``): a compensated sum (TwoSum),
the dtypes a reduction accumulates and returns in, and arrays shaped as rows,
their weights and their cotangents."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.call import is_inexact as _inexact
from .base import _col

Items = Sequence[jax.ShapeDtypeStruct]


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(a + b, the rounding error of a + b)`` (Knuth's TwoSum: exact in floating
    point). The error carries no derivative: ``d(a + b)`` is the whole tangent. Where
    ``a + b`` is infinite or NaN the error is 0, not the NaN of ``inf - inf``: it would
    turn an infinite total into NaN once added back."""
    t = a + b
    z = t - a
    lost = (a - (t - z)) + (b - z)
    return t, lax.stop_gradient(jnp.where(jnp.isfinite(t), lost, jnp.zeros_like(lost)))


def _wide(dtype: Any) -> np.dtype:
    """16-bit floats accumulate in float32 (as ``jnp.sum`` does)."""
    dtype = np.dtype(dtype)
    low = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
    return np.dtype(np.float32) if low else dtype


def _float(dtype: Any) -> np.dtype:
    """The float type a mean or a softmax of ``dtype`` values has."""
    return np.dtype(dtype) if _inexact(dtype) else np.dtype(jnp.result_type(dtype, 1.0))


def _weigh(ct_y: jax.Array, keep: Any) -> jax.Array:
    """A row cotangent times its weight (None: every row counts once)."""
    return ct_y if keep is None else ct_y * _col(keep, ct_y).astype(ct_y.dtype)


def _spread(a: jax.Array, like: jax.Array) -> jax.Array:
    """A per-element value ``(*t)`` (or a scalar) against rows ``(rows, *t)``: one
    broadcast (Mosaic GPU lays out no ``(1, *t)`` arrays between)."""
    return jnp.broadcast_to(a, like.shape)


def _full(item: jax.ShapeDtypeStruct, value: Any, dtype: Any = None) -> jax.Array:
    return jnp.full(item.shape, value, dtype or item.dtype)
