"""The matmul tiles (``pairwise tiles (matmul)``): ``f`` on a tile of pairs as one
chunk of a monoid reduction over the y rows whose items are the tile's x rows
(``kernels/matmul_tiles.py``), so that ``f``'s dot products over a tile are one
matmul.

A tile's values are ``f`` mapped over its y rows (the rows) and its x rows (the
items), ``(bj, bi, *t)``; a softmax-weighted sum's values that depend on the y row
only (attention's ``v_j``) stay ``(bj, *v)``, and
:class:`~adv_jax_math.monoids.softmax.SoftmaxWeighted` weighs them with every x row's
scores (its ``(*s, *v)`` result): ``P @ V``. :func:`blocks` reads which values those
are from ``f``'s jaxpr, or says why the tiles cannot take ``f``.

``f`` on a tile is evaluated by :mod:`.dots` (dot products as matmuls, squared
distances expanded from :data:`~.dots.MIN_FEATURES` features on).

The kernels keep a tile's states with its x rows where the monoid puts its items
(top-k's ``(k, bi)``); :func:`states` and :func:`reverse` turn them to and from one
state per x row, as the other pairwise kernels give them (``pairs.grad``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..analysis.jaxpr_graph import deps, graph
from ..core.linear import cotangent_for
from ..core.sharding import whole
from ..kernels import native
from ..kernels.matmul_reverse import tile_cotangents
from ..kernels.matmul_tiles import tile_states
from ..kernels.pairwise import _pad_rows
from ..kernels.pairwise_device import Layout
from ..monoids.reduction import LeafReduction, MonoidReduction
from ..monoids.softmax import SoftmaxWeighted
from .dots import MIN_FEATURES, pair_jaxpr, prologue_jaxpr, sources, tile
from .kernel import Probe, first_row, probe_text, struct
from .sides import sides

__all__ = [
    "blocks",
    "distances",
    "expanded",
    "kernel_layout",
    "pair_width",
    "reverse",
    "states",
    "top_k_folds",
]


def _per_y(red: MonoidReduction, y_only: tuple[bool, ...]) -> tuple[bool, ...]:
    """Per value of ``f``: whether a tile keeps it one per y row (a softmax-weighted
    sum's values that do not depend on the x row)."""
    weighs = lambda leaf: isinstance(leaf.monoid, SoftmaxWeighted)
    return tuple(
        y_only[s] and any(weighs(leaf) and s in leaf.sources[1:] for leaf in red.leaves)
        for s in range(len(y_only))
    )


def blocks(f: Callable, x: Any, y: Any, red: MonoidReduction) -> tuple[bool, ...] | str:
    """Per value of ``f``, whether a matmul tile keeps it one per y row; or why the
    tiles cannot take ``f``."""
    closed = jax.make_jaxpr(lambda xi, yj: jax.tree.leaves(f(xi, yj)))(first_row(x), first_row(y))
    nx = len(jax.tree.leaves(x))
    y_only = tuple(not any(i < nx for i in deps(o)) for o in graph(closed)[1])
    per_y = _per_y(red, y_only)
    for leaf in red.leaves:
        weighs = isinstance(leaf.monoid, SoftmaxWeighted)
        if leaf.axis != 0:
            return f"{leaf.monoid.name} reduces every axis of f's values, not the y rows"
        if weighs and not all(y_only[s] for s in leaf.sources[1:]):
            return (
                "f's values of the softmax-weighted sum depend on the x row: each x row "
                "weighs values of its own"
            )
        values = leaf.sources[1:] if weighs else ()
        if any(per_y[s] for s in leaf.sources if s not in values):
            return "a value of f is read both per y row and per pair"
    return per_y


def kernel_layout(
    f: Callable, x: Any, y: Any, red: MonoidReduction, layout: Layout, target: Any
) -> Layout | str:
    """``layout`` (a Pallas kernel's, ``per_y`` left to fill) with ``f``'s
    :func:`blocks`, compiled (or lowered) for ``target`` at its tiles (None: traced
    only); or why not."""
    per_y = blocks(f, x, y, red)
    if isinstance(per_y, str):
        return per_y
    layout = dataclasses.replace(layout, per_y=per_y, target=target)
    if target is None:
        return layout
    conv, consts = jax.closure_convert(f, first_row(x), first_row(y))
    values, own = sources(conv, consts, x, y, red, layout)
    run = lambda c, xs, ys: tile_states(values, red, c, xs, ys, layout)
    structs = lambda tree: [struct(a) for a in jax.tree.leaves(tree)]
    args = (structs([*own, *consts]), structs(x), structs(y))
    text = probe_text(prologue_jaxpr(conv, consts, x, y, red), red)
    return Probe(target, layout, run, args, text).problem() or layout


def distances(f: Callable, x: Any, y: Any, red: MonoidReduction) -> list[tuple[int, bool]]:
    """The squared distances in ``f`` between x-only and y-only vectors: their
    features, and whether the matmul tiles expand them."""
    found: list[tuple[int, bool]] = []
    closed = pair_jaxpr(lambda c, xi, yj: red.prologue(f(xi, yj)), [], x, y)
    two = lambda t: [jax.ShapeDtypeStruct((2, *a.shape), a.dtype) for a in first_row(t)]
    values = lambda xs, ys: [v.get() for v in tile(closed, [], xs, ys, found)]
    jax.eval_shape(values, two(jax.tree.leaves(x)), two(jax.tree.leaves(y)))
    return found


def pair_width(f: Callable, x: Any, y: Any, red: MonoidReduction) -> int:
    """The most elements per pair of a value the matmul tiles make per pair: 1 for
    scores, 64 for the ``(bj, bi, 64)`` difference of an L1 distance over 64 features
    (a squared distance expanded, or a dot product, makes none)."""
    closed = pair_jaxpr(lambda c, xi, yj: red.prologue(f(xi, yj)), [], x, y)
    two = lambda t: [jax.ShapeDtypeStruct((2, *a.shape), a.dtype) for a in first_row(t)]
    widths = [1]

    def values(xs: list, ys: list) -> list:
        made: list = []
        out = [v.get() for v in tile(closed, [], xs, ys, made=made)]
        pairs = [v.val for v in made if v.kind == "p" and v.val is not None]
        widths.extend(int(np.prod(a.shape[2:], dtype=np.int64)) for a in pairs)
        return out

    jax.eval_shape(values, two(jax.tree.leaves(x)), two(jax.tree.leaves(y)))
    return max(widths)


def expanded(f: Callable, x: Any, y: Any, red: MonoidReduction) -> str:
    """What the matmul tiles do with the squared distances in ``f`` (for the plan)."""
    found = distances(f, x, y, red)
    counts = lambda used: "/".join(sorted({str(n) for n, u in found if u == used}))
    says = []
    if any(u for _, u in found):
        says.append(
            f"squared distances over {counts(True)} features as |a|^2 + |b|^2 - 2 a.b "
            "(centred, one matmul)"
        )
    if not all(u for _, u in found):
        says.append(
            f"squared distances over {counts(False)} features direct (fewer than "
            f"{MIN_FEATURES}: expanded, near pairs lose digits to cancellation)"
        )
    return "; ".join(says)


def top_k_folds(red: MonoidReduction) -> str:
    """How the CPU tiles (matmul or unrolled) fold a top-k (``TopK.fold_into``), for
    the plan; "" without one."""
    if not any(leaf.monoid.native_kernel == "topk" for leaf in red.leaves):
        return ""
    loaded, why = native.status()
    if loaded:
        return (
            "top_k folded by the native kernel: a tile's rows enter where they beat the "
            "k-th, no sort"
        )
    return f"top_k by lax.top_k and merges (native kernel not used: {why})"


def _items(
    red: MonoidReduction, row: list, per_y: tuple, b: int
) -> list[list[jax.ShapeDtypeStruct]]:
    """Each term's items in a tile of ``b`` x rows (``row``: one row's)."""
    return [
        [
            it if per_y[s] else jax.ShapeDtypeStruct((b, *it.shape), it.dtype)
            for s, it in zip(leaf.sources, items, strict=True)
        ]
        for leaf, items in zip(red.leaves, row, strict=True)
    ]


def _x_axes(fn: Callable, red: MonoidReduction, row: list, per_y: tuple) -> list[list[int]]:
    """Per term, per leaf of ``fn(leaf, items)``: the axis of a tile's x rows (top-k's
    ``(k, bi)``: 1), the one that differs between tiles of two sizes."""

    def shapes(b: int) -> list[list[tuple]]:
        tile = zip(red.leaves, _items(red, row, per_y, b), strict=True)
        out = [jax.eval_shape(functools.partial(fn, leaf, it)) for leaf, it in tile]
        return [[a.shape for a in jax.tree.leaves(o)] for o in out]

    differs = lambda u, v: next(k for k, (p, q) in enumerate(zip(u, v, strict=True)) if p != q)
    return [
        [differs(u, v) for u, v in zip(s, t, strict=True)]
        for s, t in zip(shapes(2), shapes(3), strict=True)
    ]


def _init(leaf: LeafReduction, items: list) -> Any:
    return leaf.monoid.init(items)


def _finalize(leaf: LeafReduction, items: list) -> Any:
    return leaf.monoid.finalize(leaf.monoid.init(items), items)


def _row_items(conv: Callable, consts: list, red: MonoidReduction, x: Any, y: Any) -> list:
    one = lambda xi, yj: red.prologue(conv(xi, yj, *consts))
    out = jax.eval_shape(one, first_row(x), first_row(y))
    return [[out[s] for s in leaf.sources] for leaf in red.leaves]


def _to_rows(state: Any, axes: list[int], n: int) -> Any:
    """Tile states (leading axis: the x tiles) as one state per x row (``n`` rows)."""
    leaves, tree = jax.tree.flatten(state)
    rows = [jnp.moveaxis(a, 1 + k, 1) for a, k in zip(leaves, axes, strict=True)]
    return jax.tree.unflatten(tree, [a.reshape(-1, *a.shape[2:])[:n] for a in rows])


def _to_tiles(per_row: Any, axes: list[int], bi: int, pad: Callable) -> Any:
    """One value per x row (``None`` kept) as the tiles' (leading axis: the x tiles)."""

    def one(a: jax.Array | None, k: int) -> jax.Array | None:
        if a is None:
            return None
        a = pad(a)
        return jnp.moveaxis(a.reshape(-1, bi, *a.shape[1:]), 1, 1 + k)

    leaves, tree = jax.tree.flatten(per_row, is_leaf=lambda a: a is None)
    return jax.tree.unflatten(tree, [one(a, k) for a, k in zip(leaves, axes, strict=True)])


def states(
    conv: Callable, consts: list, red: MonoidReduction, x: Any, y: Any, layout: Layout
) -> tuple[list, list]:
    """Each term's state for every x row and its items (one row's), as
    ``pairs.kernel.kernel_states`` gives them, from the matmul tiles."""
    row = _row_items(conv, consts, red, x, y)
    values, own = sources(conv, consts, x, y, red, layout)
    # the loops run over every x row on every device: x rows split on Explicit axes
    # are made whole (lax.map takes no split leading axis); the results typed as x by
    # the caller
    xs = [whole(a) for a in jax.tree.leaves(x)]
    out = tile_states(values, red, [*own, *consts], xs, jax.tree.leaves(y), layout)
    axes = _x_axes(_init, red, row, layout.per_y)
    n = jax.tree.leaves(x)[0].shape[0]
    per_row = [_to_rows(s, a, n) for s, a in zip(out, axes, strict=True)]
    return per_row, [leaf.items(r) for leaf, r in zip(red.leaves, row, strict=True)]


def reverse(
    conv: Callable, red: MonoidReduction, layout: Layout, res: tuple, cts: list, pos: list
) -> tuple[list, list, list, jax.Array]:
    """``pairs.grad``'s reverse pass on the matmul tiles: ``(dc, dx, dy, wrong)`` for
    the leaves numbered in ``pos`` (``res``: constants, x, y, the per-row states;
    ``cts``: each term's result cotangents, per x row)."""
    if layout.on != "xla":
        layout = _reverse_layout(conv, red, layout, res, cts, pos)
    return _reverse(conv, red, layout, res, cts, pos)


NO_SPILLS = ("xla_gpu_fail_ptx_compilation_on_register_spilling", True)


def _reverse_layout(
    conv: Callable, red: MonoidReduction, layout: Layout, res: tuple, cts: list, pos: list
) -> Layout:
    """The reverse pass's kernels at the largest tiles, from the forward kernel's down
    to halves of them (on GPU at least 16 rows, on TPU 128), at which they compile (or
    lower) for the layout's target (probed when the reverse pass is traced: a forward
    pass alone compiles none); else XLA's loops.

    * GPU: two kernels, their tiles tried first with ptxas spilling no register (the
      compile fails where it does), then as they compile: at 64 x 64 they spilled
      43 KB per thread on an A100 (attention, float32).
    * TPU: one kernel (``kernels.matmul_reverse._one_pass``), one side's cotangents
      whole in VMEM; XLA's loops where they do not fit. A float32 dot product in
      split bfloat16 passes (``Precision.HIGH``/``HIGHEST``, k-NN's and Sinkhorn's
      expanded distances) keeps its infinities in its transposes too
      (``pairs.precision.keeping_inf_reverse``)."""
    if layout.target is None:  # interpreted: at the forward kernel's tiles
        return layout
    c, x, y, _ = res
    bi, bj = layout.tiles
    least = 128 if layout.on == "tpu" else 16
    text = probe_text(prologue_jaxpr(conv, list(c), x, y, red), red)
    args = jax.tree.map(struct, (res, cts))
    tried = [(bi, bj), (bi, bj // 2), (bi // 2, bj // 2), (bi // 2, bj // 4)]
    tiles = list(dict.fromkeys(t for t in tried if min(t) >= least))
    # on a GPU first the tiles whose kernels spill no register (XLA's autotuner drops
    # spilling configurations too), then any that compiles
    strict = [(NO_SPILLS,)] if layout.on == "gpu" else []
    for options in [*strict, ()]:
        for back in tiles:
            lay = dataclasses.replace(layout, tiles=back)
            run = lambda res, cts, lay=lay: _reverse(conv, red, lay, res, cts, pos)
            found = Probe(layout.target, lay, run, args, f"{text} reverse {pos}", options)
            if found.problem() is None:
                return lay
    return dataclasses.replace(layout, on="xla")


def _reverse(
    conv: Callable, red: MonoidReduction, layout: Layout, res: tuple, cts: list, pos: list
) -> tuple[list, list, list, jax.Array]:
    c, x, y, per_term = res
    pc, px, py = pos
    bi, ys = layout.tiles[0], jax.tree.leaves(y)
    xs = [whole(a) for a in jax.tree.leaves(x)]  # as in states (dx typed as x by pairs.grad)
    n = xs[0].shape[0]
    row = _row_items(conv, c, red, x, y)
    state_axes = _x_axes(_init, red, row, layout.per_y)
    result_axes = _x_axes(_finalize, red, row, layout.per_y)
    rows = -(-n // bi) * bi  # whole tiles
    copies = lambda a: _pad_rows(a, rows)
    zeros = lambda a: jnp.pad(a, [(0, rows - n)] + [(0, 0)] * (a.ndim - 1))
    tile_st = [_to_tiles(s, a, bi, copies) for s, a in zip(per_term, state_axes, strict=True)]
    # half floats' cotangents in float32: the monoids' matmuls with the float32
    # weights then take one dtype (Triton's dot takes no other)
    wide = lambda t: jax.tree.map(lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32)), t)
    tile_ct = [_to_tiles(wide(t), a, bi, zeros) for t, a in zip(cts, result_axes, strict=True)]
    # a max/min's tied pairs, tallied by the forward tiles (``Monoid.tally``)
    tallies: list = [None] * len(red.leaves)
    tallied = [
        t
        for t, leaf in enumerate(red.leaves)
        if leaf.monoid.tally is not None and jax.tree.leaves(cts[t])  # (float results)
    ]
    if tallied:
        values, own = sources(conv, list(c), x, y, red, layout)  # the forward's values
        found = tile_states(values, red.tallies(tallied), [*own, *c], xs, ys, layout)
        for t, state in zip(tallied, found, strict=True):
            shares = lambda s, m=red.leaves[t].monoid: m.tally.shares(s, False)
            tallies[t] = jax.vmap(shares)(state)
    items = _items(red, row, layout.per_y, bi)
    # the tiles' pass runs on the values where f starts to read both rows (Sides): the
    # cotangents of the one-sided values before, summed over every tile of the other
    # side, then go through one VJP each
    cut = sides(conv, list(c), x, y, red, layout)
    bx, x_vjp = jax.vjp(cut.x, list(c), xs)
    by, y_vjp = jax.vjp(cut.y, list(c), ys)
    fx, fy = cut.floats
    fx, fy = (fx if px or pc else ()), (fy if py or pc else ())
    picked = tuple(len(cut.consts) + k for k in pc)
    args = ([*cut.consts, *c], bx, by, layout, tile_st, tile_ct, tallies, (picked, fx, fy))
    dc, dbx, dby, wrong = tile_cotangents(cut.pairs, red, items, *args)
    dcx, dx = _side(x_vjp, bx, fx, dbx)
    dcy, dy = _side(y_vjp, by, fy, dby)
    dc = [d + dcx[k] + dcy[k] for d, k in zip(dc, pc, strict=True)]
    return dc, [dx[k] for k in px], [dy[k] for k in py], wrong


def _side(vjp: Callable, outs: list, pos: tuple, cts: list) -> tuple[list, list]:
    """``vjp`` of one side's values ``outs``, given the cotangents ``cts`` of those
    numbered in ``pos`` (the others': zeros)."""
    given = dict(zip(pos, cts, strict=True))
    return vjp([cotangent_for(o, given.get(k)) for k, o in enumerate(outs)])
