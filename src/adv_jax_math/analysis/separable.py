"""Whether a blockwise function is a pairwise one, read from its jaxpr.

Users write a pairwise reduction per chunk: ``g(yc, xc)`` takes ``bj`` rows of ``y``
and ``bi`` rows of ``x`` (pytrees, rows on axis 0) and returns leaves ``(bj, bi, *rest)``
(or ``(bj, *rest)``, the same for every x row: a softmax's values). A pairwise engine
evaluates one pair at a time instead, which is only right when element ``[b, a, ...]``
of every output is a function of y row ``b`` and x row ``a`` alone (and of
constants): not of other rows, nor of the positions ``a`` and ``b`` themselves.
:func:`read_blocks` proves it by an abstract interpretation of
``jax.make_jaxpr(g)(y, x)`` that tags every axis of every value:

* ``"i"``: the axis runs over x rows: the elements at index ``a`` along it depend on
  x row ``a`` and on no other x row;
* ``"j"``: the same for y rows;
* ``"b"``: the value is constant along the axis (a broadcast; every size-1 axis);
* ``None``: the value varies along the axis, but reads no row of x or y through it
  (a feature axis, an ``iota``, a closed-over table).

Invariant: a value depends on x only through its ``"i"`` axis (at most one), and not
at all without one; likewise y and ``"j"``. The inputs are ``("i", None, ...)`` (x
leaves) and ``("j", None, ...)`` (y leaves), constants all ``None``; each primitive
maps its operands' tags to its results' or refuses, naming itself: a reduction, cumsum,
sort, reversal or slice along x or y rows, x rows meeting a position-dependent axis
(``kernel + arange``) or y rows on one axis (a diagonal), a loop, a gather or any
primitive without a rule that reads rows (one that reads none makes constants). The
outputs must have y rows on axis 0 and x rows on axis 1 or nowhere (``"b"`` in place
of either: constant along those rows), with no other ``"i"`` or ``"j"``.

The proof holds for the jaxpr traced (at least 2 rows of each); the pairs are that
jaxpr evaluated at one row each (``analysis.pair_rows.evaluate``), not ``g`` traced again. A
``g`` that computes with its blocks' sizes is refused, as the program as written may
call it on other sizes than the ones traced: its primitives or literals differ
between blocks one row larger, or at one row each (where ``jnp`` leaves out
broadcasts, so shape-only primitives are not compared, and ``jnp.squeeze`` without an
axis shows in the outputs' shapes). A Python branch on the sizes that every size
traced takes alike is not seen.

The same tags prove a monoid's result laid out per x row (:func:`per_x_row`): a
reading that replaces blocks by pairs stacks each x row's result on the x rows' axis,
which a top-k (its k slots first) or a softmax-weighted sum of values with x rows (each
x row's scores weigh every x row's values) do not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from ..core.trace import fresh_jaxpr
from ..monoids.base import Monoid, index_dtype
from .jaxpr_graph import ELEMENTWISE, IDENTITY, subjaxpr, walk

__all__ = ["Blocks", "per_x_row", "read_blocks"]

Tags = tuple[str | None, ...]
_ROWS = {"i": "x rows", "j": "y rows"}
_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and"})
_REDUCE |= {"reduce_or", "argmax", "argmin"}
# primitives mixing the elements along one axis (param naming it; top_k: last by default)
_ALONG = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis"}
_ALONG |= {"cumlogsumexp": "axis", "sort": "dimension", "top_k": "axis"}


class _Refused(Exception):
    """Why the jaxpr does not show ``g`` pairwise."""


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(v.aval.shape)


def _fix(tags: Sequence[str | None], shape: Sequence[int]) -> Tags:
    """``tags`` with the untagged size-1 axes marked broadcasts."""
    return tuple("b" if n == 1 and t is None else t for t, n in zip(tags, shape, strict=True))


def _once(name: str, tags: Tags) -> Tags:
    for t, rows in _ROWS.items():
        if tags.count(t) > 1:
            raise _Refused(f"{name} puts {rows} on two axes")
    return tags


def _merge(name: str, operands: Sequence[Tags]) -> Tags:
    """Per-axis tags of an elementwise combination (rank-0 operands broadcast)."""
    out: list[str | None] = []
    for axis in zip(*(t for t in operands if t), strict=True):
        row = [t for t in _ROWS if t in axis]
        if len(row) == 2:
            raise _Refused(f"{name} puts x rows and y rows on one axis")
        if row and None in axis:
            raise _Refused(f"{name} meets {_ROWS[row[0]]} with a position-dependent axis")
        out.append(row[0] if row else None if None in axis else "b")
    return _once(name, tuple(out))


def _spare(name: str, tags: Tags, axes: Sequence[int], verb: str) -> None:
    """Refuse when one of ``axes`` is tagged with rows."""
    for d in axes:
        if tags[d] in _ROWS:
            raise _Refused(f"{name} {verb} {_ROWS[str(tags[d])]} (axis {d})")


def _reshape(tags: Tags, old: Sequence[int], new: Sequence[int]) -> Tags:
    """A tagged axis survives when one new axis has its size and the same elements before."""
    out: list[str | None] = [None] * len(new)
    for d, t in enumerate(tags):
        before = math.prod(old[:d])
        to = [e for e, n in enumerate(new) if n == old[d] and math.prod(new[:e]) == before]
        if t is not None and old[d] > 1 and to:
            out[to[0]] = t
        elif t in _ROWS:
            raise _Refused(f"reshape merges or splits {_ROWS[t]}")
    return tuple(out)


def _rule(eqn: Any, ins: list[Tags]) -> list[Tags]:
    """The tags of ``eqn``'s results from its operands' (see the module docstring);
    not for a call (:func:`_run` walks its body)."""
    name, p, n_out = eqn.primitive.name, eqn.params, len(eqn.outvars)
    old = _shape(eqn.invars[0]) if eqn.invars else ()
    new = _shape(eqn.outvars[0]) if eqn.outvars else ()
    a = ins[0] if ins else ()
    if name in IDENTITY:
        return ins[:n_out]
    if name in ELEMENTWISE or name == "add_any":
        return [_merge(name, ins)] * n_out
    if name == "broadcast_in_dim":
        out: list[str | None] = ["b"] * len(new)
        for d, (t, e) in enumerate(zip(a, p["broadcast_dimensions"], strict=True)):
            if old[d] == 1 and new[e] > 1:
                _spare(name, a, [d], "stretches")
                t = "b"
            out[e] = t
        return [tuple(out)]
    if name == "reshape" and p.get("dimensions") is None:
        return [_reshape(a, old, new)]
    if name == "squeeze":
        axes = [d % len(a) for d in p["dimensions"]]
        _spare(name, a, axes, "drops")
        return [tuple(t for d, t in enumerate(a) if d not in axes)]
    if name == "expand_dims":
        out = list(a)
        for d in sorted(d % len(new) for d in p["dimensions"]):
            out.insert(d, "b")
        return [tuple(out)]
    if name == "transpose":
        return [tuple(a[d] for d in p["permutation"])]
    if name in _REDUCE:
        _spare(name, a, p["axes"], "reduces over")
        return [tuple(t for d, t in enumerate(a) if d not in p["axes"])]
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        lhs, rhs = ins
        _spare(name, lhs, lc, "contracts")
        _spare(name, rhs, rc, "contracts")
        batch = [_merge(name, [(lhs[u],), (rhs[v],)])[0] for u, v in zip(lb, rb, strict=True)]
        free = [t for d, t in enumerate(lhs) if d not in (*lc, *lb)]
        free += [t for d, t in enumerate(rhs) if d not in (*rc, *rb)]
        return [_once(name, (*batch, *free))]
    if name in ("slice", "dynamic_slice", "split"):
        if name == "slice":
            steps = p["strides"] or (1,) * len(a)
            part = zip(p["start_indices"], p["limit_indices"], steps, old, strict=True)
            cut = [d for d, (s, e, k, n) in enumerate(part) if (s, e, k) != (0, n, 1)]
        elif name == "dynamic_slice":
            cut = [d for d, (k, n) in enumerate(zip(p["slice_sizes"], old, strict=True)) if k != n]
        else:
            cut = [p["axis"]]
        _spare(name, a, cut, "takes part of")
        return [a] * n_out
    if name == "rev":
        _spare(name, a, p["dimensions"], "reverses")
        return [a]
    if name == "pad":
        moved = [d for d, c in enumerate(p["padding_config"]) if tuple(c) != (0, 0, 0)]
        _spare(name, a, moved, "pads")
        return [tuple(None if d in moved else t for d, t in enumerate(a))]
    if name in ("concatenate", "stack"):  # stack: a new axis
        k = p["dimension" if name == "concatenate" else "axis"]
        if name == "concatenate":
            for op in ins:
                _spare(name, op, [k], "concatenates along")
            ins = [op[:k] + op[k + 1 :] for op in ins]
        rest = _merge(name, ins)
        return [(*rest[:k], None, *rest[k:])]
    if name == "unstack":
        _spare(name, a, [p["axis"]], "takes part of")
        return [a[: p["axis"]] + a[p["axis"] + 1 :]] * n_out
    if name in _ALONG:
        k = p.get(_ALONG[name], len(a) - 1)
        for op in ins:
            _spare(name, op, [k], "runs along")
        out = list(_merge(name, ins))
        out[k] = None
        return [tuple(out)] * n_out
    if name == "iota":
        return [tuple(None if d == p["dimension"] else "b" for d in range(len(new)))]
    read = sorted({_ROWS[t] for tags in ins for t in tags if t in _ROWS})
    if read:
        raise _Refused(f"{name} reads {' and '.join(read)}: no rule follows rows through it")
    if eqn.effects:
        raise _Refused(f"{name} has effects")
    return [(None,) * len(_shape(v)) for v in eqn.outvars]  # of constants: they read no row


def _run(jaxpr: Jaxpr, args: Sequence[Tags], consts: Sequence[Tags] | None = None) -> list[Tags]:
    """The tags of ``jaxpr``'s outputs from its inputs' and its constants' (default:
    untagged), calls entered."""
    untagged = lambda v, *_: _fix((None,) * len(_shape(v)), _shape(v))
    if consts is None:
        consts = [(None,) * len(_shape(v)) for v in jaxpr.constvars]
    fixed = lambda vs, ts: [_fix(t, _shape(v)) for v, t in zip(vs, ts, strict=True)]
    rule = lambda eqn, ins: fixed(eqn.outvars, _rule(eqn, ins))
    return walk(jaxpr, fixed(jaxpr.constvars, consts), args, rule, literal=untagged, const=untagged)


def _rows(tree: Any, what: str) -> int:
    counts = {leaf.shape[0] if len(leaf.shape) else 0 for leaf in jax.tree.leaves(tree)}
    if len(counts) != 1 or min(counts) < 2:
        raise _Refused(f"{what} leaves need one number of rows on axis 0, at least 2: {counts}")
    return counts.pop()


def _at(tree: Any, rows: int) -> Any:
    """``tree``'s avals with ``rows`` rows."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype), tree)


def _signature(jaxpr: Jaxpr, skip: frozenset = frozenset()) -> list:
    """The primitives of ``jaxpr`` (calls entered; those in ``skip`` left out) and its
    literals' values: the same for two block sizes unless ``g`` computes with its
    sizes (``x / xc.shape[0]``; a Python branch on them)."""
    out: list = []
    for eqn in jaxpr.eqns:
        body = subjaxpr(eqn)
        if eqn.primitive.name not in skip:
            out.append(eqn.primitive.name)
            out += [repr(v.val) for v in eqn.invars if isinstance(v, Literal)]
        out += _signature(body.jaxpr, skip) if body is not None else []
    return out


# what jnp adds or leaves out at one row (a broadcast of (1, 1, d) to itself), and
# ``jnp.squeeze`` without an axis: compared by the output shapes instead
_SHAPING = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims"})


@dataclass(frozen=True)
class Blocks:
    """``g(yc, xc)`` read as blocks of pairs: its jaxpr at ``bj`` x ``bi`` rows (inputs:
    the ``n_y`` leaves of ``y``, then those of ``x``), its output avals (a pytree) and,
    per output leaf, the axis of its x rows: 1, or None where the leaf does not vary
    with them (its y rows are axis 0)."""

    closed: ClosedJaxpr
    shapes: Any
    x_axes: tuple[int | None, ...]
    n_y: int


def _x_axis(shape: tuple, tags: Tags, grown_y: tuple, grown_x: tuple) -> int | str | None:
    """The axis of x rows of an output leaf (None: it has none) from its tags and its
    shapes at blocks one row larger (y, then x); or why it is no block of pairs."""
    if not len(shape) == len(grown_y) == len(grown_x) >= 1:
        return "changes its rank with the blocks' sizes"
    moved = lambda other: [d for d, (a, b) in enumerate(zip(shape, other, strict=True)) if a != b]
    on_y, on_x = moved(grown_y), moved(grown_x)
    if on_y != [0] or tags[0] not in ("j", "b") or "j" in tags[1:]:
        return f"has axes {tags}: y rows must be axis 0, and no other axis"
    if on_x == [1] and tags[1] in ("i", "b") and "i" not in tags[2:]:
        return 1
    if not on_x and "i" not in tags:
        return None
    return f"has axes {tags}: x rows must be axis 1 (or absent), and no other axis"


def read_blocks(g: Callable, y: Any, x: Any, also: Sequence[tuple[int, int]] = ()) -> Blocks | str:
    """``g``'s blocks as pairs (:class:`Blocks`) when the jaxpr of ``g(y, x)`` shows
    that each output leaf is ``(bj, bi, *rest)`` (or ``(bj, *rest)``: no x rows) with
    element ``[b, a, ...]`` a function of y row ``b`` and x row ``a`` alone (and of
    values ``g`` closes over), and that ``g`` does not compute with its blocks' sizes:
    its primitives and constants are the same at blocks one row larger, and at blocks
    of one row each and the sizes ``also`` (``(bj, bi)`` pairs: other blocks the
    program as written evaluates) the same but for shape-only primitives, with outputs
    of those numbers of rows. Else why not, naming the first primitive (or output) that
    breaks it.
    ``y``, ``x``: pytrees of arrays or ``jax.ShapeDtypeStruct`` with ``bj`` and ``bi``
    rows first (errors tracing ``g`` at these sizes propagate).

    >>> import jax.numpy as jnp
    >>> y, x = jnp.zeros((4, 3)), jnp.zeros((2, 3))
    >>> read_blocks(lambda yc, xc: (yc @ xc.T, yc), y, x).x_axes
    (1, None)
    >>> read_blocks(lambda yc, xc: yc @ (xc - xc.mean(0)).T, y, x)
    'reduce_sum reduces over x rows (axis 0)'
    """
    try:
        bj, bi = _rows(y, "y"), _rows(x, "x")
        closed, shapes = fresh_jaxpr(g, y, x, return_shape=True)
        args = [
            (row, *[None] * (len(leaf.shape) - 1))
            for row, tree in (("j", y), ("i", x))
            for leaf in jax.tree.leaves(tree)
        ]
        ins = [_fix(t, _shape(v)) for t, v in zip(args, closed.jaxpr.invars, strict=True)]
        outs = _run(closed.jaxpr, ins)
    except _Refused as e:
        return str(e)
    sizes = "g computes with its blocks' sizes (its primitives or constants differ between"
    grown = []
    for yy, xx in ((_at(y, bj + 1), x), (y, _at(x, bi + 1))):
        other, out = fresh_jaxpr(g, yy, xx, return_shape=True)
        if _signature(other.jaxpr) != _signature(closed.jaxpr):
            other_rows = f"{_rows(yy, 'y')} x {_rows(xx, 'x')}"
            return f"{sizes} blocks of {bj} x {bi} rows and of {other_rows})"
        grown.append(jax.tree.leaves(out))
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    parts = zip(flat, outs, *grown, strict=True)
    axes = []
    for k, ((path, leaf), tags, sy, sx) in enumerate(parts):
        p = _x_axis(tuple(leaf.shape), tags, tuple(sy.shape), tuple(sx.shape))
        if isinstance(p, str):
            return f"output {jax.tree_util.keystr(path) or k} of shape {leaf.shape} {p}"
        axes.append(p)
    for rows_y, rows_x in sorted({(1, 1), *also} - {(bj, bi)}):
        try:
            other, out = fresh_jaxpr(g, _at(y, rows_y), _at(x, rows_x), return_shape=True)
        except Exception as e:  # a block function that fails at a size the program uses
            return f"g fails on blocks of {rows_y} x {rows_x} rows: {type(e).__name__}: {e}"[:300]
        if _signature(other.jaxpr, _SHAPING) != _signature(closed.jaxpr, _SHAPING):
            return f"{sizes} blocks of {bj} x {bi} rows and of {rows_y} x {rows_x})"
        want = [
            (rows_y, *(rows_x if d == p else n for d, n in enumerate(s.shape[1:], 1)))
            for s, p in zip(jax.tree.leaves(shapes), axes, strict=True)
        ]
        got = [tuple(s.shape) for s in jax.tree.leaves(out)]
        if got != want:
            return f"g's outputs are {got} on blocks of {rows_y} x {rows_x} rows, not {want}"
    return Blocks(closed, shapes, tuple(axes), len(jax.tree.leaves(y)))


def per_x_row(monoid: Monoid, items: Sequence[Any], x_axes: Sequence[int | None]) -> str | None:
    """Why ``monoid``'s result over rows whose items (one aval per leaf it reads, the
    rows left out) hold x rows on axis ``x_axes[k]`` (None: that leaf is the same for
    every x row) is not, on that same axis, its result for each x row alone, stacked;
    None when it is. Shown by the shapes (each result leaf that of one x row with the x
    rows inserted), then by the tags of the jaxpr of ``fold``, ``merge`` and
    ``finalize``: result element ``a`` along that axis reads x row ``a`` alone (a
    top-k puts its k slots first; a softmax-weighted sum whose values have x rows
    weighs every x row's values by each x row's scores)."""
    name = f"{monoid.name}'s result is not laid out per x row"
    qs = {q for q in x_axes if q is not None}
    if len(qs) != 1:
        return f"{name}: it reads x rows on axes {sorted(qs)} of its leaves' rows, not one"
    q = qs.pop()
    n = next(it.shape[q] for it, a in zip(items, x_axes, strict=True) if a is not None)
    cut = lambda s: jax.ShapeDtypeStruct((*s.shape[:q], *s.shape[q + 1 :]), s.dtype)
    one = [it if a is None else cut(it) for it, a in zip(items, x_axes, strict=True)]
    result = lambda its: jax.tree.leaves(
        jax.eval_shape(lambda: monoid.finalize(monoid.init(its), its))
    )
    try:
        shapes = list(zip(result(one), result(items), strict=True))
    except (TypeError, ValueError) as e:  # the monoid refuses one x row's items
        return f"{name}: {e}"
    for a, b in shapes:
        want = (*a.shape[:q], n, *a.shape[q:])
        if tuple(b.shape) != want:
            return (
                f"{name}: its result {tuple(b.shape)} is not {want}, one x row's {a.shape} stacked"
            )
    rows = [jax.ShapeDtypeStruct((2, *it.shape), it.dtype) for it in items]

    def folded(*ys: Any) -> Any:
        state = monoid.fold(list(ys), jnp.arange(2, dtype=index_dtype()), None)
        return monoid.finalize(monoid.merge(state, state), items)

    closed = fresh_jaxpr(folded, *rows)
    tag = lambda r, a: _fix(
        tuple("i" if a is not None and d == a + 1 else None for d in range(len(r.shape))), r.shape
    )
    try:
        outs = _run(closed.jaxpr, [tag(r, a) for r, a in zip(rows, x_axes, strict=True)])
    except _Refused as e:
        return f"{name}: {e}"
    for tags in outs:
        if tags[q] not in ("i", "b") or "i" in tags[:q] + tags[q + 1 :]:
            return f"{name}: its result's axes are {tags}, x rows must be axis {q}"
    return None
