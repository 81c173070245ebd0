"""Pairwise reductions as matmul tiles, in plain XLA (the CPU engine).

A tile of ``bi`` x rows by ``bj`` y rows is one chunk of a monoid reduction over its
y rows whose items are its x rows: ``sources(consts, xt, yt)`` gives each value of
``f`` on the tile rows (y) first, ``(bj, bi, *t)`` per pair or ``(bj, *v)`` per y
row, and each term's monoid folds and merges them as over any chunk. ``f``'s dot
products over a tile are then one matmul (XLA's dot), and so are a softmax-weighted
sum's ``P @ V`` and, in the reverse pass, its ``P^T @ dO`` and ``dO @ V^T``.

* :func:`tile_states`: each term's state for every x tile (a loop over the x tiles,
  each a loop over the y tiles);
* :func:`tile_cotangents`: the reverse pass: per tile, each term's
  ``Monoid.cotangent`` of the values from the final states (flash attention's
  recipe for every monoid), then one VJP of ``sources`` for the tile's x rows, y rows
  and constants: nothing ``N x M`` stored.

x and y are padded to whole tiles with copies of their last row; padded y rows are
filled and weighted out (``Monoid.without``), padded x rows' results dropped by the
caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core.linear import cotangent_for
from ..monoids.base import index_dtype
from ..monoids.reduction import MonoidReduction
from .pairwise import _pad_rows

__all__ = ["tile_cotangents", "tile_states"]

Sources = Callable[[list, list, list], list]  # (consts, x tile leaves, y tile leaves)


def _tiled(xs: list, ys: list, tiles: tuple[int, int]) -> tuple[list, list, int, int]:
    """x leaves as ``(x tiles, bi, ...)``, y leaves padded to whole tiles; the counts."""
    bi, bj = tiles
    nxt, nyt = -(-xs[0].shape[0] // bi), -(-ys[0].shape[0] // bj)
    xt = [_pad_rows(a, nxt * bi).reshape(nxt, bi, *a.shape[1:]) for a in xs]
    return xt, [_pad_rows(a, nyt * bj) for a in ys], nxt, nyt


def _rows(ys: list, j: Any, bj: int) -> list:
    return [lax.dynamic_slice_in_dim(a, j * bj, bj) for a in ys]


def tile_states(
    sources: Sources,
    red: MonoidReduction,
    consts: list,
    xs: list,
    ys: list,
    tiles: tuple[int, int],
) -> list:
    """Each term's state for every x tile (leading axis: the x tiles; the tile's x
    rows where its items put them)."""
    bj, m = tiles[1], ys[0].shape[0]
    xt, ys, _, nyt = _tiled(xs, ys, tiles)

    def fold(x: list, j: Any) -> list:
        # the values computed once, as the reverse pass reads them (behind a barrier)
        src = list(lax.optimization_barrier(sources(consts, x, _rows(ys, j, bj))))
        j0 = j * bj + lax.iota(jnp.int32, bj)
        idx, out = j0.astype(index_dtype()), []
        for leaf in red.leaves:
            reads, w = [src[s] for s in leaf.sources], None
            if m % bj:
                keep = j0 < m
                kept = lambda a, keep=keep: keep.reshape((bj,) + (1,) * (a.ndim - 1))
                reads, w = leaf.monoid.without(reads, kept, keep)
            out.append(leaf.fold(reads, idx, w, fast=True))
        return out

    def per_x(x: list) -> list:
        acc = fold(x, 0)
        step = lambda j, acc: red.merge_states(acc, fold(x, j))
        return lax.fori_loop(1, nyt, step, acc) if nyt > 1 else acc

    return lax.map(per_x, xt)


def tile_cotangents(
    sources: Sources,
    red: MonoidReduction,
    items: Sequence[Sequence[Any]],
    consts: list,
    xs: list,
    ys: list,
    tiles: tuple[int, int],
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
    bj, m = tiles[1], ys[0].shape[0]
    xt, ys, _, nyt = _tiled(xs, ys, tiles)
    pc, px, py = pos
    put = lambda leaves, ks, vs: [
        dict(zip(ks, vs, strict=True)).get(k, a) for k, a in enumerate(leaves)
    ]

    def pair_tile(x: list, row: tuple, j: Any) -> tuple:
        """The cotangents of one tile and its selected counts."""
        y = _rows(ys, j, bj)
        f = lambda cn, xn, yn: sources(put(consts, pc, cn), put(x, px, xn), put(y, py, yn))
        picked = ([consts[k] for k in pc], [x[k] for k in px], [y[k] for k in py])
        src, vjp = jax.vjp(f, *picked)
        src = list(lax.optimization_barrier(src))
        cot: list = [None] * len(src)
        counts = []
        for leaf, it, ct, state, tally in zip(red.leaves, items, *row, strict=True):
            reads = [src[s] for s in leaf.sources]
            j0 = j * bj + lax.broadcasted_iota(jnp.int32, reads[0].shape, 0)
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

    def per_x(carry: tuple, args: tuple) -> tuple:
        dc, dy = carry
        x, row = args

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
    rows = (list(cts), list(states), list(tallies))
    dx: list
    counts: list
    (dc, dy), (dx, counts) = lax.scan(per_x, (dc0, dy0), (xt, rows))
    wrong = jnp.asarray(False)
    tallied = [t for t in tallies if t is not None]
    for got, tally in zip(counts, tallied, strict=True):
        wrong = wrong | jnp.any((got != tally[2]) & (tally[3] > 0))
    n = xs[0].shape[0]
    dx = [d.reshape(-1, *d.shape[2:])[:n] for d in dx]
    return dc, dx, [d[:m] for d in dy], wrong


def _sum(a: list, b: list) -> list:
    return [u + v for u, v in zip(a, b, strict=True)]
