"""The cases of ``bench/``, one list per operation, shared by the benchmarks, the
accelerator compile checks (``bench/accel/``) and the tests (``tests/conftest.py`` puts
``bench/`` on ``sys.path``):

* ``cases.map_reduce``: ``batch_map(fun, xs, batch_size, reduction=...)``, the fused
  map-reduce over rows, per monoid (the compile checks, ``tests/test_lowering.py``);
* ``cases.pairwise``: ``pairwise(f, x, y, reduction)``, one case per reduction (the
  tests, the compile checks) and the KeOps-like workloads (the benchmarks, the
  roofline model).
* ``cases.workloads``: ``post(batch_map(fun, xs, ...))`` and its gradient with respect
  to closed-over params, run by every engine (ours, the original library, ``lax.map``,
  unchunked): the engine comparison (``report.py``, ``demo.py``, ``bench_compare.py``).

Each case names its function, its reduction and its inputs (sizes given by the
caller: large for the benchmarks, ragged for the compile checks, small for the tests);
its plain-JAX oracle is :func:`oracle` of its reduction, here. :func:`plain_pair` writes
the elementwise monoids as ``batch_map``'s ``(reduction, chunk_reduction)`` in plain
JAX (the tests' ``helpers.oracle`` and ``reduction_kwargs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import adv_jax_math as ajm


def _top_k(k: int, smallest: bool) -> Callable:
    """``lax.top_k`` along axis 0, every NaN ranked above +inf (``top_k``'s documented
    order): ``lax.top_k`` ranks a NaN by its sign bit, which arithmetic does not keep
    (``inf - inf`` is a negative NaN on x86)."""

    def top_k(y):
        key = lax.stop_gradient(-y if smallest else y)
        if jnp.issubdtype(y.dtype, jnp.floating):
            nan = np.asarray(-np.nan if smallest else np.nan, y.dtype)
            key = jnp.where(jnp.isnan(key), nan, key)
        i = jnp.moveaxis(lax.top_k(jnp.moveaxis(key, 0, -1), k)[1], -1, 0)
        return jnp.take_along_axis(y, i, axis=0), i

    return top_k


def logsumexp(a: Any, axis: Any = None, b: Any = None) -> jax.Array:
    """``jax.nn.logsumexp`` with the derivative plain autodiff gives it: beside a +inf
    entry 0, at it NaN (``exp(inf - inf)``), as jax < 0.12.1 gave. jax 0.12.1's custom
    derivative (a softmax) is NaN at every entry once one is +inf; the library keeps the
    finite entries' 0, so its oracle must not depend on the jax version."""
    if b is not None:  # (0.12.1 still differentiates the weighted form by autodiff)
        return jax.nn.logsumexp(a, axis, b=b)
    top = jnp.max(a, axis)  # written as jax's, so that it is read as LOGSUMEXP
    top = lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0))
    shift = top if axis is None else jnp.expand_dims(top, axis)
    return jnp.log(jnp.sum(jnp.exp(a - shift), axis)) + top


def _softmax_weighted(sv):
    s, v = sv
    return jnp.tensordot(jax.nn.softmax(s, 0), v, ([0], [0]))


_PLAIN: dict[str, Callable] = {  # a monoid's name: plain JAX over axis 0 of fun's output
    "add": lambda y: jnp.sum(y, 0),
    "max": lambda y: jnp.max(y, 0),
    "min": lambda y: jnp.min(y, 0),
    "logsumexp": lambda y: logsumexp(y, 0),
    "weighted_logsumexp": lambda y: jax.nn.logsumexp(y[0], 0, b=y[1]),
    "argmin": lambda y: jnp.argmin(y, 0),
    "argmax": lambda y: jnp.argmax(y, 0),
    "min_argmin": lambda y: (jnp.min(y, 0), jnp.argmin(y, 0)),
    "max_argmax": lambda y: (jnp.max(y, 0), jnp.argmax(y, 0)),
    "mean": lambda y: jnp.mean(y, 0),
    "var": lambda y: jnp.var(y, 0),
    "mean_var": lambda y: (jnp.mean(y, 0), jnp.var(y, 0)),
    "softmax_weighted": _softmax_weighted,
    "softmax_weighted(return_lse=True)": lambda y: (
        _softmax_weighted(y),
        logsumexp(y[0], 0),
    ),
}


_ALL_AXES = {"add": jnp.sum, "max": jnp.max, "min": jnp.min, "logsumexp": logsumexp}
_COMBINE = {"add": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "logsumexp": jnp.logaddexp}


def plain_pair(monoid: str, axis: int | None = None) -> tuple[Callable, Callable]:
    """``batch_map``'s ``(reduction, chunk_reduction)`` for ``"add"``, ``"max"``, ``"min"``
    or ``"logsumexp"`` in plain JAX, leafwise over pytrees: each leaf reduced over every
    axis (``axis`` None) or over its rows (0); :func:`oracle` of it is the unchunked
    computation."""
    leaf, combine = (_ALL_AXES if axis is None else _PLAIN)[monoid], _COMBINE[monoid]
    return (lambda a, b: jax.tree.map(combine, a, b), lambda y: jax.tree.map(leaf, y))


def oracle(reduction: Any, axis: int = 0) -> Callable:
    """The plain-JAX expression ``reduction`` equals, reducing ``axis`` of what ``fun``
    (``f`` of the pairs: ``axis=1`` of the dense ``(N, M, ...)`` outputs) returns.

    ``reduction``: a monoid, a pytree of them (one per output subtree), or a
    ``(reduction, chunk_reduction)`` pair of ``batch_map``, whose ``chunk_reduction``
    reduces every row of each leaf at once (``axis`` 0 only)."""
    if isinstance(reduction, tuple) and not isinstance(reduction[-1], ajm.Monoid | tuple | dict):
        assert axis == 0, "a chunk_reduction reduces every row: axis 0 only"
        return lambda y: jax.tree.map(reduction[1], y)
    if isinstance(reduction, ajm.Monoid):
        if hasattr(reduction, "k"):  # top_k
            plain = _top_k(reduction.k, reduction.smallest)
        elif getattr(reduction, "ddof", 0):  # var(ddof)
            plain = lambda y: jnp.var(y, 0, ddof=reduction.ddof)
        else:
            plain = _PLAIN[reduction.name]
    else:  # a pytree of monoids
        leaf = lambda m: isinstance(m, ajm.Monoid)
        plain = lambda y: jax.tree.map(lambda m, part: oracle(m)(part), reduction, y, is_leaf=leaf)
    for _ in range(axis):
        plain = jax.vmap(plain)
    return plain


def max_rel_error(out: Any, ref: Any) -> float:
    """max |out - ref| / max |ref| over the leaves (in float64), the largest leaf's: how
    far a result is from its oracle's (or a float64 reference's)."""
    errs = []
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs.append(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-300))
    return float(max(errs))
