"""The scan engine: chunks executed by ``lax.scan``. Runs every plan on every
platform and defines the reference semantics the other engines reproduce.

* overlap (maps and recognized monoids): ``k`` equal chunks in one scan, the last
  starting at ``n - rows`` so that it shares a few rows with the one before; a map
  writes them twice (same values), a monoid counts them once
  (``Monoid.overlapped``). Every row ``fun`` sees is a real input row (no padding
  that could make NaNs), all chunks have one shape, and ``fun`` is traced once (by
  the planner) and compiled once.
* remainder (anything else): full chunks of ``B`` rows, then the remainder rows
  in a separate call, for reductions whose repeated rows could not be discounted.

Each chunk's work is wrapped in ``jax.checkpoint``, so a gradient keeps one chunk's
intermediates alive at a time: O(batch_size) memory (with ``remat`` off, only input
slices are taken again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from . import _config, _progress
from . import _tangent as tangent
from ._monoid import RECOMPUTED, MonoidReduction
from ._plan import Call, Kind, Plan, Policy, Rejection
from ._trace import rows_aval, size
from ._validate import check_rowwise
from .kernels import native

__all__ = ["ScanEngine"]


class ScanEngine:
    """The ``lax.scan`` engine: runs every plan."""

    name = "scan"

    def accept(self, plan: Plan, call: Call) -> Plan | Rejection:
        return dataclasses.replace(plan, engine=self.name, reason="lax.scan over chunks")

    def run(self, plan: Plan, call: Call) -> Any:
        if plan.policy is Policy.EMPTY:
            return _empty_result(plan, call)
        if plan.kind is Kind.MONOID:
            assert plan.reduction is not None
            return plan.reduction.finish(_reduce(plan, call))
        if plan.policy is Policy.OVERLAP:
            return _map_overlapped(plan, call.xs)
        if plan.policy is Policy.REMAINDER:
            return _run_remainder(plan, call)
        if plan.traced is None:  # nothing mapped: the call as written
            return call.chunk_reduction(call.fun(call.xs))
        return call.chunk_reduction(plan.traced(call.xs))


def _empty_result(plan: Plan, call: Call) -> Any:
    """``n == 0``: a map gives empty outputs, a monoid its identity."""
    if plan.kind is Kind.MONOID:
        assert plan.reduction is not None
        return plan.reduction.identity_result()
    if plan.kind is Kind.GENERIC:
        return call.chunk_reduction(call.fun(call.xs))
    assert plan.traced is not None  # a map with n == 0 rows was traced on 1 row
    one_row = jax.eval_shape(call.chunk_reduction, plan.traced.out_shape)
    return jax.tree.map(lambda s: jnp.zeros((0, *s.shape[1:]), s.dtype), one_row)


def _remat(f: Callable) -> Callable:
    """``f`` rematerialized in a gradient (O(batch_size) memory); with ``remat`` off,
    only the values named :data:`RECOMPUTED` (slices of loop inputs and constants,
    cheaper to take again than to store per chunk) are."""
    if _config.current().remat:
        return jax.checkpoint(f, prevent_cse=False)
    return jax.checkpoint(f, prevent_cse=False, policy=_save_all_but_recomputed)


def _save_all_but_recomputed(prim: Any, *_: Any, **params: Any) -> bool:
    # A slice is a copy: it is taken again rather than stored per chunk (the value
    # before the name is a dynamic_slice; jax's save_anything_except_these_names
    # saves everything, named values too).
    if prim.name == "name":
        return params.get("name") != RECOMPUTED
    return prim.name != "dynamic_slice"


def _stack(xs: Any, chunks: int, rows: int) -> Any:
    """The first ``chunks * rows`` rows of each leaf as ``(chunks, rows, ...)``."""
    return jax.tree.map(lambda x: x[: chunks * rows].reshape(chunks, rows, *x.shape[1:]), xs)


def _map_chunks(f: Callable, stacked: Any) -> Any:
    """``f`` on every chunk of ``stacked`` in a scan; outputs concatenated by rows."""
    rows = jax.tree.leaves(stacked)[0].shape[1]
    _, ys = _progress.scan(lambda carry, x: (carry, f(x)), (), stacked, rows=rows)
    return jax.tree.map(lambda y: y.reshape(y.shape[0] * y.shape[1], *y.shape[2:]), ys)


def _map_overlapped(plan: Plan, xs: Any) -> Any:
    """A map: ``k`` chunks of ``B`` rows in one scan, the last one starting at
    ``n - B``, each written into the ``(n, ...)`` outputs where its rows belong (the
    last chunk writes its repeated rows again, with the same values). One copy of
    ``fun``, no row mask, no stacked copy of the outputs."""
    n, b, k = plan.n, plan.rows_per_chunk, plan.chunks
    traced = plan.traced
    assert n is not None and traced is not None  # an OVERLAP plan is mapped and traced
    chunk = _remat(lambda i: traced(_take(xs, _start(i, n, b), b)))
    shapes = jax.eval_shape(chunk, jnp.int32(0))
    out = jax.tree.map(lambda s: jnp.zeros((n, *s.shape[1:]), s.dtype), shapes)

    def step(i: jax.Array, out: Any) -> tuple[Any, None]:
        write = lambda o, y: lax.dynamic_update_slice_in_dim(o, y, _start(i, n, b), 0)
        return jax.tree.map(write, out, chunk(i)), None

    return _steps(step, out, k, rows=b)[0]


def _steps(step: Callable, init: Any, k: int, *, rows: int) -> tuple[Any, Any]:
    """``state, y = step(i, state)`` for ``i`` in ``range(k)`` in a scan; the ``y``
    are stacked. The index is scanned over, not carried: a carried counter would be
    a residual that keeps the forward loop alive in a gradient."""
    return _progress.scan(lambda state, i: step(i, state), init, jnp.arange(k), rows=rows)


def _start(i: jax.Array, n: int, rows: int) -> jax.Array:
    """The first row of overlapping chunk ``i``: ``i * rows``, the last at ``n - rows``."""
    return jnp.minimum(i * rows, n - rows)


def _take(xs: Any, start: Any, rows: int) -> Any:
    take = lambda x: checkpoint_name(lax.dynamic_slice_in_dim(x, start, rows), RECOMPUTED)
    return jax.tree.map(take, xs)


def _reduce(plan: Plan, call: Call) -> list[jax.Array]:
    """A recognized reduction's totals (accumulator dtypes), one per result leaf.

    ``fun``'s jaxpr (traced by the planner, prologue included) is evaluated with its
    constants passed in, so that max/min can carry the even tie rule of
    ``Monoid.tangent_*`` in a ``custom_jvp`` (autodiff through ``jnp.maximum`` in
    the loop would split ties by chunk); add/logsumexp are differentiated as is.
    """
    reduction, traced, n = plan.reduction, plan.traced, plan.n
    # Kind.MONOID plans are mapped (n rows) and traced by the planner.
    assert reduction is not None and traced is not None and n is not None
    closed = traced.jaxpr
    # A large fun's chunk output is materialized before it is reduced: XLA would fuse
    # fun into every reduction reading it (logsumexp's max and sum, two slices) and
    # compile and run it 2-4 times (360 equations: compile 15 s -> 0.5 s, run
    # 1400 -> 22 ms). Cheap funs stay fused: materializing cost 9x on XLA:CPU.
    large = size(closed.jaxpr) >= LARGE_FUN
    barrier: Callable = lax.optimization_barrier if large else (lambda y: y)
    tail_closed = None
    if plan.policy is Policy.REMAINDER and plan.remainder:
        rest = jax.tree.map(lambda x: x[n - plan.remainder :], call.xs)
        tail_closed = jax.make_jaxpr(reduction.prepare(call.fun))(rest)
    leaves, tree = jax.tree.flatten(call.xs)

    def forward(consts: list, leaves: list, tail_consts: list) -> list[jax.Array]:
        fn = lambda x: barrier(jax.core.eval_jaxpr(closed.jaxpr, consts, *jax.tree.leaves(x)))
        xs = jax.tree.unflatten(tree, leaves)
        if plan.policy is Policy.SINGLE:
            return reduction.reduce_rows(fn(xs), reduce=native.reducer)
        b, k, r = plan.rows_per_chunk, plan.chunks, plan.masked
        if plan.policy is Policy.OVERLAP:  # the last two chunks share r rows
            overlapped = lambda i: reduction.reduce_overlapped(
                fn(_take(xs, _start(i, n, b), b)),
                r,
                (i == k - 2).astype(jnp.int32) + 2 * (i == k - 1).astype(jnp.int32),
                native.reducer,
            )
            return _accumulate(reduction, _remat(overlapped), k, rows=b)
        tail = None
        if tail_closed is not None:
            rest = jax.tree.leaves(jax.tree.map(lambda x: x[k * b :], xs))
            tail = reduction.reduce_rows(
                jax.core.eval_jaxpr(tail_closed.jaxpr, tail_consts, *rest), reduce=native.reducer
            )
        chunk = lambda i: reduction.reduce_rows(fn(_take(xs, i * b, b)), reduce=native.reducer)
        return _accumulate(reduction, _remat(chunk), k, tail, rows=b)

    consts = list(closed.consts)
    tail_consts = list(tail_closed.consts) if tail_closed is not None else []
    if not tangent.SUPPORTED or not any(leaf.monoid.selects for leaf in reduction.leaves):
        # (before jax 0.10, max/min gradients split ties by chunk: see _tangent.SUPPORTED)
        return forward(consts, leaves, tail_consts)
    monoids = [(leaf.monoid, leaf.axis) for leaf in reduction.leaves]
    run = tangent.even_ties(forward, closed.jaxpr, monoids, n, plan.rows_per_chunk, 1)
    return run(consts, leaves, tail_consts)  # the tail's constants are the same values


LARGE_FUN = 100  # equations (sub-jaxprs included): a fun this large is materialized


def _accumulate(
    reduction: MonoidReduction,
    partials: Callable,
    k: int,
    tail: list | None = None,
    *,
    rows: int = 1,
) -> list[jax.Array]:
    """Combine ``partials(i)`` for ``i`` in ``range(k)`` in a scan, compensated per
    leaf, then the ``tail`` partials (a remainder evaluated apart), if any."""
    shapes = jax.eval_shape(partials, jnp.int32(0))
    monoids = [leaf.monoid for leaf in reduction.leaves]
    start = [m.acc_init(s.shape, s.dtype) for m, s in zip(monoids, shapes, strict=True)]
    update = lambda state, parts: [
        m.acc_update(a, p) for m, a, p in zip(monoids, state, parts, strict=True)
    ]
    state, _ = _steps(lambda i, state: (update(state, partials(i)), None), start, k, rows=rows)
    if tail is not None:
        state = update(state, tail)
    return [m.acc_final(a) for m, a in zip(monoids, state, strict=True)]


def _run_remainder(plan: Plan, call: Call) -> Any:
    """Full chunks of ``B`` rows, then the remainder in a separate call.

    A generic ``reduction`` is seeded with the first chunk's result (never with
    zeros) and receives whole output pytrees, as in the original library.
    """
    k, b, r = plan.chunks, plan.rows_per_chunk, plan.remainder
    reduction, chunk_reduction, xs = call.reduction, call.chunk_reduction, call.xs
    traced = plan.traced
    assert traced is not None  # a REMAINDER plan is traced (fun's own jaxpr)
    step = lambda x: chunk_reduction(traced(x))
    if reduction is None:
        check_rowwise(jax.eval_shape(step, rows_aval(xs, b)), b, "chunk_reduction(fun(chunk))")
    step = _remat(step)
    stacked = _stack(xs, k, b)

    if reduction is None:
        out = _map_chunks(step, stacked)
    else:
        out = step(jax.tree.map(lambda x: x[0], stacked))
        if k > 1:
            body = lambda acc, x: (reduction(acc, step(x)), None)
            rest = jax.tree.map(lambda x: x[1:], stacked)
            out, _ = _progress.scan(body, out, rest, rows=b)
    if not r:
        return out
    rest = chunk_reduction(call.fun(jax.tree.map(lambda x: x[k * b :], xs)))
    if reduction is not None:
        return reduction(out, rest)
    check_rowwise(jax.eval_shape(lambda: rest), r, "chunk_reduction(fun(remainder))")
    return jax.tree.map(lambda a, c: jnp.concatenate([a, c]), out, rest)
