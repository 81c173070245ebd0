"""The pairwise kernel: ``out_i = reduce_j f(x_i, y_j)`` in one Pallas call.

A program per tile of ``bi`` x rows (the grid); inside it, a loop over the tiles of
``bj`` y rows: evaluate ``f``'s tile jaxpr on ``(bi, bj)`` pairs, fold each term's
monoid over the ``bj`` rows for every x row (``Monoid.fold`` mapped over the x rows,
with the rows' global ``j`` indices), merge into the state carried across the loop,
and write each x row's state once. Nothing ``N x M`` is stored. x and y are padded
to whole tiles with copies of their last row (``f`` only sees real rows); padded y
rows are filled and weighted out as the 1-D kernel does, padded x rows dropped.
The caller (``pairs.api``) finalizes the states.

Runs in interpret mode on CPU (its layout, ``(bi, bj, features)`` arrays, is not
the one GPUs and TPUs take: that is ``pairwise_device.py``'s).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..monoids.base import index_dtype, merge_stacked
from ..monoids.reduction import LeafReduction
from .fused_reduce.interpreter import evaluate
from .fused_reduce.kernel import (
    _load_const,
    _to_kernel_const,
    kernel_const_aval,
    named_jit,
    rows_at,
)

__all__ = ["KERNEL_NAME", "states"]

KERNEL_NAME = "adv_jax_math_pairwise"


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    """``a`` with copies of its last row up to ``rows`` rows."""
    extra = rows - a.shape[0]
    if not extra:
        return a
    return jnp.concatenate([a, jnp.broadcast_to(a[-1:], (extra, *a.shape[1:]))])


def _fold(leaf: LeafReduction, src: list, start: Any, bj: int, m: int, fast: bool) -> Any:
    """Each x row's state of ``leaf`` over one y tile (``src``: ``(bi, bj, ...)``);
    ``fast``: the monoid's fast fold (plain JAX, differentiable: top-k's values)."""
    j = start + lax.broadcasted_iota(jnp.int32, (bj,), 0)
    w = None
    if m % bj:
        keep = j < m
        kept = lambda a: keep.reshape((1, bj) + (1,) * (a.ndim - 2))
        src, w = leaf.monoid.without(src, kept, keep)
    idx = j.astype(index_dtype())
    # once, as a kernel computes them (see fused_reduce.kernel._term_state): the
    # reverse pass reads them behind a barrier too (_pairwise_grad)
    src = list(lax.optimization_barrier(list(src)))
    return jax.vmap(lambda rows: leaf.fold(rows, idx, w, fast=fast))(src)


def states(
    prepared: Any,
    tiles: tuple[int, int],
    consts: Sequence[Any],
    xs: list,
    ys: list,
    summed: Sequence[int] = (),
    reference: bool = False,
) -> list:
    """Each term's state for every x row (leading axis ``N``), ``xs``/``ys`` the leaves
    of x and y, ``consts`` the values of the tile jaxpr's constants then those ``f``
    closes over (``prepared``: see ``pairs.kernel.Prepared``). The sums numbered
    in ``summed`` are merged over the x rows too: one state per x tile (leading axis:
    the tiles), for the caller to merge (a reverse pass's cotangents of the values
    ``f`` closes over).
    ``reference``: the same computation in plain JAX (a map over the x tiles), which
    JAX can differentiate."""
    bi, bj = tiles
    n, m = xs[0].shape[0], prepared.m
    xt, yt = pl.cdiv(n, bi), pl.cdiv(m, bj)
    xs = [_pad_rows(a, xt * bi) for a in xs]
    ys = [_pad_rows(a, yt * bj) for a in ys]
    closed, red = prepared.jaxpr, prepared.reduction
    kconsts = list(consts)
    const_avals = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in kconsts]
    own = len(closed.jaxpr.constvars)

    def tile(c: list, xv: list, start: Any, yv: list) -> list:
        srcs = evaluate(closed.jaxpr, c[:own], [*c[own:], *xv, *yv], upcast=False)
        fold = lambda leaf: _fold(leaf, [srcs[s] for s in leaf.sources], start, bj, m, reference)
        return [fold(leaf) for leaf in red.leaves]

    def program(i: Any, c: list, xv: list, y_tile: Any) -> list:
        """The states of x tile ``i`` (``y_tile(start)``: the y rows from ``start``)."""

        def step(j: Any, acc: list) -> list:
            new = tile(c, xv, j * bj, y_tile(j * bj))
            join = lambda m: m.merge_fast if reference else m.merge  # plain JAX: fast
            merge = lambda leaf, a, b: jax.vmap(join(leaf.monoid))(a, b)
            return [merge(leaf, a, b) for leaf, a, b in zip(red.leaves, acc, new, strict=True)]

        acc = tile(c, xv, 0, y_tile(0))
        if yt > 1:
            acc = lax.fori_loop(1, yt, step, acc)
        real = n - i * bi  # the x rows of this tile that are not padding
        return [
            _over_rows(leaf, a, real) if t in summed else a
            for t, (leaf, a) in enumerate(zip(red.leaves, acc, strict=True))
        ]

    row_states = jax.eval_shape(
        lambda c, xv, yv: tile(c, xv, 0, yv),
        const_avals,
        [jax.ShapeDtypeStruct((bi, *a.shape[1:]), a.dtype) for a in xs],
        [jax.ShapeDtypeStruct((bj, *a.shape[1:]), a.dtype) for a in ys],
    )
    state_avals = jax.tree.leaves(row_states)
    # Per output leaf: whether its term is summed over the x rows (one row per program).
    over_x = [t in summed for t, s in enumerate(row_states) for _ in jax.tree.leaves(s)]
    block_of = [1 if o else bi for o in over_x]
    out_shapes = [
        jax.ShapeDtypeStruct((xt * b, *(a.shape[1:] or (1,))), a.dtype)
        for b, a in zip(block_of, state_avals, strict=True)
    ]
    if reference:
        by_tile = [a.reshape(xt, bi, *a.shape[1:]) for a in xs]
        rows = lambda start: [lax.dynamic_slice_in_dim(a, start, bj) for a in ys]
        one = lambda args: jax.tree.leaves(program(args[0], kconsts, args[1], rows))
        flat = lax.map(one, (jnp.arange(xt), by_tile))
        flat = [o.reshape(s.shape) for o, s in zip(flat, out_shapes, strict=True)]
    else:
        flat = _kernel(program, kconsts, const_avals, xs, ys, out_shapes, tiles, block_of)
    flat = [
        o.reshape(xt, *a.shape[1:]) if summed_leaf else o[:n].reshape(n, *a.shape[1:])
        for o, summed_leaf, a in zip(flat, over_x, state_avals, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(row_states), flat)


def _kernel(
    program: Any,
    kconsts: list,
    const_avals: list,
    xs: list,
    ys: list,
    out_shapes: list,
    tiles: tuple[int, int],
    block_of: list,
) -> list:
    """``program`` run as one Pallas call: a program per x tile, y read whole."""
    bi, bj = tiles
    nc, nx, ny = len(kconsts), len(xs), len(ys)

    def kernel(*refs: Any) -> None:
        c_refs, x_refs = refs[:nc], refs[nc : nc + nx]
        y_refs, o_refs = refs[nc + nx : nc + nx + ny], refs[nc + nx + ny :]
        c = [_load_const(r, a) for r, a in zip(c_refs, const_avals, strict=True)]
        xv = [r[...] for r in x_refs]
        rows = lambda start: [r[rows_at(start, bj, r.ndim)] for r in y_refs]
        acc = program(pl.program_id(0), c, xv, rows)
        for value, o_ref in zip(jax.tree.leaves(acc), o_refs, strict=True):
            o_ref[...] = value.reshape(o_ref.shape).astype(o_ref.dtype)

    def spec(shape: tuple, rows: int | None) -> Any:
        block = shape if rows is None else (rows, *shape[1:])
        tail = (0,) * (len(shape) - 1)
        return pl.BlockSpec(
            block, (lambda i: (0, *tail)) if rows is None else (lambda i: (i, *tail))
        )

    call = pl.pallas_call(
        kernel,
        out_shape=out_shapes,
        grid=(xs[0].shape[0] // bi,),
        in_specs=[spec(kernel_const_aval(a).shape, None) for a in const_avals]
        + [spec(a.shape, bi) for a in xs]
        + [spec(a.shape, None) for a in ys],
        out_specs=[spec(s.shape, b) for s, b in zip(out_shapes, block_of, strict=True)],
        interpret=True,
        name=KERNEL_NAME,
    )
    return list(named_jit(call, KERNEL_NAME)(*map(_to_kernel_const, kconsts), *xs, *ys))


def _over_rows(leaf: LeafReduction, state: Any, real: Any) -> Any:
    """One tile's sums (leading axis: its x rows) merged into one (leading axis 1),
    the rows from ``real`` on (padding) left out."""
    assert leaf.monoid.name == "add", "only sums are merged over the x rows"
    rows = jax.tree.leaves(state)[0].shape[0]
    keep = lax.broadcasted_iota(jnp.int32, (rows,), 0) < real
    at = lambda a: keep.reshape((rows,) + (1,) * (a.ndim - 1))
    masked = jax.tree.map(lambda a: jnp.where(at(a), a, jnp.zeros_like(a)), state)
    return jax.tree.map(lambda a: a[None], merge_stacked(leaf.monoid.merge, masked))
