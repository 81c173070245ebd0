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

:func:`_tile` evaluates ``f``'s jaxpr on a tile with the one equation walker, each
value made on the rows it depends on: x-only ``(bi, ...)``, y-only ``(bj, ...)``, per
pair ``(bj, bi, ...)`` (a dot product of an x-only and a y-only vector: one matmul).
A squared distance between an x-only and a y-only vector, ``sum((a - b)^2)`` (or
``square``, or ``d * d``; either order) over :data:`MIN_FEATURES` or more features
is made as ``|a|^2 + |b|^2 - 2 a.b`` (:func:`_expanded`): written directly, its
difference is a ``(bj, bi, D)`` tile, and k-NN top-10 at D = 128 (4096 x 10000)
took 4.1 s against 0.23 s expanded by hand (now 0.27-0.29 s: the centring below
costs ~10%). The rest of ``f`` stays as written.

The expanded form cancels where a distance is small against the norms. Measured
(1000 x 4000 points, float32 against float64 on the same inputs; relative error of
the distances, max over the pairs, and of the 10 nearest; the neighbour sets differing
from float64's)::

    points        D    direct   expanded           expanded, centred on the y tile
    N(0,1)        3    2.8e-7   1.1e-3             6.2e-4
    N(0,1)        8    2.6e-7   4.0e-6             9.9e-6
    N(0,1)       16    2.4e-7   1.0e-6             1.2e-6
    N(0,1)       64    2.0e-7   4.6e-7             5.0e-7
    N(0,1)      128    1.9e-7   4.5e-7             4.0e-7
    N(0,1)+100    3    1.7e-7   19 (17.6% sets)    1.1e-3
    N(0,1)+100    8    1.9e-7   6.4e-2 (8.1%)      4.4e-6
    N(0,1)+100   16    2.0e-7   1.8e-2 (10.0%)     1.5e-6
    N(0,1)+100   64    1.9e-7   1.1e-2 (15.6%)     5.9e-7
    N(0,1)+100  128    1.8e-7   1.1e-2 (29.0%)     3.5e-7

(the 10 nearest's errors at most the distances'; no neighbour set differed but where
noted). So both sides are centred on the y tile's mean first (an offset they share
then cancels exactly, not in rounding), and the expanded form is used from 16
features on, within 8x of the direct form's error; below, the nearest pairs' relative
error grows to 1e-5 (D = 8) and 1e-3 (D = 3), and the direct form stays (on the CPU
those ``f`` take the unrolled tiles anyway). The dot products run at full precision
(``Precision.HIGHEST``: XLA's default on a TPU is bfloat16 passes); a sum in float32
of half floats is expanded in float32.

The kernels keep a tile's states with its x rows where the monoid puts its items
(top-k's ``(k, bi)``); :func:`states` and :func:`reverse` turn them to and from one
state per x row, as the other pairwise kernels give them (``pairs.grad``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..analysis.jaxpr_graph import CUSTOM_DERIVATIVES, bind, deps, graph, subjaxpr, walk
from ..core.sharding import whole
from ..kernels.matmul_tiles import tile_cotangents, tile_states
from ..kernels.pairwise import _pad_rows
from ..kernels.pairwise_device import Layout
from ..monoids.reduction import LeafReduction, MonoidReduction
from ..monoids.softmax import SoftmaxWeighted
from .kernel import first_row, struct

__all__ = ["MIN_FEATURES", "blocks", "expanded", "reverse", "states"]


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


MIN_FEATURES = 16  # squared distances over fewer features stay direct (module docstring)


@dataclasses.dataclass(eq=False)
class _Value:
    """A value of the pair jaxpr on a tile: ``kind`` "c" (on neither x nor y: its shape
    as traced), "x" (``(bi, ...)``), "y" (``(bj, ...)``) or "p" (per pair, ``(bj, bi,
    ...)``). Made when first read (:meth:`get`): a difference that only an expanded
    sum reads is never made per pair. ``eqn``/``ins``: the equation that makes it."""

    kind: str
    val: Any = None
    make: Callable[[], list] | None = None  # the equation's outputs, bound once
    idx: int = 0
    eqn: Any = None
    ins: tuple = ()

    def get(self) -> Any:
        if self.val is None:
            assert self.make is not None
            self.val = self.make()[self.idx]
        return self.val


def _kind(ins: list[_Value]) -> str:
    kinds = {v.kind for v in ins} - {"c"}
    return kinds.pop() if len(kinds) == 1 else "p" if kinds else "c"


def _lift(eqn: Any, ins: list[_Value], kind: str) -> list:
    """``eqn`` on the tile: bound under a vmap over the x rows, one over the y rows, or
    both (the y rows outer) as ``kind`` says."""
    fn, kinds = (lambda *a: bind(eqn, a)), [v.kind for v in ins]
    if kind in "xp":
        fn = jax.vmap(fn, tuple(0 if k in "xp" else None for k in kinds))
    if kind in "yp":
        fn = jax.vmap(fn, tuple(0 if k in "yp" else None for k in kinds))
    return fn(*(v.get() for v in ins))


def _squared_distance(eqn: Any, ins: list[_Value]) -> tuple[_Value, _Value, int] | None:
    """``(A, B, features)`` where ``eqn`` sums ``(A - B)^2`` (``integer_pow``, ``square``
    or ``d * d``, widened or not; either order of the difference) over ``features``
    features, ``A`` of the x rows only and ``B`` of the y rows only."""
    name = lambda v: v.eqn.primitive.name if v.eqn is not None else None
    if eqn.primitive.name != "reduce_sum":
        return None
    sq = ins[0]
    if name(sq) == "convert_element_type" and jnp.issubdtype(
        sq.eqn.invars[0].aval.dtype, jnp.floating
    ):  # jnp.sum of half floats sums in float32
        sq = sq.ins[0]
    squares = (
        (name(sq) == "integer_pow" and sq.eqn.params["y"] == 2)
        or name(sq) == "square"
        or (name(sq) == "mul" and sq.ins[0] is sq.ins[1])
    )
    d = sq.ins[0] if squares else None
    if d is None or name(d) != "sub" or {v.kind for v in d.ins} != {"x", "y"}:
        return None
    shape = eqn.invars[0].aval.shape
    features = int(np.prod([shape[k] for k in eqn.params["axes"]]))
    a, b = d.ins if d.ins[0].kind == "x" else d.ins[::-1]
    return a, b, features


def _expanded(a: jax.Array, b: jax.Array, axes: Sequence[int], dtype: Any) -> jax.Array:
    """``sum((a_i - b_j)^2)`` over the feature ``axes`` of ``a`` (``(bi, *s)``) and ``b``
    (``(bj, *s)``) as ``|a_i|^2 + |b_j|^2 - 2 a_i . b_j``, ``(bj, bi, *kept)``: both
    centred on the y rows' mean first (the offset they share cancels exactly, not in
    rounding), the dot products one matmul at full precision, never below 0."""
    a, b = a.astype(dtype), b.astype(dtype)
    centre = lax.stop_gradient(jnp.mean(b, axis=0))  # any centre: the sum does not move
    a, b = a - centre, b - centre
    feat = tuple(1 + k for k in axes)
    kept = tuple(k for k in range(1, a.ndim) if k not in feat)
    norm_a, norm_b = jnp.sum(a * a, feat), jnp.sum(b * b, feat)
    dims = ((feat, feat), (kept, kept))
    ab = lax.dot_general(b, a, dims, precision=lax.Precision.HIGHEST)  # (*kept, bj, bi)
    ab = jnp.moveaxis(ab, (-2, -1), (0, 1))
    return jnp.maximum(norm_b[:, None] + norm_a[None] - 2 * ab, 0)


def _pair_jaxpr(pair: Callable, c: list, x: Any, y: Any) -> Any:
    """``pair(c, xi, yj)`` on one row of ``x`` and of ``y`` (pytrees of rows), traced:
    a jaxpr of ``c``, then the leaves of ``xi`` and of ``yj``, to the leaves of its
    values."""
    xdef, ydef = jax.tree.structure(x), jax.tree.structure(y)
    fun = lambda c, xs, ys: jax.tree.leaves(
        pair(c, jax.tree.unflatten(xdef, xs), jax.tree.unflatten(ydef, ys))
    )
    rows = lambda t: first_row(jax.tree.leaves(t))
    return jax.make_jaxpr(fun)([struct(a) for a in c], rows(x), rows(y))


def _tile(closed: Any, c: list, xs: list, ys: list, found: list | None = None) -> list:
    """The values of ``closed`` (a :func:`_pair_jaxpr`) on a tile of x rows ``xs`` and
    y rows ``ys`` (leaves, rows first), each a :class:`_Value`: its equations walked,
    each bound on the rows it depends on, and each squared distance between an x-only
    and a y-only vector over :data:`MIN_FEATURES` or more features made by
    :func:`_expanded` (each one's features and whether it was expanded noted in
    ``found``)."""

    def rule(eqn: Any, ins: list[_Value]) -> list[_Value]:
        if (match := _squared_distance(eqn, ins)) is not None:
            a, b, features = match
            if found is not None:
                found.append((features, features >= MIN_FEATURES))
            if features >= MIN_FEATURES:
                dtype = eqn.outvars[0].aval.dtype
                return [_Value("p", _expanded(a.get(), b.get(), eqn.params["axes"], dtype))]
        kind = _kind(ins)
        make = functools.cache(
            lambda: _lift(eqn, ins, kind) if kind != "c" else bind(eqn, [v.get() for v in ins])
        )
        return [_Value(kind, None, make, k, eqn, tuple(ins)) for k in range(len(eqn.outvars))]

    enter = lambda eqn, ins: None if eqn.primitive.name in CUSTOM_DERIVATIVES else subjaxpr(eqn)
    args = [_Value(k, v) for k, vs in (("c", c), ("x", xs), ("y", ys)) for v in vs]
    consts = [_Value("c", v) for v in closed.consts]
    literal, const = lambda v: _Value("c", v.val), lambda v, c: _Value("c", c)
    return walk(closed.jaxpr, consts, args, rule, literal=literal, const=const, enter=enter)


def _sources(
    conv: Callable, consts: list, x: Any, y: Any, red: MonoidReduction, per_y: tuple
) -> Callable:
    """``sources(consts, x tile leaves, y tile leaves)`` of ``kernels.matmul_tiles``:
    each value ``(bj, bi, ...)``, or ``(bj, ...)`` where ``per_y`` says (``f`` traced
    once, here, for every tile)."""
    pair = lambda c, xi, yj: red.prologue(conv(xi, yj, *c))
    closed = _pair_jaxpr(pair, consts, x, y)

    def sources(c: list, xs: list, ys: list) -> list:
        bi, bj = xs[0].shape[0], ys[0].shape[0]
        out = []
        for v, own in zip(_tile(closed, c, xs, ys), per_y, strict=True):
            a = v.get()
            if v.kind in "cx":
                a = jnp.broadcast_to(a, (bj, *a.shape))
            if v.kind in "cy" and not own:
                a = jnp.broadcast_to(a[:, None], (bj, bi, *a.shape[1:]))
            out.append(a)
        return out

    return sources


def expanded(f: Callable, x: Any, y: Any, red: MonoidReduction) -> str:
    """What the matmul tiles do with the squared distances in ``f`` (for the plan)."""
    found: list[tuple[int, bool]] = []
    closed = _pair_jaxpr(lambda c, xi, yj: red.prologue(f(xi, yj)), [], x, y)
    two = lambda t: [jax.ShapeDtypeStruct((2, *a.shape), a.dtype) for a in first_row(t)]
    tile = lambda xs, ys: [v.get() for v in _tile(closed, [], xs, ys, found)]
    jax.eval_shape(tile, two(jax.tree.leaves(x)), two(jax.tree.leaves(y)))
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
    sources = _sources(conv, consts, x, y, red, layout.per_y)
    # the loops run over every x row on every device: x rows split on Explicit axes
    # are made whole (lax.map takes no split leading axis); the results typed as x by
    # the caller
    xs = [whole(a) for a in jax.tree.leaves(x)]
    out = tile_states(sources, red, consts, xs, jax.tree.leaves(y), layout.tiles)
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
    c, x, y, per_term = res
    bi, ys = layout.tiles[0], jax.tree.leaves(y)
    xs = [whole(a) for a in jax.tree.leaves(x)]  # as in states (dx typed as x by pairs.grad)
    n = xs[0].shape[0]
    row = _row_items(conv, c, red, x, y)
    sources = _sources(conv, list(c), x, y, red, layout.per_y)
    state_axes = _x_axes(_init, red, row, layout.per_y)
    result_axes = _x_axes(_finalize, red, row, layout.per_y)
    rows = -(-n // bi) * bi  # whole tiles
    copies = lambda a: _pad_rows(a, rows)
    zeros = lambda a: jnp.pad(a, [(0, rows - n)] + [(0, 0)] * (a.ndim - 1))
    tile_st = [_to_tiles(s, a, bi, copies) for s, a in zip(per_term, state_axes, strict=True)]
    tile_ct = [_to_tiles(t, a, bi, zeros) for t, a in zip(cts, result_axes, strict=True)]
    # a max/min's tied pairs, tallied by the forward tiles (``Monoid.tally``)
    tallies: list = [None] * len(red.leaves)
    tallied = [
        t
        for t, leaf in enumerate(red.leaves)
        if leaf.monoid.tally is not None and jax.tree.leaves(cts[t])  # (float results)
    ]
    if tallied:
        found = tile_states(sources, red.tallies(tallied), list(c), xs, ys, layout.tiles)
        for t, state in zip(tallied, found, strict=True):
            shares = lambda s, m=red.leaves[t].monoid: m.tally.shares(s, False)
            tallies[t] = jax.vmap(shares)(state)
    items = _items(red, row, layout.per_y, bi)
    args = (list(c), xs, ys, layout.tiles, tile_st, tile_ct, tallies, tuple(pos))
    return tile_cotangents(sources, red, items, *args)
