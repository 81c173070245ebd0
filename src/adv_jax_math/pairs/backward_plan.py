"""How a pairwise reduction's derivatives run, and what reverse mode holds: the
``gradient`` and ``grad memory`` lines of :func:`~adv_jax_math.explain_pairwise`'s
plan (:func:`described`), as ``explain()``'s ``gradient`` line says it for
``batch_map``.

* ``pairwise scan`` (and ``shard="y"``'s chunks): JAX transposes the scan's loops,
  each tile recomputed (``jax.checkpoint``) and ``f``'s VJP taken on all its pairs at
  once: a tile's per-pair values are arrays of ``(bi, bj, W)``;
* the kernel engines (``pairwise tiles (xla)``, ``pairwise kernel (...)``): pairwise
  sums on the same kernel (``pairs.grad``): ``dx`` over the x tiles, ``dy`` over the y
  tiles (``pairs.tiles.reverse``), ``f`` and its VJP recomputed per tile; on a GPU or
  TPU the tiles live in registers or VMEM, in XLA's loops (the CPU) in memory;
* the matmul tiles: per tile, each term's cotangents from the final states, then one
  VJP for the tile's rows (``kernels/matmul_tiles.py``): XLA's loops, or on a GPU two
  kernels, on a TPU one;
* forward mode: the scan engine's tangent (the kernel engines), or JAX's ``jvp`` of
  the scan's loops.

The memory is an estimate, in two parts: the tiles, ``bi * bj`` pairs of ``W + 2 R``
values each (``W``: the most elements of one value ``f`` makes per pair, from its
jaxpr, or what the matmul tiles make of it; ``R``: the values per pair the reduction
reads, each with its cotangent),
where they are in memory; and the rows: each x row's features, saved state and
result cotangent, each y row's features. On XLA:CPU the compiled
``temp_size_in_bytes`` of ``jax.grad`` was 0.4-1.8x this estimate for elementwise
``f`` on the CPU engines (``pairwise tiles (xla)``, ``pairwise scan``, the matmul
tiles; N = M = 2048 to 16384, D = 3 to 64, tiles from 32 x 512 to 128 x 2048, sums,
logsumexp, min-argmin, top-k, softmax-weighted sums; the tests check a factor of 3);
an ``f`` whose VJP keeps more per pair holds several such tiles (a sort over 8
features: 4.7x). On a GPU or TPU the tile kernels' tiles are in registers or VMEM:
only the rows are counted (not measured on a device).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ..analysis.jaxpr_graph import deps, graph
from ..core.sharding import context_mesh
from ..kernels.pairwise_device import Layout
from ..monoids.reduction import MonoidReduction
from ..plan.measure import fmt_bytes
from . import tiles as _tiles
from .dots import pair_jaxpr
from .kernel import state_width
from .matmul import pair_width
from .spread import local_rows

__all__ = ["described", "estimate", "per_pair"]

P = TypeVar("P")

_KERNELS = {
    "gpu": "Pallas Triton kernels",
    "mosaic_gpu": "Mosaic GPU kernels",
    "tpu": "Mosaic TPU kernels",
    "xla": "XLA's loops",
}


def per_pair(f: Callable, x: Any, y: Any, red: MonoidReduction) -> tuple[int, int, int]:
    """Per pair: the most elements of one value that ``f`` (then the reduction's
    prologue) makes (a value reading both rows: ``x_i - y_j`` over ``D`` features:
    ``D``; 1 where every such value is a scalar), the elements the reduction reads
    that read both rows (a softmax-weighted sum's score, its values where they
    depend on the x row too), and the bytes of an
    element of the widest value."""
    closed = pair_jaxpr(lambda c, xi, yj: red.prologue(f(xi, yj)), [], x, y)
    nx = len(jax.tree.leaves(x))
    both = lambda node: (
        node.name not in ("in", "lit", "const")
        and any(k < nx for k in deps(node))
        and any(k >= nx for k in deps(node))
    )
    _, outs, nodes = graph(closed)
    widest, item = 1, 4
    for node in filter(both, nodes):
        if (size := math.prod(node.aval.shape)) > widest:
            widest, item = size, np.dtype(node.aval.dtype).itemsize
    # (a value of one row only, attention's v_j, is not made per pair)
    read = sum(math.prod(node.aval.shape) for node in filter(both, outs))
    return widest, max(read, 1), max(item, 1)


def _row_bytes(tree: Any) -> int:
    return sum(
        math.prod(jnp.shape(a)[1:]) * np.dtype(jnp.result_type(a)).itemsize
        for a in jax.tree.leaves(tree)
    )


def estimate(
    f: Callable,
    x: Any,
    y: Any,
    red: MonoidReduction,
    tiles: tuple[int, int],
    n: int,
    in_memory: bool = True,
    width: int | None = None,
) -> tuple[int, int, int, int]:
    """Reverse mode's bytes, estimated: ``(tile, rows, W, R)``: a tile of ``tiles``
    pairs with ``W + 2 R`` values each (0 where the tiles are not ``in_memory``:
    registers, VMEM), ``W`` the widest per-pair value (:func:`per_pair`, or ``width``),
    ``R`` the values per pair the reduction reads (each with its cotangent); and the
    rows (``n`` x rows): each x row's features, state and result cotangent, each y
    row's features."""
    widest, read, item = per_pair(f, x, y, red)
    w = widest if width is None else width
    bi, bj = tiles
    tile = bi * bj * (w + 2 * read) * max(item, 4) if in_memory else 0
    m = jax.tree.leaves(y)[0].shape[0]
    state = state_width(f, x, y, red) * 4
    out = sum(
        math.prod(a.shape) * np.dtype(a.dtype).itemsize
        for leaf in red.leaves
        for a in jax.tree.leaves(leaf.out)
    )
    rows = n * (_row_bytes(x) + state + out) + m * _row_bytes(y)
    return tile, rows, w, read


def _memory(
    tile: int, rows: int, w: int, read: int, tiles: tuple[int, int], where: str = "memory"
) -> str:
    bi, bj = tiles
    rows_text = (
        "per-row values, O(N + M): each x row's features, saved state and result "
        "cotangent, each y row's features"
    )
    if not tile:
        return (
            f"about {fmt_bytes(rows)} (estimated): {rows_text}; a tile's per-pair values "
            f"stay in {where}, never in device memory"
        )
    rows_text += f", {fmt_bytes(rows)}"
    return (
        f"about {fmt_bytes(tile + rows)} (estimated): a tile's per-pair values, "
        f"O(bi * bj * W): ({bi}, {bj}, {w}), f's widest value per pair, and {2 * read} more "
        f"per pair (the {read} the reduction reads, their cotangents), {fmt_bytes(tile)}; "
        f"{rows_text}"
    )


def described(
    plan: P,
    red: MonoidReduction,
    layout: Layout | None,
    f: Callable,
    x: Any,
    y: Any,
    shard: bool | str = False,
) -> P:
    """``plan`` (a ``PairwisePlan``) with its ``backward`` and ``memory`` lines: how
    reverse and forward mode run on its engine, at which tiles, and what reverse mode
    holds."""
    p: Any = plan
    n, m, tiles, engine = p.n, p.m, tuple(p.tiles), p.engine
    if not (n and m):
        back, memory = "no pairs (N or M is 0): every cotangent zero", "none"
        return dataclasses.replace(p, backward=back, memory=memory)
    if shard in (True, "x") and context_mesh() is None:
        n = local_rows(n, None)  # a device's share of the x rows
    on_each = " (on each device, for its x rows)" if shard in (True, "x") else ""
    bi, bj = tiles
    if engine.startswith("pairwise scan"):
        chunk = f"each tile of {bi} x {bj} pairs"
        if shard == "y":
            chunk = f"on each device, each chunk of {bj} y rows by all {bi} x rows"
        back = (
            f"reverse mode: JAX's transpose of the scan's loops{on_each}, {chunk} recomputed "
            f"(jax.checkpoint) and f's VJP taken on its pairs at once; forward mode: "
            f"jax.jvp of the same loops"
        )
        return dataclasses.replace(p, backward=back, memory=_memory(*_est(p, red, f, x, y, n)))
    tangent = f"; forward mode: the scan engine's tangent at {bi} x {bj}"
    if layout is not None and layout.kind == "matmul":
        return _matmul(p, red, layout, f, x, y, n, on_each, tangent)
    kind = None if layout is None else layout.kind
    across_x, across_y = _tiles.reverse(kind, (bi, bj))
    tallied = any(leaf.monoid.tally is not None for leaf in red.leaves)
    how = _KERNELS.get(kind or "", "the interpret kernel")
    interpreted = layout is None or layout.interpret
    if interpreted and layout is not None:
        how += ", interpreted"
    back = (
        f"reverse mode: pairwise sums on the same engine{on_each} ({how}), recomputing f and "
        f"its VJP per tile (nothing N x M stored): dx (and the closed-over values') over "
        f"the x tiles at {across_x[0]} x {across_x[1]}, dy over the y tiles at "
        f"{across_y[0]} x {across_y[1]}"
        + (" (the tied pairs tallied first)" if tallied else "")
        + tangent
    )
    in_memory = kind == "xla" or interpreted
    est = _est(p, red, f, x, y, n, in_memory=in_memory)
    memory = _memory(*est, "VMEM" if kind == "tpu" else "registers or shared memory")
    return dataclasses.replace(p, backward=back, memory=memory)


def _est(
    p: Any, red: MonoidReduction, f: Callable, x: Any, y: Any, n: int, **kw: Any
) -> tuple[int, int, int, int, tuple[int, int]]:
    return (*estimate(f, x, y, red, tuple(p.tiles), n, **kw), tuple(p.tiles))


def _matmul(
    p: Any,
    red: MonoidReduction,
    layout: Layout,
    f: Callable,
    x: Any,
    y: Any,
    n: int,
    on_each: str,
    tangent: str,
) -> Any:
    """The lines of the matmul tiles (CPU) and the matmul tile kernel (GPU, TPU)."""
    bi, bj = p.tiles
    width = pair_width(f, x, y, red)
    per_tile = (
        f"per tile of {bi} x {bj} pairs, each term's cotangents of f's values from the final "
        "states, then one VJP for the tile's x rows, y rows and closed-over values"
    )
    spills = ", first with no register spilled" if layout.on == "gpu" else ""
    probed = (
        f"at the largest of {bi} x {bj} down to a quarter that compiles{spills} (probed "
        "when the gradient is traced), else XLA's loops"
    )
    kernels = layout.on in ("gpu", "tpu") and layout.target is not None
    if kernels and layout.on == "gpu":
        where = f"two kernels (dx over the x tiles, dy over the y tiles) {probed}"
    elif kernels:
        where = (
            "one kernel (over the tiles of the side with the more cotangents, each over "
            f"the other side's tiles, whose cotangents stay whole in VMEM) {probed}"
        )
    elif layout.on != "xla":
        where = f"the {layout.on} matmul tile kernels, interpreted, at {bi} x {bj}"
    else:
        where = "XLA's loops, over the x tiles, each over the y tiles"
    back = f"reverse mode{on_each}: {per_tile}: {where}{tangent}"
    tile, rows, w, read = estimate(f, x, y, red, (bi, bj), n, width=width)
    held = "registers or shared memory" if layout.on == "gpu" else "VMEM"
    memory = _memory(0 if kernels else tile, rows, w, read, (bi, bj), held)
    if kernels:
        memory += f"; where XLA's loops run it instead, {fmt_bytes(tile)} more: a tile's values"
    return dataclasses.replace(p, backward=back, memory=memory)
