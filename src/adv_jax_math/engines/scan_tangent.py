"""The tangent of a monoid reduction on the scan engine: a sum over rows, computed
over the same chunks as the forward fold (``Monoid.tangent`` of each chunk, with the
tangents of ``fun``'s outputs from ``jax.jvp``; per device with lanes). ``analysis.tangent``
makes it the ``custom_jvp`` rule of a reduction that selects rows (and of the fused
kernel's); reverse mode transposes it chunk by chunk.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from ..analysis import tangent
from ..core.sharding import zeros
from ..core.trace import Traced
from ..monoids.base import merge_stacked
from ..monoids.reduction import MonoidReduction
from ..plan.base import Plan, Policy
from .scan_chunks import _items, _place, _Rows, _start, _steps, _weights

__all__ = ["merge_shares", "tangent_shares"]


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
    dleaves = jax.tree.leaves(dxs, is_leaf=lambda t: isinstance(t, SymbolicZero))
    x_idx = [i for i, t in enumerate(dleaves) if tangent.nonzero(t)]
    if not x_idx and not dconsts:
        return [None] * len(reduction.leaves)
    rows = _Rows(plan, offset)
    leaves = [rows.whole(x) for x in jax.tree.leaves(xs)]
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
