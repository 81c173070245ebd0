"""The pairwise kernels' front: ``f`` traced, a kernel run on it.

:func:`kernel_states` traces ``f`` (closure-converted: ``conv(xi, yj, *consts)``)
followed by the reduction's prologue and runs a kernel: each term's monoid state for
every x row. The kernel is the tile kernel (``kernels/pairwise_device.py``, ``f`` on
one pair with its features unrolled) for a ``Layout``, else (or where ``f`` does not
unroll) the interpret kernel (``kernels/pairwise.py``, ``f`` on a ``bi`` x ``bj``
tile). :func:`kernel_sums` is the same for a pairwise sum of any ``g(xi, yj)``,
finalized, with chosen outputs summed over the x rows too: the reverse pass is made
of these (``pairs.grad``). :func:`layout_problem` is the planner's check of the
tile kernel (traced, then compiled for the target).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..analysis.recognize import recognize
from ..core.sharding import explicit, on_every_device, sharding_of
from ..core.trace import rows_aval
from ..kernels.fused_reduce.probe import probe
from ..kernels.fused_reduce.rules import mosaic_gpu_missing
from ..kernels.pairwise import states
from ..kernels.pairwise_device import Layout, device_states
from ..kernels.unrolled import NotUnrolled, size
from ..monoids.base import Monoid, identity, merge_stacked
from ..monoids.reduction import MonoidReduction
from ..monoids.softmax import SoftmaxWeighted
from ..monoids.sums import ADD

__all__ = ["Prepared", "first_row", "kernel_states", "kernel_sums", "like", "recognized", "struct"]


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
    """``f`` on a tile, traced: ``jaxpr(*consts, *x_leaves, *y_leaves)`` gives each
    term's source arrays ``(bi, bj, ...)``; ``reduction`` the terms over ``j``;
    ``m`` the rows of ``y``."""

    jaxpr: Any  # ClosedJaxpr of the tile function
    reduction: MonoidReduction
    m: int


def first_row(tree: Any) -> Any:
    """One row's avals (closure conversion's example; slicing a row of rows split over
    devices is not allowed)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), tree)


def struct(a: Any) -> jax.ShapeDtypeStruct:
    """``a``'s shape and dtype (no sharding: the kernels' arguments are whole)."""
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))


def rows_of(tree: Any, name: str) -> int:
    """The rows of every leaf of ``tree`` (``x`` or ``y``: ``name``), checked equal."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError(f"pairwise: {name} has no arrays; pass a pytree of arrays with rows")
    sizes = {tuple(jnp.shape(a))[:1] for a in leaves}
    if () in sizes or len(sizes) != 1:
        shapes = [tuple(jnp.shape(a)) for a in leaves]
        raise ValueError(
            f"pairwise: every leaf of {name} needs the same leading (row) axis; got shapes {shapes}"
        )
    return int(sizes.pop()[0])


def recognized(f: Callable, x: Any, y: Any, reduction: Any, bj: int) -> MonoidReduction:
    """The terms over ``j`` of one x row's outputs on ``bj`` y rows."""
    pairs = lambda xi, yc: jax.vmap(f, (None, 0))(xi, yc)
    row_out = jax.eval_shape(pairs, first_row(x), rows_aval(y, bj))
    rec = recognize(reduction, identity, row_out)
    if rec.leaves is None:
        raise ValueError(f"pairwise: reduction={reduction!r} is not recognized: {rec.how}")
    return MonoidReduction(rec.leaves, rec.out_tree, rec.prologue, rec.how)


def broadcast_pairs(f: Callable, reduction: Any) -> Callable:
    """``f`` with the values each term of a broadcasting monoid reads
    (``Monoid.broadcasts``: ``weighted_logsumexp``'s ``a`` and ``b``) broadcast to one
    shape per pair, as ``jax.nn.logsumexp`` broadcasts ``b``: every pairwise engine
    then folds values of one shape (the monoid broadcasts rows-first values only; a
    tile's x rows stand between). ``f`` itself where no term broadcasts."""
    is_monoid = lambda m: isinstance(m, Monoid)
    monoids = jax.tree.leaves(reduction, is_leaf=is_monoid)
    if not any(getattr(m, "broadcasts", False) for m in monoids):  # (or not monoids)
        return f

    def each(monoid: Monoid, sub: Any) -> Any:
        vals, tree = jax.tree.flatten(sub)
        try:
            shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in vals))
        except ValueError:  # (the monoid refuses them, saying why)
            return sub
        same = [jnp.broadcast_to(v, shape) for v in vals]
        return jax.tree.unflatten(tree, same) if monoid.broadcasts else sub

    def broadcast(xi: Any, yj: Any) -> Any:
        out = f(xi, yj)
        try:
            return jax.tree.map(each, reduction, out, is_leaf=is_monoid)
        except ValueError:  # not a prefix of f's output: recognition says so
            return out

    return broadcast


def kernel_states(
    conv: Callable,
    consts: Sequence[Any],
    red: MonoidReduction,
    x: Any,
    y: Any,
    tiles: tuple[int, int],
    summed: Sequence[int] = (),
    layout: Layout | None = None,
) -> tuple[list, list]:
    """Each term of ``red`` (over the outputs of ``conv(xi, yj, *consts)``): its state
    for every x row, or for the terms in ``summed`` (sums) one per x tile; and its
    items (``LeafReduction.items``: one row's avals as the monoid reads them).

    ``layout`` None: the interpret kernel (``kernels/pairwise.py``); else the tile
    kernel (``kernels/pairwise_device.py``, every state per x row), or where it cannot
    unroll ``f`` the same computation in plain JAX (a map over x tiles)."""
    bi, bj = tiles
    if layout is not None:
        summed = ()

    def tile(c: list, xt: Any, yt: Any) -> list:
        pair = lambda xi, yj: conv(xi, yj, *c)
        return jax.vmap(lambda xi: red.prologue(jax.vmap(pair, (None, 0))(xi, yt)))(xt)

    jaxpr, out = jax.make_jaxpr(tile, return_shape=True)(
        [struct(c) for c in consts], rows_aval(x, bi), rows_aval(y, bj)
    )
    rows = [jax.ShapeDtypeStruct(s.shape[1:], s.dtype) for s in out]  # one x row's
    items = [leaf.items(red.reads(rows, leaf)) for leaf in red.leaves]
    prepared = Prepared(jaxpr, red, jax.tree.leaves(y)[0].shape[0])
    pair, nt = None, len(jaxpr.consts)
    if layout is not None:
        pair = _pair(conv, consts, red, x, y)
    npc = len(pair.consts) if pair is not None else 0

    def interpreted(reference: bool) -> Callable:  # kernels/pairwise.py, or plain JAX
        def go(c: list, xs: list, ys: list) -> list:
            user = c[nt + npc :]
            return states(prepared, tiles, [*c[:nt], *user], xs, ys, summed, reference)

        return go

    def tiled(c: list, xs: list, ys: list) -> list:  # kernels/pairwise_device.py
        assert pair is not None and layout is not None
        out = device_states(pair.jaxpr, red, c[nt:], xs, ys, layout)
        # states of one value per pair: shaped as those of f's (1,) values, if so
        n = jax.tree.leaves(xs)[0].shape[0]
        inits = lambda: [leaf.monoid.init(it) for leaf, it in zip(red.leaves, items, strict=True)]
        return jax.tree.map(lambda o, w: o.reshape(n, *w.shape), out, jax.eval_shape(inits))

    # the jaxprs' own constants are arguments too (shard_map takes no closed-over
    # values typed on Explicit axes)
    const_args = [*jaxpr.consts, *(pair.consts if pair is not None else ()), *consts]
    args = (const_args, jax.tree.leaves(x), jax.tree.leaves(y))
    primal = interpreted(False)
    if layout is not None:
        # where the tile kernel cannot unroll f: the interpret kernel in interpret
        # mode, else the same computation in plain JAX
        ok = tile_problem(tiled, jax.tree.map(struct, args)) is None
        primal = tiled if ok else interpreted(not layout.interpret)
    # A Pallas call has no derivative of its own: differentiated (a derivative of the
    # reverse pass, from the second order on), the states are the same computation's
    # in plain JAX.
    kernel = jax.custom_jvp(primal)
    kernel.defjvp(lambda primals, tangents: jax.jvp(interpreted(True), primals, tangents))
    return on_every_device(kernel, *args), items


def layout_problem(
    f: Callable, x: Any, y: Any, red: MonoidReduction, layout: Layout, target: Any = None
) -> str | None:
    """Why the tile kernel cannot run ``f``'s reduction ``red``, or None: traced, and
    for a ``target`` (``fused_reduce.targets.Target``) compiled where a compiler for
    it is present, else lowered (``fused_reduce.probe``; cached)."""
    conv, consts = jax.closure_convert(f, first_row(x), first_row(y))
    pair = _pair(conv, consts, red, x, y)
    run = lambda c, xs, ys: device_states(pair.jaxpr, red, c, xs, ys, layout)
    structs = lambda tree: [struct(a) for a in jax.tree.leaves(tree)]
    args = ([struct(c) for c in [*pair.consts, *consts]], structs(x), structs(y))
    problem = tile_problem(run, args)
    if problem is None:  # (interpreted as on the device it stands for)
        problem = _unrolled_problem(pair.jaxpr, layout.kind)
    if problem is None and layout.kind == "mosaic_gpu":
        problem = _mosaic_gpu_problem(pair.jaxpr, args)
    if problem is not None or target is None:
        return problem
    return Probe(target, layout, run, args, probe_text(pair.jaxpr, red)).problem()


MAX_CONTRACTION = 16  # wider dot products: the matmul tiles are faster
MAX_XLA_VALUES = 128  # per-pair values the XLA tiles unroll (XLA:CPU compiles each)


def _unrolled_problem(pair: Any, kind: str) -> str | None:
    """Why unrolling ``pair`` would be slower than a matmul (the matmul tiles on CPU),
    or None.

    Measured on XLA:CPU at 4096 x 4096 pairs: a dot over 32 features 2.6x slower
    unrolled than the scan engine's matmul; squared distances over 8-128 features
    1.6-5x faster unrolled forward, but their ``value_and_grad`` at parity up to 48
    features and 1.1-1.2x slower from 64 (129 values per pair), compiled in 8-12 s
    there (0.7 s on the scan engine). On GPU/TPU the roofline model
    (``bench/accel/pairwise_model.py``) puts unrolled dots over 64+ features 8x and more below the
    matmul units' peak."""
    values, widest = size(pair)
    if widest >= MAX_CONTRACTION:
        return f"f contracts {widest} features in a dot product: a matmul, not unrolled"
    if kind == "xla" and values > MAX_XLA_VALUES:
        return f"f makes {values} values per pair (over {MAX_XLA_VALUES}: slow to compile unrolled)"
    return None


def _mosaic_gpu_problem(pair: Any, args: Any) -> str | None:
    """Why the tile kernel cannot take ``pair`` on Mosaic GPU (static rules), or None:
    an operation it has no lowering for, 64-bit values (TMA copies take none)."""
    if missing := mosaic_gpu_missing(pair.jaxpr, "f"):
        return missing
    wide = sorted({str(a.dtype) for a in jax.tree.leaves(args) if a.dtype.itemsize > 4})
    if wide:
        return f"Mosaic GPU's TMA copies take no 64-bit types ({', '.join(wide)})"
    return None


def state_width(f: Callable, x: Any, y: Any, red: MonoidReduction) -> int:
    """The state values of one x row in the tile kernel: each element of each term's
    values per pair folded on its own, each with its monoid's state leaves (a top-k of
    10: 20)."""
    conv, consts = jax.closure_convert(f, first_row(x), first_row(y))
    outs = [v.aval for v in _pair(conv, consts, red, x, y).jaxpr.outvars]
    total = 0
    for leaf in red.leaves:
        one = [jax.ShapeDtypeStruct((), outs[s].dtype) for s in leaf.sources]
        folds, m = math.prod(outs[leaf.sources[-1]].shape), leaf.monoid
        if isinstance(m, SoftmaxWeighted):  # each score with each value (of its heads)
            folds = (
                math.prod(outs[leaf.sources[0]].shape)
                * folds
                // math.prod(outs[leaf.sources[-1]].shape[: m.heads])
            )
            m = m.paired()
        per = len(jax.tree.leaves(jax.eval_shape(lambda m=m, one=one: m.init(one))))
        total += per * folds
    return total


def probe_text(jaxpr: Any, red: MonoidReduction) -> str:
    """What a tile kernel's probe is cached by, besides shapes and tiles: ``jaxpr``
    printed and each term's monoid, sources and axis (two reductions of one ``f``, an
    ARGMIN and a MIN_ARGMIN say, are two kernels)."""
    terms = [(repr(leaf.monoid), leaf.sources, leaf.axis) for leaf in red.leaves]
    return f"{jaxpr}\n{terms}"


@dataclasses.dataclass(frozen=True, eq=False)
class Probe:
    """A tile kernel as ``fused_reduce.probe`` compiles it: ``call(*args())``."""

    target: Any
    layout: Layout
    run: Callable
    arguments: tuple
    text: str  # the pair jaxpr and the terms (probe_text)
    options: tuple = ()  # XLA debug options of the compile, as (name, value) pairs

    @property
    def rows(self) -> str:
        return f"{self.layout.tiles[0]} x {self.layout.tiles[1]}"

    def key(self) -> tuple:
        shapes = jax.tree.map(lambda a: (a.shape, str(a.dtype)), self.arguments)
        layout = self.layout
        return (self.text, str(shapes), layout.tiles, layout.kind, layout.on, self.options)

    def args(self) -> tuple:
        return self.arguments

    def call(self) -> Callable:
        return self.run

    def problem(self) -> str | None:
        """Why the kernel does not build for its target (cached), or None."""
        return probe(self).problem


def tile_problem(run: Callable, args: Any) -> str | None:
    """Why the tile kernel cannot run ``run(*args)`` (traced only), or None."""
    try:
        jax.eval_shape(run, *args)
    except NotUnrolled as e:
        return str(e)
    return None


def _pair(conv: Callable, consts: Sequence[Any], red: MonoidReduction, x: Any, y: Any) -> Any:
    """The tile kernel's function: the terms' sources of one pair, traced (``f``'s
    outputs as one row for the prologue, which reads rows)."""
    row = lambda out: jax.tree.map(lambda v: v[None], out)
    one = lambda c, xi, yj: [s[0] for s in red.prologue(row(conv(xi, yj, *c)))]
    return jax.make_jaxpr(one)([struct(c) for c in consts], first_row(x), first_row(y))


def like(ct: Any, primal: Any) -> Any:
    """A cotangent with its primal's sharding, where that is in its type."""
    sharding = sharding_of(primal)
    return jax.sharding.reshard(ct, sharding) if explicit(sharding) else ct


def kernel_sums(
    g: Callable,
    x: Any,
    y: Any,
    tiles: tuple[int, int],
    summed: Sequence[int] = (),
    layout: Layout | None = None,
) -> list:
    """``sum_j g(x_i, y_j)`` for every x row, one array per output leaf of ``g`` (as
    ``jnp.sum``: compensated); the leaves numbered in ``summed`` summed over ``i`` too.
    With a tile ``layout`` every output element is a sum of its own (the tile kernel
    takes one value per pair)."""
    if layout is not None:
        avals = jax.tree.leaves(jax.eval_shape(g, first_row(x), first_row(y)))
        sizes = [int(np.prod(a.shape, dtype=np.int64)) for a in avals]
        starts = np.cumsum([0, *sizes])
        scalars = lambda xi, yj: [
            v.reshape(-1)[k] for v in jax.tree.leaves(g(xi, yj)) for k in range(v.size)
        ]
        each = [k for t in summed for k in range(starts[t], starts[t + 1])]
        flat = _sums(scalars, x, y, tiles, each, layout)
        out = []
        for t, a in enumerate(avals):
            part = jnp.stack(flat[starts[t] : starts[t + 1]], axis=-1)
            out.append(part.reshape(*part.shape[:-1], *a.shape))
        return out
    return _sums(g, x, y, tiles, summed, None)


def _sums(
    g: Callable, x: Any, y: Any, tiles: tuple[int, int], summed: Sequence[int], layout: Any
) -> list:
    conv, consts = jax.closure_convert(g, first_row(x), first_row(y))
    red = recognized(lambda xi, yj: conv(xi, yj, *consts), x, y, ADD, tiles[1])
    per_term, items = kernel_states(conv, consts, red, x, y, tiles, summed, layout)
    out = []
    for t, (leaf, state, it) in enumerate(zip(red.leaves, per_term, items, strict=True)):
        if t in summed:
            out.append(leaf.result(merge_stacked(leaf.monoid.merge, state), it))
        else:
            out.append(jax.vmap(lambda s, leaf=leaf, it=it: leaf.result(s, it))(state))
    return out
