"""The scan engine: chunks executed by ``lax.scan``. Runs every plan on every
platform and defines the reference semantics the other engines reproduce.

* overlap (maps and recognized monoids): ``n // B`` chunks of ``B`` rows in a
  scan, then one last chunk of the final ``B`` rows. It overlaps the loop's rows;
  those repeats are masked with the monoid identity, or dropped from a map's
  output. Every row ``fun`` sees is a real input row (no padding that could make
  NaNs), all chunks have one shape, and ``fun`` is traced once (by the planner).
* remainder (anything else): full chunks of ``B`` rows, then the remainder rows
  in a separate call, for reductions whose repeated rows could not be masked.

Each chunk's work is wrapped in ``jax.checkpoint`` (unless ``remat`` is off), so a
gradient keeps one chunk's intermediates alive at a time: O(batch_size) memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _config
from ._plan import Call, Kind, Plan, Policy, Rejection
from ._trace import rows_aval, trace
from ._validate import check_rowwise
from .kernels import native

__all__ = ["ScanEngine"]


class ScanEngine:
    """The ``lax.scan`` engine: runs every plan."""

    name = "scan"

    def accept(self, plan: Plan, call: Call) -> Plan | Rejection:
        return dataclasses.replace(plan, engine=self.name, reason="lax.scan over chunks")

    def run(self, plan: Plan, call: Call) -> Any:
        if plan.policy is Policy.OVERLAP:
            return _run_overlapped(plan, call.xs)
        if plan.policy is Policy.REMAINDER:
            return _run_remainder(plan, call)
        if plan.policy is Policy.EMPTY:
            return _empty_result(plan, call)
        if plan.traced is None:  # nothing mapped: the call as written
            return call.chunk_reduction(call.fun(call.xs))
        ys = plan.traced(call.xs)
        if plan.kind is Kind.MONOID:
            return plan.reduction.finish(plan.reduction.reduce_rows(ys, reduce=native.reducer))
        return call.chunk_reduction(ys)


def _empty_result(plan: Plan, call: Call) -> Any:
    """``n == 0``: a map gives empty outputs, a monoid its identity."""
    if plan.kind is Kind.MONOID:
        return plan.reduction.identity_result()
    if plan.kind is Kind.GENERIC:
        return call.chunk_reduction(call.fun(call.xs))
    one_row = jax.eval_shape(call.chunk_reduction, plan.traced.out_shape)
    return jax.tree.map(lambda s: jnp.zeros((0, *s.shape[1:]), s.dtype), one_row)


def _remat(f: Callable) -> Callable:
    return jax.checkpoint(f, prevent_cse=False) if _config.current().remat else f


def _stack(xs: Any, chunks: int, rows: int) -> Any:
    """The first ``chunks * rows`` rows of each leaf as ``(chunks, rows, ...)``."""
    return jax.tree.map(lambda x: x[: chunks * rows].reshape(chunks, rows, *x.shape[1:]), xs)


def _map_chunks(f: Callable, stacked: Any) -> Any:
    """``f`` on every chunk of ``stacked`` in a scan; outputs concatenated by rows."""
    _, ys = lax.scan(lambda carry, x: (carry, f(x)), (), stacked)
    return jax.tree.map(lambda y: y.reshape(y.shape[0] * y.shape[1], *y.shape[2:]), ys)


def _run_overlapped(plan: Plan, xs: Any) -> Any:
    """A map or a recognized monoid: ``n // B`` full chunks in a scan, then one last
    chunk of the final ``B`` rows whose repeated rows are masked (or dropped).

    Only the last chunk carries a mask: a mask inside the loop body keeps XLA's CPU
    backend from fusing cheap ``fun``s into its fast elementwise kernels (measured 7x).
    """
    n, b, reduction, traced = plan.n, plan.rows_per_chunk, plan.reduction, plan.traced
    full, repeated = n // b, plan.masked
    stacked = _stack(xs, full, b)
    last = jax.tree.map(lambda x: x[n - b :], xs)

    if reduction is None:
        chunk = _remat(traced)
        out = _map_chunks(chunk, stacked)
        if repeated:
            tail = chunk(last)
            out = jax.tree.map(lambda o, t: jnp.concatenate([o, t[repeated:]]), out, tail)
        return out

    chunk = _remat(lambda x, valid: reduction.reduce_rows(traced(x), valid, native.reducer))
    acc_shape = jax.eval_shape(lambda x: chunk(x, None), jax.tree.map(lambda x: x[0], stacked))
    start = [
        jnp.full(s.shape, leaf.monoid.identity(s.dtype))
        for s, leaf in zip(acc_shape, reduction.leaves, strict=True)
    ]
    body = lambda acc, x: (reduction.combine(acc, chunk(x, None)), None)
    total, _ = lax.scan(body, start, stacked)
    if repeated:
        unseen = jnp.asarray(np.arange(b) >= repeated)  # last-chunk rows the loop missed
        total = reduction.combine(total, chunk(last, unseen))
    return reduction.finish(total)


def _run_remainder(plan: Plan, call: Call) -> Any:
    """Full chunks of ``B`` rows, then the remainder in a separate call.

    A generic ``reduction`` is seeded with the first chunk's result (never with
    zeros) and receives whole output pytrees, as in the original library.
    """
    k, b, r = plan.chunks, plan.rows_per_chunk, plan.remainder
    reduction, chunk_reduction, xs = call.reduction, call.chunk_reduction, call.xs
    fun = plan.traced or call.fun
    step = lambda x: chunk_reduction(fun(x))
    out_shape = trace(step, rows_aval(xs, b)).out_shape
    if reduction is None:
        check_rowwise(out_shape, b, "chunk_reduction(fun(chunk))")
    step = _remat(step)
    stacked = _stack(xs, k, b)

    if reduction is None:
        out = _map_chunks(step, stacked)
    else:
        out = step(jax.tree.map(lambda x: x[0], stacked))
        if k > 1:
            body = lambda acc, x: (reduction(acc, step(x)), None)
            out, _ = lax.scan(body, out, jax.tree.map(lambda x: x[1:], stacked))
    if not r:
        return out
    rest = chunk_reduction(call.fun(jax.tree.map(lambda x: x[k * b :], xs)))
    if reduction is not None:
        return reduction(out, rest)
    check_rowwise(jax.eval_shape(lambda: rest), r, "chunk_reduction(fun(remainder))")
    return jax.tree.map(lambda a, c: jnp.concatenate([a, c]), out, rest)
