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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from . import _config, _progress
from . import _tangent as tangent
from ._jaxpr_graph import elementwise
from ._monoid import LeafReduction, MonoidReduction, index_dtype, merge_stacked
from ._monoid import identity as identity_fn
from ._plan import Call, Kind, Plan, Policy, Rejection
from ._sharding import Lanes, zeros
from ._trace import Traced, size
from ._validate import check_rowwise
from .kernels import native

__all__ = ["RECOMPUTED", "ScanEngine", "merge_all", "merge_shares", "tangent_shares"]

RECOMPUTED = "adv_jax_math.recomputed"  # checkpoint_name of values a gradient recomputes
LARGE_FUN = 100  # equations (sub-jaxprs included): a fun this large is materialized
TWO_PASSES = (
    "native logsumexp not used: fun is elementwise, so each of the fold's two passes (max, "
    "then the shifted sum) computes the chunk again fused into its reduction, which XLA "
    "vectorizes (a stored chunk read twice measured 3.3x slower: bench/workloads.py's logsumexp)"
)
_NATIVE_LOGSUMEXP = functools.partial(native.logsumexp, axis=0)  # one pass over the rows


class ScanEngine:
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
            return _generic(plan, call)
        return _map(plan, call)

    def states(self, plan: Plan, xs: Any, offset: int) -> list:
        """Each term's state over ``plan``'s rows (global indices from ``offset``)."""
        return states(plan, xs, offset)


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


def _steps(step: Callable, init: Any, k: int, *, rows: int) -> tuple[Any, Any]:
    """``state, y = step(i, state)`` for ``i`` in ``range(k)`` in a scan; the ``y``
    are stacked. The index is scanned over, not carried: a carried counter would be
    a residual that keeps the forward loop alive in a gradient."""
    return _progress.scan(lambda state, i: step(i, state), init, jnp.arange(k), rows=rows)


# -- the rows of a plan: shares, chunks, indices ---------------------------------------
@dataclasses.dataclass(frozen=True)
class _Rows:
    """How a plan's rows are cut: ``m`` rows per share (``d`` shares, one per device,
    or one), chunks of ``b`` rows, the last ``r`` of them repeated (overlap) or a
    remainder of ``r`` rows apart; ``offset`` is the global index of the first row."""

    plan: Plan
    offset: int

    @property
    def lanes(self) -> Lanes | None:
        lanes = self.plan.lanes
        return lanes if lanes is not None and lanes.count > 1 else None

    @property
    def d(self) -> int:
        return self.lanes.count if self.lanes else 1

    @property
    def m(self) -> int:
        assert self.plan.n is not None
        return self.plan.n

    def whole(self, x: Any) -> Any:
        """A leaf of all the plan's rows (every share, in order)."""
        return x if not self.lanes else self.lanes.constrain(x)

    def view(self, x: Any) -> Any:
        """A leaf as ``(d, m, ...)`` (as it is for one share)."""
        if not self.lanes:
            return x
        return self.lanes.constrain(x.reshape(self.d, self.m, *x.shape[1:]))

    def unview(self, y: Any) -> Any:
        if not self.lanes:
            return y
        return self.lanes.constrain(y.reshape(self.d * self.m, *y.shape[2:]))

    def take(self, views: list, start: Any, rows: int, *, named: bool = True) -> list:
        """``rows`` rows of every share from ``start``, as one chunk for ``fun``
        (``named``: a slice a gradient takes again, see ``_remat``; not for tangents,
        which have no transpose through a name)."""
        axis = 1 if self.lanes else 0
        out = []
        for v in views:
            c = lax.dynamic_slice_in_dim(v, start, rows, axis)
            c = checkpoint_name(c, RECOMPUTED) if named else c
            out.append(c if not self.lanes else self.lanes.constrain(c.reshape(-1, *c.shape[2:])))
        return out

    def shares(self, y: jax.Array, rows: int) -> jax.Array:
        """A chunk output ``(d * rows, ...)`` as ``(d, rows, ...)``."""
        if not self.lanes:
            return y
        return self.lanes.constrain(y.reshape(self.d, rows, *y.shape[1:]))

    def index(self, start: Any, rows: int) -> jax.Array:
        """Global row indices of a chunk: ``(rows,)``, or ``(d, rows)`` with lanes."""
        local = self.offset + start + jnp.arange(rows, dtype=index_dtype())
        if not self.lanes:
            return local
        first = jnp.arange(self.d, dtype=index_dtype())[:, None] * self.m
        return self.lanes.constrain(first + local[None])

    def per_share(self, f: Callable, last: int | None = None) -> Callable:
        """``f`` over one share's arrays, mapped over the device axis with lanes (the
        last argument, e.g. the final state, is shared unless ``last=0``)."""
        return f if not self.lanes else jax.vmap(f, in_axes=(0, 0, None, last))


def _start(i: jax.Array, m: int, rows: int) -> jax.Array:
    """The first row of overlapping chunk ``i``: ``i * rows``, the last at ``m - rows``."""
    return jnp.minimum(i * rows, m - rows)


def _place(i: jax.Array, k: int) -> jax.Array:
    """0 for most chunks, 1 for the one before the last, 2 for the last."""
    return (i == k - 2).astype(jnp.int32) + 2 * (i == k - 1).astype(jnp.int32)


def _keep_table(leaf: LeafReduction, dtype: Any, r: int, rows: int) -> np.ndarray:
    """How much each row of a chunk counts, by place (see :func:`_place`): the ``r``
    rows the last two chunks share count for half in both, or only in the first."""
    table = np.ones((3, rows), np.float32)
    if r:
        half = leaf.monoid.halves_for(dtype)
        table[2, :r] = 0.5 if half else 0.0
        if half:
            table[1, -r:] = 0.5
    return table


def _weights(
    rows: _Rows, leaf: LeafReduction, dtypes: list, r: int, place: Any, *, keep: bool
) -> Any:
    """This chunk's row weights for ``leaf``: the monoid's encoding (``keep=False``)
    or the 0/1/half weights themselves; None when every row counts once. A row of a
    constant table (a mask or a select in the loop measured 8-9x slower on XLA:CPU)."""
    if not r:
        return None
    table = _keep_table(leaf, dtypes[0], r, rows.plan.rows_per_chunk)
    if not keep:
        table = leaf.monoid.encode(table, dtypes[0], np)
        if table is None:
            return None
    row = lax.dynamic_index_in_dim(jnp.asarray(table), place, 0, False)
    return checkpoint_name(row, RECOMPUTED)


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


def _evaluator(traced: Traced) -> Callable[[list], list]:
    """A chunk's prepared outputs from ``fun``'s trace; a large ``fun`` is materialized
    before it is reduced: XLA would fuse it into every reduction reading it and
    compile and run it several times (360 equations: compile 15 s -> 0.5 s, run
    1400 -> 22 ms). Cheap funs stay fused: materializing cost 9x on XLA:CPU."""
    closed = traced.jaxpr
    large = size(closed.jaxpr) >= LARGE_FUN
    barrier: Callable = lax.optimization_barrier if large else (lambda y: y)
    return lambda leaves: barrier(jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves))


def _items(reduction: MonoidReduction, leaf: LeafReduction, out_shape: Any) -> tuple:
    """One row of each leaf ``leaf`` reads, from the prepared outputs' shapes."""
    return leaf.items(reduction.reads(jax.tree.leaves(out_shape), leaf))


def identity_states(reduction: MonoidReduction, out_shape: Any, lanes: Lanes | None) -> list:
    """Each term's identity state for rows like ``out_shape`` (the prepared outputs of
    a chunk), with a leading device axis for ``lanes``."""
    out = []
    for leaf in reduction.leaves:
        state = leaf.monoid.init(_items(reduction, leaf, out_shape))
        if lanes is not None:
            spread = lambda a: lanes.constrain(jnp.broadcast_to(a, (lanes.count, *a.shape)))
            state = jax.tree.map(spread, state)
        out.append(state)
    return out


def _merge(leaf: LeafReduction, a: Any, b: Any, lanes: Lanes | None) -> Any:
    merge = leaf.monoid.merge
    return merge(a, b) if lanes is None else jax.vmap(merge)(a, b)


def merge_all(reduction: MonoidReduction, state: list, lanes: Lanes | None) -> list:
    """States with a leading device axis merged into one (gathered, then merged
    pairwise, lower devices, i.e. lower rows, on the left); without lanes, as they
    are."""
    if lanes is None:
        return state
    return [
        merge_stacked(leaf.monoid.merge, jax.tree.map(lanes.gather, s))
        for leaf, s in zip(reduction.leaves, state, strict=True)
    ]


# -- the tangent of a reduction: a sum over rows, chunk by chunk ------------------------
def tangent_shares(
    plan: Plan, dconsts: dict[int, Any], xs: Any, dxs: Any, final: list, offset: int = 0
) -> list:
    """Each term's share of the result's tangent from the rows of ``plan``:
    ``Monoid.tangent`` of every chunk (per device with lanes), with the tangents of
    ``fun``'s outputs from ``jax.jvp``, summed (``None`` for a term with no tangent).

    ``dconsts`` maps ``id`` of a constant of the plan's traces to its tangent (only
    nonzero ones), ``dxs`` are the inputs' tangents (symbolic zeros allowed),
    ``final`` the final states over all rows.
    """
    reduction, traced = plan.reduction, plan.traced
    assert reduction is not None and traced is not None
    leaves = [rows_x for rows_x in jax.tree.leaves(xs)]
    dleaves = jax.tree.leaves(dxs, is_leaf=lambda t: isinstance(t, SymbolicZero))
    x_idx = [i for i, t in enumerate(dleaves) if tangent.nonzero(t)]
    if not x_idx and not dconsts:
        return [None] * len(reduction.leaves)
    rows = _Rows(plan, offset)
    leaves = [rows.whole(x) for x in leaves]
    dflat = [rows.whole(dleaves[i]) for i in x_idx]
    views, dviews = [rows.view(x) for x in leaves], [rows.view(t) for t in dflat]
    b, k = plan.rows_per_chunk, plan.chunks
    r = plan.masked if plan.policy is Policy.OVERLAP else 0

    def shares(
        tr: Traced, chunk: list, dchunk: list, start: Any, n_rows: int, place: Any, r: int
    ) -> list:
        closed = tr.jaxpr
        c_idx = [j for j, c in enumerate(closed.consts) if id(c) in dconsts]

        def fun_chunk(c_nz: list, x_nz: list) -> list:
            cvals, xvals = list(closed.consts), list(chunk)
            for j, v in zip(c_idx, c_nz, strict=True):
                cvals[j] = v
            for i, v in zip(x_idx, x_nz, strict=True):
                xvals[i] = v
            return jax.core.eval_jaxpr(closed.jaxpr, cvals, *xvals)

        primal = ([closed.consts[j] for j in c_idx], [chunk[i] for i in x_idx])
        tangents = ([dconsts[id(closed.consts[j])] for j in c_idx], dchunk)
        ys, dys = jax.jvp(fun_chunk, primal, tangents)
        idx, out = rows.index(start, n_rows), list[Any]()
        for leaf, state in zip(reduction.leaves, final, strict=True):
            src = [rows.shares(ys[s], n_rows) for s in leaf.sources]
            dsrc = [rows.shares(dys[s], n_rows) for s in leaf.sources]
            if any(d.dtype == jax.dtypes.float0 for d in dsrc):
                out.append(None)
                continue
            keep = _weights(rows, leaf, [y.dtype for y in src], r, place, keep=True)
            items = _items(reduction, leaf, traced.out_shape)
            f = lambda pair, idx, keep, state, leaf=leaf, items=items: leaf.tangent(
                pair[0], pair[1], idx, keep, state, items
            )
            share = rows.per_share(f)((src, dsrc), idx, keep, state)
            if rows.lanes:  # the devices' shares merged, lower rows first
                share = merge_stacked(
                    leaf.monoid.tangent_merge, jax.tree.map(rows.lanes.gather, share)
                )
            out.append(share)
        return out

    if plan.policy is Policy.SINGLE:
        return shares(traced, leaves, dflat, 0, rows.m, 0, 0)
    starts = (lambda i: _start(i, rows.m, b)) if r else (lambda i: i * b)
    step = functools.partial(jax.checkpoint, prevent_cse=False)(
        lambda i: shares(
            traced, rows.take(views, starts(i), b), rows.take(dviews, starts(i), b, named=False),
            starts(i), b, _place(i, k), r,
        )
    )  # fmt: skip
    shape = jax.eval_shape(step, jnp.int32(0))
    total = [
        None
        if sh is None
        else leaf.monoid.tangent_init(jax.tree.map(lambda s: zeros(s.shape, s.dtype, like=s), sh))
        for leaf, sh in zip(reduction.leaves, shape, strict=True)
    ]
    add = lambda a, c: merge_shares(reduction, a, c)
    total, _ = _steps(lambda i, acc: (add(acc, step(i)), None), total, k, rows=b)
    if plan.policy is Policy.REMAINDER and plan.remainder:
        assert plan.tail is not None
        at = k * b
        chunk = rows.take(views, at, plan.remainder)
        dchunk = rows.take(dviews, at, plan.remainder, named=False)
        total = add(total, shares(plan.tail, chunk, dchunk, at, plan.remainder, 0, 0))
    return total


def merge_shares(reduction: MonoidReduction, a: list, b: list) -> list:
    """Two parts' tangent shares merged per term (``None``: a term with no tangent)."""
    return [
        x if y is None else y if x is None else leaf.monoid.tangent_merge(x, y)
        for leaf, x, y in zip(reduction.leaves, a, b, strict=True)
    ]


# -- maps and generic reductions --------------------------------------------------------
def _map(plan: Plan, call: Call) -> Any:
    """A map: chunks written into the ``(n, ...)`` outputs where their rows belong
    (the last chunk writes its repeated rows again, with the same values). One copy
    of ``fun``, no row mask, no stacked copy of the outputs. A ``chunk_reduction``
    other than the identity is applied to every chunk (it must keep the rows)."""
    traced = plan.traced
    assert traced is not None and plan.n is not None
    rows = _Rows(plan, 0)
    per_chunk = lambda out: call.chunk_reduction(out)
    if plan.policy is Policy.SINGLE:
        out = per_chunk(traced(call.xs))
        return jax.tree.map(rows.whole, out)
    leaves = [rows.whole(x) for x in jax.tree.leaves(call.xs)]
    views = [rows.view(x) for x in leaves]
    b, k = plan.rows_per_chunk, plan.chunks
    r = plan.masked if plan.policy is Policy.OVERLAP else 0
    starts = (lambda i: _start(i, rows.m, b)) if r else (lambda i: i * b)
    out_tree = jax.tree.structure(traced.out_shape)

    def outputs(tr: Traced, chunk: list, n_rows: int) -> list:
        ys = jax.tree.unflatten(
            out_tree if tr is traced else jax.tree.structure(tr.out_shape), _evaluator(tr)(chunk)
        )
        out = per_chunk(ys)
        what = (
            "fun(chunk)" if call.chunk_reduction is identity_fn else "chunk_reduction(fun(chunk))"
        )
        check_rowwise(jax.eval_shape(lambda: out), rows.d * n_rows, what)
        return [rows.shares(y, n_rows) for y in jax.tree.leaves(out)]

    chunk = _remat(lambda i: outputs(traced, rows.take(views, starts(i), b), b))
    shapes = jax.eval_shape(chunk, jnp.int32(0))
    axis = 1 if rows.lanes else 0
    size = (rows.d, rows.m) if rows.lanes else (rows.m,)
    out = [zeros((*size, *s.shape[axis + 1 :]), s.dtype, like=s) for s in shapes]
    write = lambda o, y, at: lax.dynamic_update_slice_in_dim(o, y, at, axis)

    def step(i: jax.Array, out: list) -> tuple[list, None]:
        return [write(o, y, starts(i)) for o, y in zip(out, chunk(i), strict=True)], None

    out = _steps(step, out, k, rows=b)[0]
    if plan.policy is Policy.REMAINDER and plan.remainder:
        assert plan.tail is not None
        ys = outputs(plan.tail, rows.take(views, k * b, plan.remainder), plan.remainder)
        out = [write(o, y, k * b) for o, y in zip(out, ys, strict=True)]
    tree = jax.tree.structure(jax.eval_shape(per_chunk, traced.out_shape))
    return jax.tree.unflatten(tree, [rows.unview(o) for o in out])


def _generic(plan: Plan, call: Call) -> Any:
    """A reduction that is not a monoid: full chunks of ``B`` rows (of every share),
    then the remainder in a separate call; seeded with the first chunk's result
    (never with zeros) and combined whole, as in the original library."""
    traced = plan.traced
    assert traced is not None and plan.n is not None
    reduction, chunk_reduction = call.reduction, call.chunk_reduction
    assert reduction is not None
    b, k, r = plan.rows_per_chunk, plan.chunks, plan.remainder
    tree = jax.tree.structure(call.xs)
    one = _Rows(dataclasses.replace(plan, lanes=None), 0)

    def share(xs: Any) -> Any:  # one device's rows (or all of them)
        if plan.policy is Policy.SINGLE:
            return chunk_reduction(traced(xs))
        leaves = jax.tree.leaves(xs)
        take = lambda start, size: jax.tree.unflatten(tree, one.take(leaves, start, size))
        step = _remat(lambda i: chunk_reduction(traced(take(i * b, b))))
        out = step(jnp.int32(0))
        if k > 1:
            out, _ = _steps(lambda i, acc: (reduction(acc, step(i + 1)), None), out, k - 1, rows=b)
        if not r:
            return out
        assert plan.tail is not None
        rest = chunk_reduction(plan.tail(take(k * b, r)))
        _check_same_shapes(out, rest, b, r, reduction)
        return reduction(out, rest)

    rows = _Rows(plan, 0)
    if not rows.lanes:
        return share(call.xs)
    # Each device reduces its own rows (fun and chunk_reduction see one device's chunk,
    # never the same rows of every device at once), then the devices' results are
    # combined in the order of the rows.
    per_device = jax.vmap(share)(jax.tree.map(rows.view, call.xs))
    per_device = jax.tree.map(rows.lanes.gather, per_device)  # d results, small
    results = [jax.tree.map(lambda a, j=j: a[j], per_device) for j in range(rows.d)]
    return functools.reduce(reduction, results)


def _check_same_shapes(out: Any, rest: Any, b: int, r: int, reduction: Callable) -> None:
    """A generic reduction combines results of equal structure: a chunk's and the
    remainder's must agree (they do not when ``chunk_reduction`` keeps the rows)."""
    shapes = lambda t: jax.tree.map(lambda v: (jnp.shape(v), jnp.result_type(v)), t)
    if shapes(out) != shapes(rest):
        raise ValueError(
            f"reduction={reduction!r} would combine chunk_reduction's result for a chunk of "
            f"{b} rows, {shapes(out)}, with its result for the last {r} rows (the remainder), "
            f"{shapes(rest)}; they differ, so chunk_reduction keeps the rows (the default "
            "chunk_reduction is the identity). Pass a chunk_reduction that reduces the rows "
            "(e.g. jnp.sum), or a batch_size that divides the number of rows"
        )
