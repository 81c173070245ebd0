"""Maps and generic reductions on the scan engine. A map writes each chunk's outputs
where its rows belong (the last, overlapping chunk writes its repeated rows again,
with the same values); a reduction that is not a monoid runs full chunks of
``batch_size`` rows, then the remainder in a separate call, and combines the chunk
results in the order of the rows, as the original library did.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..analysis import tangent
from ..analysis.validate import check_rowwise
from ..core.sharding import zeros
from ..core.trace import Traced
from ..monoids.base import identity as identity_fn
from ..plan.base import Call, Plan, Policy
from .scan_chunks import _evaluator, _remat, _Rows, _start, _steps

__all__ = ["run_generic", "run_map"]


def run_map(plan: Plan, call: Call) -> Any:
    """A map: chunks written into the ``(n, ...)`` outputs where their rows belong
    (the last chunk writes its repeated rows again, with the same values). One copy
    of ``fun``, no row mask, no stacked copy of the outputs. A ``chunk_reduction``
    other than the identity is applied to every chunk (it must keep the rows)."""
    traced = plan.traced
    assert traced is not None and plan.n is not None
    rows = _Rows(plan, 0)
    per_chunk = lambda out: call.chunk_reduction(out)
    if plan.policy is Policy.SINGLE:
        if plan.derivatives is not None:
            return _whole(plan, plan.derivatives, call)
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


def _whole(plan: Plan, chunked: Plan, call: Call) -> Any:
    """A map run whole whose derivatives run ``chunked``'s chunks: a ``custom_jvp``
    whose rule is ``jax.jvp`` of the chunked map, values and tangents. Reverse mode
    transposes those chunks one at a time, each recomputed (``_remat``), so it keeps
    one chunk's intermediates, not ``fun``'s intermediates for all rows; the values
    too come from the chunks there, as XLA keeps several arrays of all rows between
    the whole map's fusions (8 softmax layers, 2^16 rows of 256: 256 MiB with the
    values from the whole map, 129 MiB chunked). The traces' constants are explicit
    arguments, so that their tangents are kept."""
    consts = list({id(c): c for c in plan.consts()}.values())
    tree = jax.tree.structure(call.xs)
    on = lambda p, values: p.with_consts(dict(zip(map(id, consts), values, strict=True)))
    rows = lambda leaves: dataclasses.replace(call, xs=jax.tree.unflatten(tree, leaves))

    def forward(values: list, leaves: list) -> Any:
        whole = dataclasses.replace(on(plan, values), derivatives=None)
        return run_map(whole, rows(leaves))

    @jax.custom_jvp
    def run(values: list, leaves: list) -> Any:
        return forward(values, leaves)

    def rule(primals: tuple, tangents: tuple) -> tuple:
        (values, leaves), (dvalues, dleaves) = primals, tangents
        c_pos = [i for i, t in enumerate(dvalues) if tangent.nonzero(t)]
        x_pos = [i for i, t in enumerate(dleaves) if tangent.nonzero(t)]

        def chunks(cs: list, xs: list) -> Any:
            vals, args = list(values), list(leaves)
            for i, c in zip(c_pos, cs, strict=True):
                vals[i] = c
            for i, x in zip(x_pos, xs, strict=True):
                args[i] = x
            return run_map(on(chunked, vals), rows(args))

        pick = lambda vs, pos: [vs[i] for i in pos]
        primal = (pick(values, c_pos), pick(leaves, x_pos))
        return jax.jvp(chunks, primal, (pick(dvalues, c_pos), pick(dleaves, x_pos)))

    run.defjvp(rule, symbolic_zeros=True)
    return run(consts, jax.tree.leaves(call.xs))


def run_generic(plan: Plan, call: Call) -> Any:
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
