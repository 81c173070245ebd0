"""The matmul tiles' reverse pass (``kernels/matmul_tiles.py``'s tiles): per tile, each
term's ``Monoid.cotangent`` of the values from the final states (flash attention's
recipe for every monoid), then one VJP of ``sources`` for the tile's x rows, y rows and
constants: nothing ``N x M`` stored. XLA's loops; or on a GPU two kernels, ``dx`` over
the x tiles, ``dy`` over the y tiles, as flash attention's backward; on a TPU one, one
side's cotangents whole in VMEM (:func:`_one_pass`).

In the reverse pass of a ragged tile, ``sources`` zeroes every value and cotangent on
the padded rows (``pairs.dots._guard``): the transposes of ``f``'s dot products and
broadcasts sum over the rows, and a padded copy of an infinite row would add
``0 * inf`` (NaN) there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core.linear import cotangent_for
from ..core.sharding import on_every_device
from ..monoids.base import index_dtype
from ..monoids.reduction import MonoidReduction
from .matmul_tiles import Sources, _rows, _sum, _tiled
from .pairwise_device import Layout
from .tile_loops import Tiled, tile_kernel

__all__ = ["REVERSE_KERNEL_NAME", "tile_cotangents"]

REVERSE_KERNEL_NAME = "adv_jax_math_matmul_tiles_reverse"


def tile_cotangents(
    sources: Sources,
    red: MonoidReduction,
    items: Sequence[Sequence[Any]],
    consts: list,
    xs: list,
    ys: list,
    layout: Layout,
    states: list,
    cts: list,
    tallies: list,
    pos: tuple[Sequence[int], Sequence[int], Sequence[int]],
) -> tuple[list, list, list, jax.Array]:
    """The cotangents of the constants, x and y leaves numbered in ``pos`` (``dc``
    summed, ``dx`` of every padded x row, ``dy`` of the y rows), and whether a max/min's
    selected pairs differ from its tally (the caller then spoils them with NaN).

    ``states``, ``cts`` (the result's float cotangents, None for integer parts) and
    ``tallies`` (``Monoid.tally``'s state with the shares, or None) are per term, each
    for every x tile as :func:`tile_states` gives them; ``items`` each term's items in
    a tile."""
    n, m = xs[0].shape[0], ys[0].shape[0]
    xt, ys, nxt, nyt = _tiled(xs, ys, layout.tiles)
    rows = (list(cts), list(states), list(tallies))
    if layout.on != "xla":
        run = lambda c, x, y, r: _reverse_kernel(
            sources, red, items, (n, m), pos, c, x, y, r, (nxt, nyt), layout
        )
        dc, dx, dy, counts = on_every_device(run, consts, xt, ys, rows)
    else:
        dc, dx, dy, counts = _reverse_loops(
            sources, red, items, (n, m), pos, consts, xt, ys, rows, nyt, layout.tiles[1]
        )
    wrong = jnp.asarray(False)
    tallied = [t for t in tallies if t is not None]
    for got, tally in zip(counts, tallied, strict=True):
        wrong = wrong | jnp.any((got != tally[2]) & (tally[3] > 0))
    dx = [d.reshape(-1, *d.shape[2:])[:n] for d in dx]
    return dc, dx, [d[:m] for d in dy], wrong


def _tile_cotangents(
    sources: Sources,
    red: MonoidReduction,
    items: Sequence[Sequence[Any]],
    sizes: tuple[int, int],
    pos: tuple[Sequence[int], Sequence[int], Sequence[int]],
    consts: list,
    x: list,
    row: tuple,
    y: list,
    starts: tuple[Any, Any],
    fast: bool,
) -> tuple:
    """The cotangents ``(dc, dx, dy)`` of one tile's constants, x rows and y rows (from
    rows ``starts`` on, of ``sizes`` real rows) numbered in ``pos``, and its selected
    counts."""
    pc, px, py = pos
    (n, m), (bi, bj) = sizes, (x[0].shape[0], y[0].shape[0])
    # the real rows, which the values' guards keep (``pairs.dots.guarded``)
    keep = ((starts[0], n), (starts[1], m)) if n % bi or m % bj else None
    put = lambda leaves, ks, vs: [
        dict(zip(ks, vs, strict=True)).get(k, a) for k, a in enumerate(leaves)
    ]
    f = lambda cn, xn, yn: sources(put(consts, pc, cn), put(x, px, xn), put(y, py, yn), keep)
    picked = ([consts[k] for k in pc], [x[k] for k in px], [y[k] for k in py])
    src, vjp = jax.vjp(f, *picked)
    if fast:  # the values as the forward folds read them (behind a barrier too)
        src = list(lax.optimization_barrier(src))
    cot: list = [None] * len(src)
    counts = []
    start = starts[1]
    for leaf, it, ct, state, tally in zip(red.leaves, items, *row, strict=True):
        reads = [src[s] for s in leaf.sources]
        j0 = start + lax.broadcasted_iota(jnp.int32, reads[0].shape, 0)
        keep = (j0 < m).astype(jnp.float32) if m % bj else None
        idx = j0.astype(index_dtype())
        got = leaf.monoid.cotangent(ct, reads, idx, keep, state, it, tally)
        for s, g in zip(leaf.sources, got, strict=True):
            if g is not None:
                cot[s] = g if cot[s] is None else cot[s] + g
        if tally is not None:
            hit = leaf.monoid.tally.selected(reads[0], idx, tally)
            counts.append(jnp.sum(hit if keep is None else hit * keep, axis=0))
    return (*vjp([cotangent_for(s, g) for s, g in zip(src, cot, strict=True)]), counts)


def _reverse_kernel(
    sources: Sources,
    red: MonoidReduction,
    items: Sequence[Sequence[Any]],
    sizes: tuple[int, int],
    pos: tuple,
    consts: list,
    xt: list,
    ys: list,
    rows: tuple,
    counts: tuple[int, int],
    layout: Layout,
) -> tuple:
    """:func:`tile_cotangents` as Pallas kernels: ``dx``, ``dc`` and the counts over the
    x tiles (each looping over the y tiles), ``dy`` over the y tiles (each looping over
    the x tiles): two kernels, as flash attention's backward; on a TPU one
    (:func:`_one_pass`). Sums in float32."""
    (bi, bj), (nxt, nyt) = layout.tiles, counts
    pc, px, py = pos
    xs = [a.reshape(nxt * bi, *a.shape[2:]) for a in xt]
    leaves, tree = jax.tree.flatten(rows, is_leaf=lambda a: a is None)
    nx = len(xs)

    def tile(c: list, x_side: list, y: list, at: tuple, want: tuple) -> tuple:
        """``(dc, dx, dy, counts)`` of a tile (``x_side``: its x rows, then their
        per-row states and cotangents), float sums in float32."""
        it = iter(x_side[nx:])
        row = jax.tree.unflatten(tree, [None if a is None else next(it) for a in leaves])
        args = (sources, red, items, sizes, want, c, x_side[:nx], row, y, at, False)
        return tuple(_wide(part) for part in _tile_cotangents(*args))

    run = lambda body, outer, inner, n, across=0: tile_kernel(
        body, _sum, consts, outer, inner, n, layout, REVERSE_KERNEL_NAME, across
    )
    x_side = [Tiled(a, bi) for a in xs] + [Tiled(a, None) for a in leaves if a is not None]
    y_side = [Tiled(a, bj) for a in ys]
    tallied = sum(t is not None for t in rows[2])
    if layout.on == "tpu" and py and (px or pc or tallied):
        both = (xs, ys, x_side, y_side, tallied)
        return _one_pass(tile, run, pos, consts, both, counts, layout.tiles)
    dc: list = []
    dx: list = []
    found: list = []
    if px or pc or tallied:

        def over_y(c: list, x: list, y: list, i: Any, t: Any) -> list:
            dcj, dxj, _, cj = tile(c, x, y, (i * bi, t * bj), (pc, px, ()))
            return [*dxj, *dcj, *cj]

        out = run(over_y, x_side, y_side, (nxt, nyt))
        dx = [d.astype(xs[k].dtype) for d, k in zip(out, px, strict=False)]
        dc = _const_sums(out[len(px) : len(px) + len(pc)], pc, consts)
        found = out[len(px) + len(pc) :]
    dy: list = []
    if py:
        over_x = lambda c, y, x, i, t: list(tile(c, x, y, (t * bi, i * bj), ((), (), py))[2])
        out = run(over_x, y_side, x_side, (nyt, nxt))
        dy = [d.reshape(-1, *d.shape[2:]).astype(ys[k].dtype) for d, k in zip(out, py, strict=True)]
    return dc, dx, dy, found


def _one_pass(
    tile: Callable,
    run: Callable,
    pos: tuple,
    consts: list,
    both: tuple,
    counts: tuple[int, int],
    tiles: tuple[int, int],
) -> tuple:
    """:func:`_reverse_kernel` on a TPU as one kernel: each tile's values and their
    cotangents made once, not once per kernel. Its outer tiles are those of the side
    with the more float32 cotangents; the other side's (and the counts, of the x rows)
    are whole arrays in VMEM across the grid (``tile_kernel``'s ``across``), on one
    TensorCore (both grid axes in order). On a TPU v5e, attention's
    ``value_and_grad`` (``bench/results/tpu_reverse.md``): at N = M = 16384, d = 64,
    4.6 ms in bfloat16 against 5.6 for two kernels and 4.4 for XLA's loops (float32:
    4.5, 4.7 for the loops); at 32768, d = 128, 15.7 against 22.2 for the loops."""
    xs, ys, x_side, y_side, tallied = both
    (bi, bj), (nxt, nyt), (pc, px, py) = tiles, counts, pos
    size = lambda arrays, ks: sum(arrays[k].size for k in ks)
    if size(ys, py) <= size(xs, px):  # x tiles outer, dy across them

        def x_outer(c: list, x: list, y: list, i: Any, t: Any) -> list:
            dcj, dxj, dyj, cj = tile(c, x, y, (i * bi, t * bj), pos)
            return [*dxj, *dcj, *cj, *dyj]

        out = run(x_outer, x_side, y_side, (nxt, nyt), len(py))
        dx, dc = out[: len(px)], out[len(px) : len(px) + len(pc)]
        found, dy = out[len(px) + len(pc) : len(out) - len(py)], out[len(out) - len(py) :]
    else:  # y tiles outer, dx and the counts across them

        def y_outer(c: list, y: list, x: list, i: Any, t: Any) -> list:
            dcj, dxj, dyj, cj = tile(c, x, y, (t * bi, i * bj), pos)
            return [*dyj, *dcj, *dxj, *cj]

        out = run(y_outer, y_side, x_side, (nyt, nxt), len(px) + tallied)
        dy = [d.reshape(-1, *d.shape[2:]) for d in out[: len(py)]]
        dc = out[len(py) : len(py) + len(pc)]
        per_x = [d.reshape(nxt, bi, *d.shape[1:]) for d in out[len(py) + len(pc) :]]
        dx, found = per_x[: len(px)], per_x[len(px) :]
    dx = [d.astype(xs[k].dtype) for d, k in zip(dx, px, strict=True)]
    dy = [d.astype(ys[k].dtype) for d, k in zip(dy, py, strict=True)]
    return _const_sums(dc, pc, consts), dx, dy, found


def _const_sums(parts: list, pc: Sequence[int], consts: list) -> list:
    """The constants' cotangents from one part per outer tile."""
    dtype = lambda k: jnp.result_type(consts[k])
    return [jnp.sum(d, 0).astype(dtype(k)) for d, k in zip(parts, pc, strict=True)]


def _wide(values: Sequence[Any]) -> list:
    inexact = lambda v: jnp.issubdtype(v.dtype, jnp.inexact)
    return [v.astype(jnp.float32) if inexact(v) else v for v in values]


def _reverse_loops(
    sources: Sources,
    red: MonoidReduction,
    items: Sequence[Sequence[Any]],
    sizes: tuple[int, int],
    pos: tuple,
    consts: list,
    xt: list,
    ys: list,
    rows: tuple,
    nyt: int,
    bj: int,
) -> tuple:
    """:func:`tile_cotangents` in XLA's loops: a scan over the x tiles, each a loop
    over the y tiles."""
    pc, _, py = pos

    bi = xt[0].shape[1]

    def per_x(carry: tuple, args: tuple) -> tuple:
        dc, dy = carry
        x, row, i = args
        pair_tile = lambda x, row, j: _tile_cotangents(
            sources,
            red,
            items,
            sizes,
            pos,
            consts,
            x,
            row,
            _rows(ys, j, bj),
            (i * bi, j * bj),
            True,
        )

        def step(j: Any, acc: tuple) -> tuple:
            dx, dc, dy, counts = acc
            dcj, dxj, dyj, cj = pair_tile(x, row, j)
            add = lambda a, b: lax.dynamic_update_slice_in_dim(
                a, lax.dynamic_slice_in_dim(a, j * bj, bj) + b, j * bj, 0
            )
            return (
                _sum(dx, dxj),
                _sum(dc, dcj),
                [add(a, b) for a, b in zip(dy, dyj, strict=True)],
                _sum(counts, cj),
            )

        dc0, dx0, dy0, c0 = pair_tile(x, row, 0)
        first = (dx0, _sum(dc, dc0), [a.at[:bj].add(b) for a, b in zip(dy, dy0, strict=True)], c0)
        dx, dc, dy, counts = lax.fori_loop(1, nyt, step, first) if nyt > 1 else first
        return (dc, dy), (dx, counts)

    dc0 = [jnp.zeros(jnp.shape(consts[k]), jnp.result_type(consts[k])) for k in pc]
    dy0 = [jnp.zeros_like(ys[k]) for k in py]
    dx: list
    counts: list
    xs = (xt, rows, jnp.arange(xt[0].shape[0]))
    (dc, dy), (dx, counts) = lax.scan(per_x, (dc0, dy0), xs)
    return dc, dx, dy, counts
