"""``f``'s pair jaxpr evaluated on a tile of pairs (the matmul tiles' values).

:func:`tile` evaluates ``f``'s jaxpr on a tile with the one equation walker, each
value made on the rows it depends on: x-only ``(bi, ...)``, y-only ``(bj, ...)``, per
pair ``(bj, bi, ...)`` (a dot product of an x-only and a y-only vector, ``jnp.dot``
or written out as ``jnp.sum(a * b)`` (:func:`_product`): one matmul).
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

from ..analysis.jaxpr_graph import CUSTOM_DERIVATIVES, bind, subjaxpr, walk
from ..kernels.pairwise_device import Layout
from ..kernels.unrolled import is_product
from ..monoids.reduction import MonoidReduction
from .kernel import first_row, struct
from .precision import Keeping, half_dot, keeping_inf, keeping_inf_reverse, split

__all__ = ["MIN_FEATURES", "guarded", "outputs", "pair_jaxpr", "prologue_jaxpr", "sources", "tile"]


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


def _lift(eqn: Any, ins: list[_Value], kind: str, on: str, inf: Keeping | None) -> list:
    """``eqn`` on the tile (run ``on``, a ``Layout.on``): under a vmap over the x rows,
    one over the y rows, or both (the y rows outer) as ``kind`` says; a dot product of
    an x-only and a y-only vector one matmul (:func:`_pair_dot`) but in Triton's. A dot
    product of half floats accumulates in float32 (as the matrix units do; Mosaic takes
    no other), then is rounded; one of float32 on a TPU above the default precision
    keeps its infinities (``inf``: a ``pairs.precision`` function, None off a TPU)."""
    dot_general = eqn.primitive.name == "dot_general"
    if dot_general and on != "gpu" and (pair := _pair_dot(eqn, ins, inf)) is not None:
        return [pair]
    fn: Callable[..., list] = lambda *a: bind(eqn, a)
    kinds = [v.kind for v in ins]
    if dot_general and jnp.dtype(eqn.outvars[0].aval.dtype).itemsize < 4:
        fn = functools.partial(half_dot, eqn, None)
    elif dot_general and inf is not None and split(eqn.params["precision"]):
        dot = lambda p, a, b: bind(eqn, [a, b], {**eqn.params, **p})[0]
        fn = lambda a, b: [inf(dot, a, b)]
    if kind in "xp":
        fn = jax.vmap(fn, tuple(0 if k in "xp" else None for k in kinds))
    if kind in "yp":
        fn = jax.vmap(fn, tuple(0 if k in "yp" else None for k in kinds))
    return fn(*(v.get() for v in ins))


_ROWS_DOT = (((1,), (1,)), ((), ()))  # rows by rows: (bj, D) . (bi, D) -> (bj, bi)


def _pair_dot(eqn: Any, ins: list[_Value], inf: Keeping | None) -> jax.Array | None:
    """``eqn`` (a ``dot_general``) on the tile as one matmul of its y rows by its x rows,
    ``(bj, bi)`` as the tile's values are, where it is a dot product of an x-only and a
    y-only vector (else None). Its vmaps made ``(bi, bj)`` and a transpose (on a TPU a
    pass over the tile, again for its cotangent: attention's reverse kernels took 2.5x
    longer on a TPU v5e); Triton's kernels keep them (they spilled less: A100 forward,
    float32, 32 bytes against 872). Half floats and precision as :func:`_lift`."""
    plain = eqn.params["dimension_numbers"] == (((0,), (0,)), ((), ()))
    vectors = all(v.aval.ndim == 1 for v in eqn.invars)
    if not (plain and vectors and sorted(v.kind for v in ins) == ["x", "y"]):
        return None
    y, x = (v.get() for v in (ins if ins[0].kind == "y" else ins[::-1]))
    if jnp.dtype(eqn.outvars[0].aval.dtype).itemsize < 4:
        return half_dot(eqn, _ROWS_DOT, y, x)[0]
    dot = lambda p, y, x: bind(eqn, [y, x], {**eqn.params, "dimension_numbers": _ROWS_DOT, **p})[0]
    return inf(dot, y, x) if inf and split(eqn.params["precision"]) else dot({}, y, x)


def _name(v: _Value) -> str | None:
    return v.eqn.primitive.name if v.eqn is not None else None


def _summed(eqn: Any, ins: list[_Value]) -> _Value | None:
    """What ``eqn`` sums, if it is a ``reduce_sum``: its operand, or the half floats it
    widened (``jnp.sum`` of half floats sums in float32)."""
    if eqn.primitive.name != "reduce_sum":
        return None
    v = ins[0]
    if _name(v) == "convert_element_type" and jnp.issubdtype(
        v.eqn.invars[0].aval.dtype, jnp.floating
    ):
        return v.ins[0]
    return v


def _squared_distance(eqn: Any, ins: list[_Value]) -> tuple[_Value, _Value, int] | None:
    """``(A, B, features)`` where ``eqn`` sums ``(A - B)^2`` (``integer_pow``, ``square``
    or ``d * d``, widened or not; either order of the difference) over ``features``
    features, ``A`` of the x rows only and ``B`` of the y rows only."""
    if (sq := _summed(eqn, ins)) is None:
        return None
    squares = (
        (_name(sq) == "integer_pow" and sq.eqn.params["y"] == 2)
        or _name(sq) == "square"
        or (_name(sq) == "mul" and sq.ins[0] is sq.ins[1])
    )
    d = sq.ins[0] if squares else None
    if d is None or _name(d) != "sub" or {v.kind for v in d.ins} != {"x", "y"}:
        return None
    shape = eqn.invars[0].aval.shape
    features = int(np.prod([shape[k] for k in eqn.params["axes"]]))
    a, b = d.ins if d.ins[0].kind == "x" else d.ins[::-1]
    return a, b, features


def _expanded(
    a: jax.Array, b: jax.Array, axes: Sequence[int], dtype: Any, inf: Keeping | None
) -> jax.Array:
    """``sum((a_i - b_j)^2)`` over the feature ``axes`` of ``a`` (``(bi, *s)``) and ``b``
    (``(bj, *s)``) as ``|a_i|^2 + |b_j|^2 - 2 a_i . b_j``, ``(bj, bi, *kept)``: both
    centred on the y rows' mean first (the offset they share cancels exactly, not in
    rounding), the dot products one matmul at full precision (on a TPU keeping their
    infinities: ``pairs.precision.keeping_inf``), never below 0."""
    a, b = a.astype(dtype), b.astype(dtype)
    centre = lax.stop_gradient(jnp.mean(b, axis=0))  # any centre: the sum does not move
    a, b = a - centre, b - centre
    feat = tuple(1 + k for k in axes)
    norm_a, norm_b = jnp.sum(a * a, feat), jnp.sum(b * b, feat)
    ab = _dots(a, b, axes, inf)
    return jnp.maximum(norm_b[:, None] + norm_a[None] - 2 * ab, 0)


def _dots(a: jax.Array, b: jax.Array, axes: Sequence[int], inf: Keeping | None) -> jax.Array:
    """``sum(a_i * b_j)`` over the feature ``axes`` of ``a`` (``(bi, *s)``) and ``b``
    (``(bj, *s)``), ``(bj, bi, *kept)``: one matmul at full precision (as the sum of
    products in float32 it stands for; on a TPU keeping its infinities:
    ``pairs.precision.keeping_inf``)."""
    feat = tuple(1 + k for k in axes)
    kept = tuple(k for k in range(1, a.ndim) if k not in feat)
    dims = ((feat, feat), (kept, kept))
    highest = {"precision": lax.Precision.HIGHEST}
    dot = lambda p, b, a: lax.dot_general(b, a, dims, **{**highest, **p})  # (*kept, bj, bi)
    return jnp.moveaxis(inf(dot, b, a) if inf else dot({}, b, a), (-2, -1), (0, 1))


def _product(eqn: Any, ins: list[_Value]) -> tuple[_Value, _Value] | None:
    """``(A, B)`` where ``eqn`` sums ``A * B`` (a dot product written out, widened or
    not; ``kernels.unrolled.is_product``, which the engine choice reads too), ``A`` of
    the x rows only and ``B`` of the y rows only."""
    m = _summed(eqn, ins)
    if m is None or m.eqn is None or not is_product(m.eqn) or {v.kind for v in m.ins} != {"x", "y"}:
        return None
    return (m.ins[0], m.ins[1]) if m.ins[0].kind == "x" else (m.ins[1], m.ins[0])


def _guard(v: jax.Array, keep: jax.Array) -> jax.Array:
    """``v`` with 0 where ``keep`` (its shape) is False, and so its
    cotangent (a select's transpose). On the values of padded rows (the reverse pass of
    a ragged tile): a transpose that sums over the rows (an x-only value broadcast over
    the y rows, a dot product) then adds 0, never ``0 * inf`` (NaN) of a padded row's
    value or derivative."""
    return jnp.where(keep, v, jnp.zeros_like(v))


def guarded(keep: tuple[tuple[Any, int], tuple[Any, int]] | None) -> Callable[[str, Any], Any]:
    """``guard(kind, a)``: ``a``, a value of that kind on the tile, with its padded rows
    guarded (:func:`_guard`); ``keep``: the tile's first x row and how many x rows
    there are, the same for y (rows from there on are padding; None: none are). The
    masks are made in each value's own shape (Mosaic TPU reshapes no vector of
    booleans into a column)."""

    def guard(kind: str, a: Any) -> Any:
        if keep is None or kind == "c" or not jnp.issubdtype(a.dtype, jnp.inexact):
            return a
        (x0, n), (y0, m) = keep
        real = lambda axis, start, size: (
            start + lax.broadcasted_iota(jnp.int32, a.shape, axis) < size
        )
        on_y = lambda: real(0, y0, m)
        mask = real(0, x0, n) if kind == "x" else on_y() if kind == "y" else on_y() & real(1, x0, n)
        return _guard(a, mask)

    return guard


def pair_jaxpr(pair: Callable, c: list, x: Any, y: Any) -> Any:
    """``pair(c, xi, yj)`` on one row of ``x`` and of ``y`` (pytrees of rows), traced:
    a jaxpr of ``c``, then the leaves of ``xi`` and of ``yj``, to the leaves of its
    values."""
    xdef, ydef = jax.tree.structure(x), jax.tree.structure(y)
    fun = lambda c, xs, ys: jax.tree.leaves(
        pair(c, jax.tree.unflatten(xdef, xs), jax.tree.unflatten(ydef, ys))
    )
    rows = lambda t: first_row(jax.tree.leaves(t))
    return jax.make_jaxpr(fun)([struct(a) for a in c], rows(x), rows(y))


def prologue_jaxpr(conv: Callable, consts: list, x: Any, y: Any, red: MonoidReduction) -> Any:
    """:func:`pair_jaxpr` of ``red``'s prologue on ``conv(xi, yj, *consts)``: the
    values of a pair that the monoids read."""
    return pair_jaxpr(lambda c, xi, yj: red.prologue(conv(xi, yj, *c)), consts, x, y)


def tile(
    closed: Any,
    c: list,
    xs: list,
    ys: list,
    found: list | None = None,
    keep: tuple[tuple[Any, int], tuple[Any, int]] | None = None,
    on: str = "xla",
    given: dict[int, Any] | None = None,
    made: list | None = None,
    own: list | None = None,
    reverse: bool = False,
) -> list:
    """The values of ``closed`` (a :func:`pair_jaxpr`) on a tile of x rows ``xs`` and
    y rows ``ys`` (leaves, rows first), each a :class:`_Value`: its equations walked,
    each bound on the rows it depends on, and each squared distance between an x-only
    and a y-only vector over :data:`MIN_FEATURES` or more features made by
    :func:`_expanded` (each one's features and whether it was expanded noted in
    ``found``). ``keep`` (:func:`guarded`'s: which x and y rows are real) guards every
    value's padded rows (:func:`_guard`); ``on``: where the tile runs (a ``Layout.on``).

    Every value is appended to ``made`` as it is walked (its number there the same in
    every walk of ``closed``); ``given`` numbers values to take as they are (guarded)
    instead of making them, and what only they read is never made (``pairs.sides``).
    ``own``: the values of ``closed``'s constants (default: its own). ``reverse``: the
    reverse kernel's tiles, whose float32 dots above the default precision on a TPU
    keep their infinities in their cotangents too (reverse mode only:
    ``pairs.precision.keeping_inf_reverse``)."""
    guard, inf = guarded(keep), None
    if on == "tpu":
        inf = keeping_inf_reverse if reverse else keeping_inf
    made = [] if made is None else made
    given = given or {}

    def value(kind: str, make: Callable[[], list], idx: int = 0, eqn: Any = None, ins=()) -> _Value:
        v = _Value(kind, None, make, idx, eqn, tuple(ins))
        if len(made) in given:
            v.val = guard(kind, given[len(made)])
        made.append(v)
        return v

    def rule(eqn: Any, ins: list[_Value]) -> list[_Value]:
        if (product := _product(eqn, ins)) is not None:
            a, b = product
            dtype, axes = eqn.outvars[0].aval.dtype, eqn.params["axes"]
            dot = lambda: _dots(a.get().astype(dtype), b.get().astype(dtype), axes, inf)
            return [value("p", lambda: [guard("p", dot())], ins=(a, b))]
        if (match := _squared_distance(eqn, ins)) is not None:
            a, b, features = match
            if found is not None:
                found.append((features, features >= MIN_FEATURES))
            if features >= MIN_FEATURES:
                dtype, axes = eqn.outvars[0].aval.dtype, eqn.params["axes"]
                d = lambda: _expanded(a.get(), b.get(), axes, dtype, inf)
                return [value("p", lambda: [guard("p", d())], ins=(a, b))]
        kind = _kind(ins)
        make = functools.cache(
            lambda: [
                guard(kind, o)
                for o in (
                    _lift(eqn, ins, kind, on, inf)
                    if kind != "c"
                    else bind(eqn, [v.get() for v in ins])
                )
            ]
        )
        return [value(kind, make, k, eqn, ins) for k in range(len(eqn.outvars))]

    enter = lambda eqn, ins: None if eqn.primitive.name in CUSTOM_DERIVATIVES else subjaxpr(eqn)
    arg = lambda kind, v: value(kind, lambda: [guard(kind, v)])  # (None: never read)
    args = [arg(kind, v) for kind, vs in (("c", c), ("x", xs), ("y", ys)) for v in vs]
    consts = [_Value("c", v) for v in (closed.consts if own is None else own)]
    literal, const = lambda v: _Value("c", v.val), lambda v, c: _Value("c", c)
    return walk(closed.jaxpr, consts, args, rule, literal=literal, const=const, enter=enter)


def outputs(vals: list[_Value], per_y: tuple, bi: int, bj: int, guard: Callable) -> list:
    """The values of a tile as ``kernels.matmul_tiles`` takes them: ``(bj, bi, ...)``,
    or ``(bj, ...)`` where ``per_y`` says."""
    out = []
    for v, own in zip(vals, per_y, strict=True):
        a = v.get()
        if v.kind in "cx":
            a = jnp.broadcast_to(a, (bj, *a.shape))
        if v.kind in "cy" and not own:
            a = jnp.broadcast_to(a[:, None], (bj, bi, *a.shape[1:]))
        out.append(guard("y" if own else "p", a))
    return out


def sources(
    conv: Callable, consts: list, x: Any, y: Any, red: MonoidReduction, layout: Layout
) -> tuple[Callable, list]:
    """``sources(c, x tile leaves, y tile leaves, keep=None)`` of
    ``kernels.matmul_tiles``: each value ``(bj, bi, ...)``, or ``(bj, ...)`` where
    ``layout.per_y`` says (``f`` traced once, here, for every tile); ``keep`` as
    :func:`tile`'s; and the constants to put before ``consts`` in ``c``: the
    jaxpr's own, which a kernel takes as inputs (under ``shard_map`` Pallas refuses
    a captured one)."""
    per_y, on = layout.per_y, layout.on
    closed = prologue_jaxpr(conv, consts, x, y, red)
    k = len(closed.consts)

    def values(c: list, xs: list, ys: list, keep: tuple | None = None) -> list:
        vals = tile(closed, c[k:], xs, ys, keep=keep, on=on, own=c[:k])
        return outputs(vals, per_y, xs[0].shape[0], ys[0].shape[0], guarded(keep))

    return values, list(closed.consts)
