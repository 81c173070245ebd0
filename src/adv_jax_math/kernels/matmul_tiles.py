"""Pairwise reductions as matmul tiles: XLA's loops (the CPU engine), or a Pallas
kernel for GPUs and TPUs (``kernels/tile_loops.py``, as ``Layout.on`` says); the
reverse pass is ``kernels/matmul_reverse.py``.

A tile of ``bi`` x rows by ``bj`` y rows is one chunk of a monoid reduction over its
y rows whose items are its x rows: ``sources(consts, xt, yt)`` gives each value of
``f`` on the tile rows (y) first, ``(bj, bi, *t)`` per pair or ``(bj, *v)`` per y
row, and each term's monoid folds and merges them as over any chunk. ``f``'s dot
products over a tile are then one matmul (XLA's dot), and so are a softmax-weighted
sum's ``P @ V`` and, in the reverse pass, its ``P^T @ dO`` and ``dO @ V^T``.
:func:`tile_states` gives each term's state for every x tile (a loop over the x tiles,
each a loop over the y tiles; one kernel).

x and y are padded to whole tiles with copies of their last row; padded y rows are
filled and weighted out (``Monoid.without``), padded x rows' results dropped by the
caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core.sharding import on_every_device
from ..monoids.base import index_dtype
from ..monoids.reduction import MonoidReduction
from .native import topk_fold, usable
from .pairwise import _pad_rows
from .pairwise_device import Layout
from .tile_loops import Tiled, tile_kernel

__all__ = ["KERNEL_NAME", "Sources", "tile_states"]

KERNEL_NAME = "adv_jax_math_matmul_tiles"

Sources = Callable[..., list]  # (consts, x tile leaves, y tile leaves, keep=None)


def _tiled(xs: list, ys: list, tiles: tuple[int, int]) -> tuple[list, list, int, int]:
    """x leaves as ``(x tiles, bi, ...)``, y leaves padded to whole tiles; the counts."""
    bi, bj = tiles
    nxt, nyt = -(-xs[0].shape[0] // bi), -(-ys[0].shape[0] // bj)
    xt = [_pad_rows(a, nxt * bi).reshape(nxt, bi, *a.shape[1:]) for a in xs]
    return xt, [_pad_rows(a, nyt * bj) for a in ys], nxt, nyt


def _rows(ys: list, j: Any, bj: int) -> list:
    return [lax.dynamic_slice_in_dim(a, j * bj, bj) for a in ys]


def _fold(
    sources: Sources,
    red: MonoidReduction,
    c: list,
    x: list,
    y: list,
    start: Any,
    m: int,
    fast: bool,
    acc: list | None = None,
    native: Callable | None = None,
) -> list:
    """Each term's state over one tile: the y rows ``y`` from row ``start`` on (those
    from row ``m`` on weighted out), folded into ``acc`` (the states of the tiles
    before) if given; a top-k term into its empty state if not, where the native
    kernel (``native``, XLA only) folds it. In XLA (``fast``) the rows' indices and
    weights are vectors; in a kernel each has its value's shape (Mosaic makes no
    column of a vector)."""
    src = sources(c, x, y)
    if fast:  # the values computed once, as the reverse pass reads them
        src = list(lax.optimization_barrier(src))
    bj = y[0].shape[0]
    rows = lambda a: start + lax.broadcasted_iota(jnp.int32, a.shape if not fast else (bj,), 0)
    out: list = []
    for leaf in red.leaves:
        reads, w = [src[s] for s in leaf.sources], None
        j0 = rows(reads[0])
        if m % bj:
            col = lambda a: (
                (rows(a) if not fast else rows(a).reshape((bj,) + (1,) * (a.ndim - 1))) < m
            )
            reads, w = leaf.monoid.without(reads, col, j0 < m)
        into = acc[len(out)] if acc is not None else None
        out.append(leaf.fold_into(into, reads, j0.astype(index_dtype()), w, native, fast))
    return out


def tile_states(
    sources: Sources,
    red: MonoidReduction,
    consts: list,
    xs: list,
    ys: list,
    layout: Layout,
) -> list:
    """Each term's state for every x tile (leading axis: the x tiles; the tile's x
    rows where its items put them): XLA's loops, or ``layout.on``'s kernel."""
    if layout.on != "xla":
        # A Pallas call has no derivative of its own: differentiated (from the second
        # order on), the states are those of the same tiles in XLA's loops.
        loops = dataclasses.replace(layout, on="xla")
        kernel = jax.custom_jvp(lambda c, x, y: _kernel(sources, red, c, x, y, layout))
        in_xla = lambda c, x, y: tile_states(sources, red, c, x, y, loops)
        kernel.defjvp(lambda primals, tangents: jax.jvp(in_xla, primals, tangents))
        return on_every_device(kernel, consts, xs, ys)
    bj, m = layout.tiles[1], ys[0].shape[0]
    xt, ys, _, nyt = _tiled(xs, ys, layout.tiles)
    native = topk_fold if usable() else None  # on the CPU (TopK.fold_into)
    fold = lambda x, j, acc: _fold(
        sources, red, consts, x, _rows(ys, j, bj), j * bj, m, True, acc, native
    )

    def per_x(x: list) -> list:
        acc = fold(x, 0, None)
        step = lambda j, acc: fold(x, j, acc)
        return lax.fori_loop(1, nyt, step, acc) if nyt > 1 else acc

    return lax.map(per_x, xt)


def _kernel(
    sources: Sources, red: MonoidReduction, consts: list, xs: list, ys: list, layout: Layout
) -> list:
    """:func:`tile_states` as one Pallas kernel (``kernels/tile_loops.py``): the x
    tiles outer, the y tiles inner, the states merged across them."""
    (bi, bj), m = layout.tiles, ys[0].shape[0]
    xt, ys, nxt, nyt = _tiled(xs, ys, layout.tiles)
    xs = [a.reshape(nxt * bi, *a.shape[2:]) for a in xt]
    tree: list = []

    def body(c: list, x: list, y: list, i: Any, t: Any) -> list:
        states = _fold(sources, red, c, x, y, t * bj, m, False)
        leaves, treedef = jax.tree.flatten(states)
        tree[:] = [treedef]
        return leaves

    def merge(a: list, b: list) -> list:
        u, v = (jax.tree.unflatten(tree[0], s) for s in (a, b))
        merged = [leaf.monoid.merge(p, q) for leaf, p, q in zip(red.leaves, u, v, strict=True)]
        return jax.tree.leaves(merged)

    outer, inner = [Tiled(a, bi) for a in xs], [Tiled(a, bj) for a in ys]
    out = tile_kernel(body, merge, consts, outer, inner, (nxt, nyt), layout, KERNEL_NAME)
    return jax.tree.unflatten(tree[0], out)


def _sum(a: list, b: list) -> list:
    return [u + v for u, v in zip(a, b, strict=True)]
