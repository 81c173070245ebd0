"""The scan engine: chunks executed by ``lax.scan``. Runs every plan on every
platform and defines the reference semantics the other engines reproduce.

* overlap (maps and monoid reductions): ``k`` equal chunks in one scan, the last
  starting at ``n - rows`` so that it shares a few rows with the one before; a map
  writes them twice (same values), a monoid counts them once (a row of a small
  constant table weights them: halves for float sums, the last copy left out
  otherwise). Every row ``fun`` sees is a real input row (no padding that could
  make NaNs), all chunks have one shape, and ``fun`` is traced once (by the
  planner) and compiled once (but for a logsumexp of a small elementwise ``fun``,
  computed once per pass of its fold: see :func:`_cheap`).
* remainder (anything else): full chunks of ``B`` rows, then the remainder rows
  in a separate call, for reductions whose repeated rows could not be discounted.
* lanes (rows spread over devices): a plan for one device's share run by all
  devices at once; every array has a leading device axis, each chunk of ``fun``
  takes the same rows of every share, and each device folds its own rows.

A monoid's state is folded chunk by chunk (``Monoid.fold``, per device with
``jax.vmap``), merged across chunks and devices, and finalized by the caller.
Each chunk's work is wrapped in ``jax.checkpoint``, so a gradient keeps one
chunk's intermediates alive at a time: O(batch_size) memory (with ``remat`` off,
only input slices are taken again). The tangent of a reduction that selects rows
(:func:`tangent_shares`) runs over the same chunks.

The chunks (``engines.scan_chunks``), the tangents (``engines.scan_tangent``) and the maps and
generic reductions (``engines.scan_map``) have their own modules; this one runs the plans
and folds a monoid's states.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from ..analysis import tangent
from ..analysis.jaxpr_graph import elementwise
from ..core.sharding import Lanes, explicit, sharding_of
from ..core.trace import Traced, size
from ..kernels import native
from ..monoids.base import merge_stacked
from ..monoids.reduction import LeafReduction, MonoidReduction
from ..plan.base import Call, Kind, Plan, Policy, Rejection
from .registry import Engine
from .scan_chunks import (
    LARGE_FUN,
    RECOMPUTED,
    _evaluator,
    _items,
    _place,
    _remat,
    _Rows,
    _start,
    _steps,
    _weights,
)
from .scan_map import run_generic, run_map
from .scan_tangent import merge_shares, tangent_shares

__all__ = ["RECOMPUTED", "ScanEngine", "merge_all", "merge_shares", "tangent_shares"]

TWO_PASSES = (
    "native logsumexp not used: fun is elementwise, so each of the fold's two passes (max, "
    "then the shifted sum) computes the chunk again fused into its reduction, which XLA "
    "vectorizes (a stored chunk read twice measured 3.3x slower: the logsumexp of "
    "bench/cases/workloads.py)"
)
_NATIVE_LOGSUMEXP = functools.partial(native.logsumexp, axis=0)  # one pass over the rows


class ScanEngine(Engine):
    """The ``lax.scan`` engine: runs every plan."""

    name = "scan"

    def accept(self, plan: Plan, call: Call) -> Plan | Rejection:
        return dataclasses.replace(
            plan,
            engine=self.name,
            reason="lax.scan over chunks",
            notes=plan.notes + _native_notes(plan),
        )

    def run(self, plan: Plan, call: Call) -> Any:
        if plan.policy is Policy.EMPTY:
            return _empty_result(plan, call)
        if plan.kind is Kind.MONOID:
            assert plan.reduction is not None
            return tangent.reduce(plan.reduction, [(plan, call.xs, 0)], states, tangent_shares)
        if plan.traced is None:  # nothing mapped: the call as written
            return call.chunk_reduction(call.fun(call.xs))
        if plan.kind is Kind.GENERIC:
            return run_generic(plan, call)
        return run_map(plan, call)

    def states(self, plan: Plan, xs: Any, offset: int) -> list:
        """Each term's state over ``plan``'s rows (global indices from ``offset``)."""
        return states(plan, xs, offset)

    def describe_reverse(self, plan: Plan, call: Call) -> Plan:
        """``plan`` as is: reverse mode differentiates the chunk loop itself (each chunk
        rematerialized, see ``engines.scan_chunks._remat``), which the plan already shows."""
        return plan


def _native_notes(plan: Plan) -> tuple[str, ...]:
    """Whether each term with a native CPU kernel (logsumexp) reduces a chunk with it,
    and why: the decision :func:`states` takes on a chunk's rows (:func:`_native`)."""
    if plan.reduction is None or plan.traced is None or not plan.rows_per_chunk:
        return ()
    outs, cheap = jax.tree.leaves(plan.traced.out_shape), _cheap(plan.traced)
    choices = [
        _native(leaf, outs[leaf.source], plan.rows_per_chunk, cheap)
        for leaf in plan.reduction.leaves
    ]
    return tuple(dict.fromkeys(why for _, why in filter(None, choices)))


def _native(leaf: LeafReduction, y: Any, rows: int, cheap: bool) -> tuple[bool, str] | None:
    """Whether ``leaf``'s monoid folds a chunk of ``rows`` rows of ``y`` (the output it
    reads) with its native CPU kernel, and why (None: it has none). ``kernels.native``
    has one kernel, a logsumexp; a monoid names it (``Monoid.native_kernel``)."""
    monoid = leaf.monoid
    if monoid.native_kernel != "logsumexp":
        return None
    if monoid.reads_twice and cheap:
        return False, TWO_PASSES
    shape = (rows, *y.shape[1:])
    shape = shape if leaf.axis == 0 else (math.prod(shape),)
    return native.decision(shape, monoid.native_dtype(y.dtype))


def _empty_result(plan: Plan, call: Call) -> Any:
    """``n == 0``: a map gives empty outputs, a monoid its empty result."""
    assert plan.traced is not None  # an EMPTY plan was traced on 1 row
    if plan.kind is Kind.MONOID:
        assert plan.reduction is not None
        return plan.reduction.empty_result(plan.traced.out_shape)
    if plan.kind is Kind.GENERIC:
        return call.chunk_reduction(call.fun(call.xs))
    one_row = jax.eval_shape(call.chunk_reduction, plan.traced.out_shape)
    return jax.tree.map(lambda s: jnp.zeros((0, *s.shape[1:]), s.dtype), one_row)


# -- states ----------------------------------------------------------------------------
def states(plan: Plan, xs: Any, offset: int = 0) -> list:
    """Each term's state over the rows of ``plan`` (the shares of a plan with lanes
    merged), ``fun``'s traces evaluated chunk by chunk."""
    reduction, traced = plan.reduction, plan.traced
    assert reduction is not None and traced is not None  # Kind.MONOID plans are traced
    rows = _Rows(plan, offset)
    leaves = [rows.whole(x) for x in jax.tree.leaves(xs)]
    views = [rows.view(x) for x in leaves]
    b, k = plan.rows_per_chunk, plan.chunks
    r = plan.masked if plan.policy is Policy.OVERLAP else 0

    def fold(fn: Callable, chunk: list, start: Any, n_rows: int, place: Any, r: int) -> list:
        ys, idx, out = fn(chunk), rows.index(start, n_rows), []
        again = functools.cache(lambda: fn(lax.optimization_barrier(chunk)))
        for leaf in reduction.leaves:
            src = [rows.shares(ys[s], n_rows) for s in leaf.sources]
            src2 = None
            if leaf.monoid.reads_twice and cheap:
                src2 = [rows.shares(again()[s], n_rows) for s in leaf.sources]
            w = _weights(rows, leaf, [y.dtype for y in src], r, place, keep=False)
            use = _native(leaf, ys[leaf.source], n_rows, cheap)
            kernel = _NATIVE_LOGSUMEXP if use and use[0] else None
            f = lambda src, idx, w, src2, leaf=leaf, kernel=kernel: leaf.fold(
                src, idx, w, fast=True, again=src2, native=kernel
            )
            state = rows.per_share(f, last=0)(src, idx, w, src2)
            # (a part of a state that is the same for every device, e.g. a count, is
            # broadcast by vmap: kept on the devices' axis like the rest)
            out.append(state if not rows.lanes else jax.tree.map(rows.lanes.constrain, state))
        return out

    fn, cheap = _evaluator(traced), _cheap(traced)
    if plan.policy is Policy.SINGLE:
        return merge_all(reduction, fold(fn, leaves, 0, rows.m, 0, 0), rows.lanes)
    starts = (lambda i: _start(i, rows.m, b)) if r else (lambda i: i * b)
    chunk = _remat(
        lambda i: fold(fn, rows.take(views, starts(i), b), starts(i), b, _place(i, k), r)
    )
    merge = lambda a, c: [
        _merge(leaf, u, v, rows.lanes) for leaf, u, v in zip(reduction.leaves, a, c, strict=True)
    ]
    start = identity_states(reduction, traced.out_shape, rows.lanes)
    state, _ = _steps(lambda i, st: (merge(st, chunk(i)), None), start, k, rows=b)
    if plan.policy is Policy.REMAINDER and plan.remainder:
        assert plan.tail is not None  # a remainder's rows are traced by the planner
        tail = rows.take(views, k * b, plan.remainder)
        state = merge(state, fold(_evaluator(plan.tail), tail, k * b, plan.remainder, 0, 0))
    return merge_all(reduction, state, rows.lanes)


def _cheap(traced: Traced) -> bool:
    """Whether ``fun`` is elementwise and small: a monoid that :attr:`reads_twice`
    then computes a chunk's rows once per pass, each fused into its reduction (XLA
    does not duplicate an expensive fusion for two readers, and a stored chunk ran
    as an unvectorized loop: logsumexp of ``cos`` terms, 2^14 rows, 2.2 -> 0.6 ms
    per 16 chunks on XLA:CPU); otherwise they are stored and read twice."""
    return size(traced.jaxpr.jaxpr) < LARGE_FUN and elementwise(traced.jaxpr)


def identity_states(reduction: MonoidReduction, out_shape: Any, lanes: Lanes | None) -> list:
    """Each term's identity state for rows like ``out_shape`` (the prepared outputs of
    a chunk), with a leading device axis for ``lanes``."""
    out = []
    for leaf in reduction.leaves:
        state = leaf.monoid.init(_items(reduction, leaf, out_shape))
        state = _typed_like_items(state, reduction.reads(jax.tree.leaves(out_shape), leaf))
        if lanes is not None:
            spread = lambda a: lanes.constrain(jnp.broadcast_to(a, (lanes.count, *a.shape)))
            state = jax.tree.map(spread, state)
        out.append(state)
    return out


def _typed_like_items(state: Any, reads: list) -> Any:
    """``state`` with each part shaped as an item (a row of what the term reads) typed
    as the items are on Explicit axes: a nested call's carry then has its outputs'
    sharding (rows of an outer call split over devices), which its merges and their
    tangents (a ``select`` of both) require."""
    typed = [(r, s) for r in reads if explicit(s := sharding_of(r))]
    if not typed:
        return state
    read, sharding = typed[0]
    item = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    put = lambda a: jax.sharding.reshard(a, item) if a.shape == read.shape[1:] else a
    return jax.tree.map(put, state)


def _merge(leaf: LeafReduction, a: Any, b: Any, lanes: Lanes | None) -> Any:
    merge = leaf.monoid.merge_fast
    return merge(a, b) if lanes is None else jax.vmap(merge)(a, b)


def merge_all(reduction: MonoidReduction, state: list, lanes: Lanes | None) -> list:
    """States with a leading device axis merged into one (gathered, then merged
    pairwise, lower devices, i.e. lower rows, on the left); without lanes, as they
    are."""
    if lanes is None:
        return state
    return [
        merge_stacked(leaf.monoid.merge_fast, jax.tree.map(lanes.gather, s))
        for leaf, s in zip(reduction.leaves, state, strict=True)
    ]
