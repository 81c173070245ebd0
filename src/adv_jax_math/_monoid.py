"""Monoids: the reductions the engines know how to mask, chunk and fuse.

A monoid is an associative ``combine`` with an ``identity``. A recognized
``(reduction, chunk_reduction)`` pair becomes a :class:`MonoidReduction`: the
monoid plus the axes the user's ``chunk_reduction`` reduces (all axes for
``jnp.sum``-style functions, only the mapped axis for ``jnp.add.reduce``-style
ones). Anything not recognized is run unchanged by the generic scan path.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["ADD", "LOGSUMEXP", "MAX", "MIN", "Monoid", "MonoidReduction", "identity", "recognize"]


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


def _as_inexact(y: jax.Array) -> jax.Array:
    # logsumexp of integers is computed in floating point, as jax.nn.logsumexp does.
    return y if jnp.issubdtype(y.dtype, jnp.inexact) else y.astype(jnp.result_type(y, 1.0))


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
    _prepare: Callable[[jax.Array], jax.Array] = identity

    def __call__(self, a: Any, b: Any) -> Any:
        return self.combine(a, b)

    def __repr__(self) -> str:
        return f"adv_jax_math.{self.name.upper()}"

    def identity(self, dtype: Any) -> np.ndarray:
        """The identity element as a 0-d NumPy array of ``dtype``."""
        dtype = np.dtype(dtype)
        return np.asarray(self._identity(dtype), dtype)

    def mask(self, y: jax.Array, valid: jax.Array) -> jax.Array:
        """Replace the rows of ``y`` where ``valid`` (shape ``(rows,)``) is False."""
        y = self._prepare(y)
        valid = valid.reshape(valid.shape + (1,) * (y.ndim - 1))
        return jnp.where(valid, y, self.identity(y.dtype))


ADD = Monoid("add", jnp.add, jnp.sum, lambda dtype: 0)
MAX = Monoid("max", jnp.maximum, jnp.max, _lowest)
MIN = Monoid("min", jnp.minimum, jnp.min, _highest)
LOGSUMEXP = Monoid("logsumexp", jnp.logaddexp, jax.nn.logsumexp, lambda dtype: -np.inf, _as_inexact)
MONOIDS = (ADD, MAX, MIN, LOGSUMEXP)


@dataclass(frozen=True)
class MonoidReduction:
    """A monoid plus the axes of each output leaf that a chunk reduction removes.

    ``axis=None`` reduces every axis of each leaf (``jnp.sum``); ``axis=0`` only the
    mapped axis (``jnp.add.reduce``).
    """

    monoid: Monoid
    axis: int | None

    def __str__(self) -> str:
        axes = "all axes" if self.axis is None else "axis 0"
        return f"{self.monoid.name} over {axes}"

    def reduce_chunk(
        self, y: Any, valid: jax.Array | None = None, reduce: Callable | None = None
    ) -> Any:
        """Reduce each leaf of ``y`` (rows first), ignoring rows where ``valid`` is False.

        ``reduce(leaf, axis=...)`` replaces the monoid's own reduction (an engine's
        faster equivalent of it).
        """
        reduce = reduce or self.monoid.reduce

        def leaf(v):
            if valid is not None:
                v = self.monoid.mask(v, valid)
            return reduce(v, axis=self.axis)

        return jax.tree.map(leaf, y)

    def combine(self, a: Any, b: Any) -> Any:
        return jax.tree.map(self.monoid.combine, a, b)

    def identity_like(self, out: Any) -> Any:
        """The identity with the structure, shapes and dtypes of ``out`` (a shape pytree)."""
        return jax.tree.map(lambda s: jnp.full(s.shape, self.monoid.identity(s.dtype)), out)


_COMBINES: dict[Any, Monoid] = {
    jnp.add: ADD,
    operator.add: ADD,
    lax.add: ADD,
    jnp.maximum: MAX,
    lax.max: MAX,
    jnp.minimum: MIN,
    lax.min: MIN,
    jnp.logaddexp: LOGSUMEXP,
}

_CHUNK_REDUCTIONS: dict[Any, tuple[Monoid, int | None]] = {
    jnp.sum: (ADD, None),
    jnp.add.reduce: (ADD, 0),
    jnp.max: (MAX, None),
    jnp.amax: (MAX, None),
    jnp.maximum.reduce: (MAX, 0),
    jnp.min: (MIN, None),
    jnp.amin: (MIN, None),
    jnp.minimum.reduce: (MIN, 0),
    jax.nn.logsumexp: (LOGSUMEXP, None),
    jax.scipy.special.logsumexp: (LOGSUMEXP, None),
}


def _lookup(table: dict, f: Any) -> Any:
    try:
        return table.get(f)
    except TypeError:  # unhashable callable
        return None


def _chunk_reduction_spec(f: Callable) -> tuple[Monoid, int | None] | None:
    """Recognize ``f`` or ``functools.partial(f, axis=0 | None)``."""
    if isinstance(f, functools.partial) and not f.args and set(f.keywords) == {"axis"}:
        spec = _lookup(_CHUNK_REDUCTIONS, f.func)
        axis = f.keywords["axis"]
        if spec is None or axis not in (None, 0) or isinstance(axis, bool):
            return None
        return spec[0], axis
    return _lookup(_CHUNK_REDUCTIONS, f)


def recognize(reduction: Callable | None, chunk_reduction: Callable) -> MonoidReduction | None:
    """The monoid behind ``(reduction, chunk_reduction)``, or None if not recognized.

    A :class:`Monoid` passed as ``reduction`` with the default ``chunk_reduction``
    reduces the mapped axis; with a recognized ``chunk_reduction`` of a different
    monoid it is an error.
    """
    if reduction is None:
        return None
    monoid = reduction if isinstance(reduction, Monoid) else _lookup(_COMBINES, reduction)
    if monoid is None:
        return None
    if isinstance(reduction, Monoid) and chunk_reduction is identity:
        return MonoidReduction(monoid, 0)
    spec = _chunk_reduction_spec(chunk_reduction)
    if spec is None:
        return None
    if spec[0] is not monoid:
        if isinstance(reduction, Monoid):
            raise ValueError(
                f"reduction={reduction!r} does not match chunk_reduction={chunk_reduction!r}, "
                f"which is a {spec[0].name} reduction; pass matching functions"
            )
        return None
    return MonoidReduction(monoid, spec[1])
