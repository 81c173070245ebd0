"""The scan engine: chunks executed by ``lax.scan``. Runs on every platform and
defines the reference semantics the other engines must reproduce.

Two strategies, chosen by the plan:

* balanced: ``k`` chunks of ``b`` rows. The last chunk starts at ``n - b`` so it
  overlaps the previous one; the overlapping rows are masked with the monoid
  identity, or dropped from a map's output. No padding copy is made, every row
  ``fun`` sees is a real input row, and ``fun`` is traced once.
* remainder: full chunks of ``batch_size`` rows, then the remainder rows in a
  separate call, for reductions whose padded rows could not be masked out.

Each chunk's work is wrapped in ``jax.checkpoint`` (unless ``remat`` is off), so a
gradient keeps one chunk's intermediates alive at a time: O(batch_size) memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _config
from ._plan import Plan
from ._trace import Traced, check_rowwise, rows_aval, trace

__all__ = ["run_balanced", "run_remainder"]


def _rows(xs: Any, start: Any, rows: int) -> Any:
    return jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, start, rows), xs)


def _remat(f: Callable) -> Callable:
    return jax.checkpoint(f, prevent_cse=False) if _config.current().remat else f


def _accumulator_dtype(dtype: Any) -> Any:
    # Accumulate half-precision partials in float32, as a single jnp.sum would.
    if dtype in (jnp.bfloat16, jnp.float16):
        return jnp.float32
    return dtype


def _unchunk(y: jax.Array, n: int) -> jax.Array:
    """``(k, b, ...)`` chunk outputs to ``(n, ...)``; drop the last chunk's repeats."""
    k, b = y.shape[:2]
    if k * b == n:
        return y.reshape(n, *y.shape[2:])
    head = y[:-1].reshape((k - 1) * b, *y.shape[2:])
    return jnp.concatenate([head, y[-1, k * b - n :]])


def run_balanced(plan: Plan, traced: Traced, xs: Any) -> Any:
    """Run a map or a recognized monoid reduction over balanced chunks.

    ``traced`` is ``fun`` traced on a chunk of ``plan.rows`` rows.
    """
    k, b, n, monoid = plan.chunks, plan.rows, plan.n, plan.monoid
    starts = jnp.arange(k) * b

    def chunk(start, xs):
        first = jnp.minimum(start, n - b)  # the last chunk overlaps the one before
        y = traced(_rows(xs, first, b))
        if monoid is None:
            return y
        valid = first + lax.iota(jnp.int32, b) >= start if plan.masked else None
        part = monoid.reduce_chunk(y, valid)
        return jax.tree.map(lambda p: p.astype(_accumulator_dtype(p.dtype)), part)

    chunk = _remat(chunk)
    if monoid is None:
        _, ys = lax.scan(lambda carry, start: (carry, chunk(start, xs)), (), starts)
        return jax.tree.map(lambda y: _unchunk(y, n), ys)

    out_shape = jax.eval_shape(monoid.reduce_chunk, traced.out_shape)
    acc_shape = jax.eval_shape(lambda xs: chunk(0, xs), xs)
    init = monoid.identity_like(acc_shape)
    body = lambda acc, start: (monoid.combine(acc, chunk(start, xs)), None)
    total, _ = lax.scan(body, init, starts)
    return jax.tree.map(lambda t, s: t.astype(s.dtype), total, out_shape)


def run_remainder(
    plan: Plan, fun: Callable, xs: Any, reduction: Callable | None, chunk_reduction: Callable
) -> Any:
    """Full chunks of ``plan.rows`` rows, then the remainder in a separate call.

    A generic ``reduction`` is seeded with the first chunk's result (never with
    zeros) and receives whole output pytrees, as in the original library.
    """
    k, b, r = plan.chunks, plan.rows, plan.remainder
    f = lambda x: chunk_reduction(fun(x))
    traced = trace(f, rows_aval(xs, b))
    if reduction is None:
        check_rowwise(traced.out_shape, b, "chunk_reduction(fun(chunk))")
    step = _remat(lambda start, xs: traced(_rows(xs, start, b)))
    starts = jnp.arange(k) * b

    if reduction is None:
        _, ys = lax.scan(lambda carry, start: (carry, step(start, xs)), (), starts)
        out = jax.tree.map(lambda y: y.reshape(k * b, *y.shape[2:]), ys)
    else:
        out = step(0, xs)
        if k > 1:
            body = lambda acc, start: (reduction(acc, step(start, xs)), None)
            out, _ = lax.scan(body, out, starts[1:])
    if not r:
        return out
    rest = f(jax.tree.map(lambda x: x[k * b :], xs))
    if reduction is not None:
        return reduction(out, rest)
    check_rowwise(jax.eval_shape(lambda: rest), r, "chunk_reduction(fun(remainder))")
    return jax.tree.map(lambda a, c: jnp.concatenate([a, c]), out, rest)
