"""The pairwise kernel for GPUs and TPUs (and its loops in plain XLA for CPUs):
pairs as 2-D tiles, features unrolled.

``out_i = reduce_j f(x_i, y_j)`` on tiles of ``bj x bi`` pairs: ``y`` rows down the
tile (sublanes on TPU), ``x`` rows across it (lanes). Each feature of ``x`` is a row
vector ``(1, bi)``, each feature of ``y`` a column ``(bj, 1)``; ``f`` runs on them with
its own axes unrolled (``unrolled.evaluate``), so every value in the kernel is 2-D:
powers of two on Triton, lane-dense on Mosaic, whatever the number of features.
Each term's monoid folds the ``bj`` rows of a tile into one state per ``x`` row
(items of shape ``(bi,)``), merged across the ``y`` tiles:

* ``"gpu"``: a program per ``x`` tile, a loop over the ``y`` tiles inside (``y`` read
  from global memory), the states in registers;
* ``"tpu"``: a grid ``(x tiles "parallel", y tiles "arbitrary")``, the states in the
  output block, which stays in VMEM across the ``y`` tiles (set at the first,
  merged into at the others); ``y`` stored lane-dense, each tile's row turned into
  a column in the kernel (a column in HBM would take 128 lanes per row);
* ``"mosaic_gpu"``: the ``"gpu"`` loops on Pallas Mosaic GPU, every value a whole tile
  in its layout (``pairwise_mosaic_gpu``);
* ``"xla"``: the ``"gpu"`` loops in plain XLA, no Pallas (the CPU engine: XLA:CPU
  vectorizes the tiles, where ``f``'s small feature axes as the minor axis it does not);
  each tile folded into the states before (``Monoid.fold_into``), a top-k's by the
  native kernel (k-NN top-10, 4096 x 1e5 points: 0.78 -> 0.18 s at D = 3, 1.04 -> 0.36
  s at D = 16, against each tile's ``lax.top_k`` and a merge).

Both run in interpret mode on CPU (tests). A vector per pair is folded one element
per tile (a softmax-weighted sum: each score with each value), the states joined
after the loops. :class:`unrolled.NotUnrolled` says what is not taken.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..monoids.base import index_dtype
from ..monoids.reduction import MonoidReduction
from ..monoids.softmax import SoftmaxWeighted
from .fused_reduce.kernel import named_jit
from .native import topk_fold, usable
from .pairwise import _pad_rows
from .pairwise_mosaic_gpu import mosaic_gpu_tiles, tile_ops
from .unrolled import NotUnrolled, evaluate, objects

__all__ = ["DEVICE_KERNEL_NAME", "Layout", "device_states"]

DEVICE_KERNEL_NAME = "adv_jax_math_pairwise_tiles"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the kernel is built: ``kind`` (``"gpu"``: Pallas Triton, ``"mosaic_gpu"``:
    ``kernels/pairwise_mosaic_gpu.py``, ``"tpu"``, ``"xla"``; ``"matmul"``:
    ``kernels/matmul_tiles.py``), tiles ``(bi, bj)``, ``interpret`` on CPU, the
    compiler parameters (None in interpret mode and for ``"xla"``), and for
    ``"matmul"`` which of ``f``'s values stay one per y row (``per_y``), where its
    loops run (``on``: ``"xla"``, or a Pallas kernel for ``"gpu"`` or ``"tpu"``) and
    the device kind its kernels were compiled for (``target``; None: interpreted)."""

    kind: str
    tiles: tuple[int, int]
    interpret: bool = False
    params: Any = None
    per_y: tuple[bool, ...] = ()
    on: str = "xla"
    target: Any = None


def device_states(
    jaxpr: Any, red: MonoidReduction, consts: Sequence[Any], xs: list, ys: list, layout: Layout
) -> list:
    """Each term's state for every x row (leading axis ``N``): ``jaxpr`` is ``f`` on
    one pair followed by the prologue (each output one value per pair), ``consts`` the
    values of its constants then of its leading arguments (values ``f`` closes over),
    then come one row of each leaf of ``xs`` and of ``ys``."""
    bi, bj = layout.tiles
    n, m = xs[0].shape[0], ys[0].shape[0]
    xt, yt = pl.cdiv(n, bi), pl.cdiv(m, bj)
    fast = layout.kind == "xla"  # not in a kernel: the monoids' fast folds
    # x features as rows (1, N'), y features as columns (M', 1); N', M' whole tiles
    # (copies of the last row: f sees real rows only; padded y rows are filled below).
    x_rows = [r[None] for a in xs for r in _pad_rows(a, xt * bi).reshape(xt * bi, -1).T]
    y_cols = [c[:, None] for a in ys for c in _pad_rows(a, yt * bj).reshape(yt * bj, -1).T]
    flat_consts = [jnp.asarray(c).reshape(-1) for c in consts]
    x_shapes = [a.shape[1:] for a in xs]
    y_shapes = [a.shape[1:] for a in ys]
    c_shapes = [np.shape(c) for c in consts]

    native = topk_fold if fast and usable() else None  # TopK.fold_into, on the CPU
    mosaic_gpu = layout.kind == "mosaic_gpu"
    iota: Any = lax.broadcasted_iota
    tile2d = lambda e: jnp.broadcast_to(jnp.asarray(e), (bj, bi))
    if mosaic_gpu:  # (every value a whole tile, in its layout)
        iota, tile2d = tile_ops((bj, bi))

    def tile(c_vals: list, x_vals: list, y_vals: list, start: Any, acc: Any = None) -> list:
        """Each term's state over one tile (items: the tile's x rows), folded into
        ``acc`` (the tiles' before, outside kernels) if given."""
        objs = []
        for shapes, vals in ((c_shapes, c_vals), (x_shapes, x_vals), (y_shapes, y_vals)):
            at = 0
            for shape in shapes:
                k = _size_of(shape)
                objs.append(objects(vals[at : at + k], shape))
                at += k
        own = len(jaxpr.constvars)
        # object arrays of 2-D values (barriers held in plain XLA and interpret mode)
        values = evaluate(jaxpr, objs[:own], objs[own:], fast or layout.interpret)
        if fast:
            j = start + jnp.arange(bj, dtype=jnp.int32)
            keep = j < m
            kept = lambda a: keep.reshape(bj, *(1,) * (a.ndim - 1))
        else:
            j = start + iota(jnp.int32, (bj, bi), 0)
            keep = j < m  # the tile's full shape: no row vector made a column
            kept = lambda a: keep

        def fold(leaf: Any, src: list, whole: bool, into: Any) -> Any:
            w = None
            if m % bj or whole:
                src, w = leaf.monoid.without(src, kept, keep)
            if layout.interpret:  # once, as in a kernel (see fused_reduce.fold.term_state)
                src = list(lax.optimization_barrier(src))
            return leaf.fold_into(into, src, j.astype(index_dtype()), w, native, fast)

        # per term: one state per element of its values per pair (2-D tiles)
        terms = [_elements(leaf, [values[s] for s in leaf.sources]) for leaf in red.leaves]
        # On the CPU tiles, several folds of a tile are masked on whole tiles too:
        # unmasked, XLA:CPU fuses the values they share into each fold's reduction.
        # N-body's field (256 x rows, M = 8192): 5.2 -> 3.1 ms and 7.2 -> 4.2 MiB, its
        # gradient 12.0 -> 6.5 ms; a kernel sum of a 2-vector: 64 -> 73 ms, its
        # gradient 113 -> 101 ms. One fold (a scalar kernel sum): no gain, unmasked.
        whole = fast and sum(len(elements) for _, elements in terms) > 1
        into = acc if acc is not None else [[None] * len(e) for _, e in terms]
        return [
            [fold(part, [tile2d(e) for e in es], whole, a) for es, a in zip(ee, aa, strict=True)]
            for (part, ee), aa in zip(terms, into, strict=True)
        ]

    # out of a kernel (the CPU loops), the monoids' fast merges
    join = lambda monoid: monoid.merge_fast if fast else monoid.merge

    def merge(a: list, b: list) -> list:
        return [
            [join(leaf.monoid)(p, q) for p, q in zip(u, v, strict=True)]
            for leaf, u, v in zip(red.leaves, a, b, strict=True)
        ]

    def joined(states: list) -> list:
        """Each term's state: its elements' states joined (see ``_elements``)."""
        shapes = [
            tuple(jaxpr.outvars[s].aval.shape for s in leaf.sources)
            if _softmax(leaf)
            else jaxpr.outvars[leaf.sources[-1]].aval.shape
            for leaf in red.leaves
        ]
        return [
            _join(leaf, s, shape) for leaf, s, shape in zip(red.leaves, states, shapes, strict=True)
        ]

    c_avals = [jax.ShapeDtypeStruct((), c.dtype) for c in flat_consts for _ in range(c.size)]
    row_states = jax.eval_shape(
        lambda: tile(
            [jnp.zeros((), a.dtype) for a in c_avals],
            [jnp.zeros((1, bi), a.dtype) for a in x_rows],
            [jnp.zeros((bj, 1), a.dtype) for a in y_cols],
            0,
        )
    )
    leaves, treedef = jax.tree.flatten(row_states)
    out_shape = [jax.ShapeDtypeStruct((1, xt * bi), s.dtype) for s in leaves]
    nc, nx = len(flat_consts), len(x_rows)

    def scalars(refs: Sequence[Any]) -> list:
        return [r[k] for r in refs for k in range(r.shape[0])]

    def write(o_refs: Sequence[Any], states: list) -> None:
        for o, s in zip(o_refs, jax.tree.leaves(states), strict=True):
            o[...] = s.reshape(1, bi).astype(o.dtype)

    if fast:
        flat = _xla(tile, flat_consts, x_rows, y_cols, layout.tiles, (xt, yt))
        return joined(jax.tree.unflatten(treedef, [o[:n] for o in flat]))
    if mosaic_gpu:
        flat = mosaic_gpu_tiles(
            tile,
            merge,
            flat_consts,
            [r[0] for r in x_rows],
            [c[:, 0] for c in y_cols],
            layout.tiles,
            (xt, yt),
            leaves,
            treedef,
            layout.interpret,
            DEVICE_KERNEL_NAME,
        )
        return joined(jax.tree.unflatten(treedef, [o[:n] for o in flat]))
    if layout.kind == "gpu":

        def kernel(*refs: Any) -> None:
            c_refs, x_refs, y_refs = refs[:nc], refs[nc : nc + nx], refs[nc + nx : -len(leaves)]
            c_vals, x_vals = scalars(c_refs), [r[...] for r in x_refs]
            at = lambda t: tile(c_vals, x_vals, [r[pl.ds(t * bj, bj), :] for r in y_refs], t * bj)
            states = lax.fori_loop(1, yt, lambda t, s: merge(s, at(t)), at(0)) if yt > 1 else at(0)
            write(refs[-len(leaves) :], states)

        grid: tuple[int, ...] = (xt,)
        whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)
        in_specs = [whole(c) for c in flat_consts]
        in_specs += [pl.BlockSpec((1, bi), lambda i: (0, i)) for _ in x_rows]
        in_specs += [whole(c) for c in y_cols]
        out_specs = [pl.BlockSpec((1, bi), lambda i: (0, i)) for _ in leaves]
    else:

        def kernel(*refs: Any) -> None:
            c_refs, x_refs, y_refs = refs[:nc], refs[nc : nc + nx], refs[nc + nx : -len(leaves)]
            o_refs, t = refs[-len(leaves) :], pl.program_id(1)
            y_vals = [_column(r[...]) for r in y_refs]
            new = tile(scalars(c_refs), [r[...] for r in x_refs], y_vals, t * bj)

            @pl.when(t == 0)
            def _first() -> None:
                write(o_refs, new)

            @pl.when(t > 0)
            def _next() -> None:
                old = jax.tree.unflatten(treedef, [o[...].reshape(bi) for o in o_refs])
                write(o_refs, merge(old, new))

        grid = (xt, yt)
        smem = _smem(layout.interpret)
        in_specs = [
            pl.BlockSpec(memory_space=smem) if smem else pl.BlockSpec(c.shape, lambda i, t: (0,))
            for c in flat_consts
        ]
        in_specs += [pl.BlockSpec((1, bi), lambda i, t: (0, i)) for _ in x_rows]
        # y lane-dense in memory, a row (1, bj) per tile, made a column in the kernel:
        # a column (M, 1) would take 128 lanes per row of HBM
        y_cols = [c.reshape(yt, 1, bj) for c in y_cols]
        in_specs += [pl.BlockSpec((None, 1, bj), lambda i, t: (t, 0, 0)) for _ in y_cols]
        out_specs = [pl.BlockSpec((1, bi), lambda i, t: (0, i)) for _ in leaves]

    call = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=layout.interpret,
        compiler_params=layout.params,
        name=DEVICE_KERNEL_NAME,
    )
    flat = named_jit(call, DEVICE_KERNEL_NAME)(*flat_consts, *x_rows, *y_cols)
    return joined(jax.tree.unflatten(treedef, [o[0, :n] for o in flat]))


def _xla(
    tile: Any,
    consts: list,
    x_rows: list,
    y_cols: list,
    tiles: tuple[int, int],
    counts: tuple[int, int],
) -> list:
    """The GPU kernel's loops in plain XLA (CPU): a loop over the x tiles, each a loop
    over the y tiles folding each into the states (``tile``'s ``acc``); every value a
    ``bj x bi`` tile, x rows on the minor axis, reduced over the major one (XLA:CPU
    vectorizes both)."""
    (bi, bj), (xt, yt) = tiles, counts
    c_vals = [c[k] for c in consts for k in range(c.shape[0])]
    ys = [c.reshape(yt, bj, 1) for c in y_cols]
    rest = [c[1:] for c in ys]
    starts = bj * jnp.arange(1, yt, dtype=jnp.int32)  # (x or y may have no features)

    def per_x(x_vals: list) -> list:
        first = tile(c_vals, x_vals, [c[0] for c in ys], 0)
        # the other tiles after the first (with two tiles, XLA inlines the loop of one
        # step and would hold both tiles' values at once)
        first, after = lax.optimization_barrier((first, starts))
        step = lambda s, t: (tile(c_vals, x_vals, t[1], t[0], s), None)
        return lax.scan(step, first, (after, rest))[0]

    rows = [r.reshape(xt, 1, bi) for r in x_rows]
    states = lax.map(lambda a: per_x(a[1]), (jnp.arange(xt), rows))
    return [s.reshape(-1, *s.shape[2:]) for s in jax.tree.leaves(states)]


def _size_of(shape: tuple) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _softmax(leaf: Any) -> bool:
    return isinstance(leaf.monoid, SoftmaxWeighted)


def _elements(leaf: Any, objs: Sequence[np.ndarray]) -> tuple[Any, list[tuple]]:
    """A term as folds of one value per pair each: the term to fold them with, and
    each fold's sources. A vector per pair is folded element by element, each on its
    own 2-D tile (stacked, its axis would be the tile's minor one again); a
    softmax-weighted sum once per score and value (each fold one score and one value:
    the maxima and norms of one score's folds are the same computation)."""
    if leaf.axis != 0:
        raise NotUnrolled(f"a term reduces every axis ({leaf}), not the pairs'")
    if _softmax(leaf):  # every score with every value (of its own heads), scores first
        scores, values = objs
        paired = dataclasses.replace(leaf, monoid=leaf.monoid.paired())
        heads = _size_of(values.shape[: leaf.monoid.heads])
        own = values.reshape(heads, -1)  # each head's values
        pairs = [(s, v) for i, s in enumerate(scores.reshape(-1)) for v in own[i % heads]]
        return paired, pairs
    if any(o.shape != objs[0].shape for o in objs):
        raise NotUnrolled(f"a term reads values of shapes {[o.shape for o in objs]}")
    return leaf, list(zip(*(o.reshape(-1) for o in objs), strict=True))


def _join(leaf: Any, parts: list, shape: tuple) -> Any:
    """A term's state, from the states of its elements (``_elements``) for every x
    row (leading axis ``N``): stacked after the rows, as the values per pair are
    (a softmax-weighted sum's maxima and norms taken once, its sums stacked)."""
    stacked = lambda shape, *p: jnp.stack(p, 1).reshape(p[0].shape[0], *shape)
    if _softmax(leaf):  # parts: scores by values; maxima and norms once per score
        s_shape, v_shape = shape[0], shape[1][leaf.monoid.heads :]
        k = _size_of(v_shape)
        per_score = [stacked(s_shape, *(p[i] for p in parts[::k])) for i in range(3)]
        sums = [stacked((*s_shape, *v_shape), *(p[i] for p in parts)) for i in (3, 4)]
        return (*per_score, *sums)
    return jax.tree.map(lambda *p: stacked((*shape, *p[0].shape[1:]), *p), *parts)


def _column(row: jax.Array) -> jax.Array:
    """A row ``(1, n)`` as a column ``(n, 1)``: a transpose of 8 sublanes (Mosaic's
    smallest), its first column kept."""
    return jnp.broadcast_to(row, (8, row.shape[1])).T[:, :1]


def _smem(interpret: bool) -> Any:
    if interpret:
        return None
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.SMEM
