"""A chunked reduction that is a pairwise one, read from the chunk's jaxpr.

N-body as users write it with :func:`batch_map`: the mapped rows are sources, the
targets a value ``fun`` closes over, and ``fun(sources)`` returns ``(rows, T, ...)``,
summed over the rows::

    batch_map(lambda s: field(targets, s), sources, b,
              reduction=jnp.add, chunk_reduction=jnp.add.reduce)

That is ``out[t] = sum_s f(targets[t], sources[s])``: a pairwise reduction with
``x = targets`` (a constant of the chunk's jaxpr) and ``y`` the mapped rows.
:func:`find` proves it with ``analysis.separable``'s abstract interpretation of the jaxpr the
engines evaluate (``fun`` and the reduction's prologue): the constants tagged x rows
on their axis 0, the chunk's rows tagged y rows; every term must read outputs
``(rows, ..., T, ...)`` whose rows axis is the y rows (or a broadcast) and whose one
axis tagged x rows is that term's result's.

:func:`pair` makes ``f(xi, yj)`` from that jaxpr without tracing ``fun`` again
(its targets are values, not arguments): it evaluates the jaxpr with every axis
tagged x or y rows at size one. Each equation touching those axes is bound again with
its size parameters (``broadcast_in_dim``'s shape, ``reshape``'s sizes, a whole
``slice``) at one row, and operands that are constant along an axis (tagged a
broadcast) are cut to their first element where they meet one row; calls are
entered, and a custom derivative rule on the rows is refused (it cannot be resized).
:func:`evaluate` takes other row counts too: the planner runs a row-local map's chunk
jaxpr on all its rows with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr

from ..core.trace import Traced
from ..monoids.reduction import MonoidReduction
from .jaxpr_graph import CUSTOM_DERIVATIVES, ELEMENTWISE, bind, subjaxpr, walk
from .separable import (
    _SHAPING,
    Tags,
    _fix,
    _Refused,
    _rule,
    _run,
    _shape,
    _signature,
    per_x_row,
)

__all__ = ["Pairing", "evaluate", "find", "pair", "results", "row_tags"]

_ROWS = ("i", "j")


@dataclass(frozen=True)
class Pairing:
    """The constants of the chunk's jaxpr that are ``x`` (their indices; ``n`` rows
    each), and per output of the jaxpr the axis of its x rows (0: not read)."""

    consts: tuple[int, ...]
    n: int
    axes: tuple[int, ...]

    def describe(self, traced: Traced) -> str:
        shapes = [tuple(np.shape(traced.consts[k])) for k in self.consts]
        arrays = " and ".join(f"an array {s}" for s in shapes)
        return f"fun closes over {arrays} whose {self.n} rows pair with the chunk's rows"


def row_tags(v: Any, row: str | None) -> Tags:
    """Axis 0 tagged ``row``, the others untagged (then fixed: size 1 is a broadcast)."""
    shape = _shape(v)
    return _fix((row, *[None] * (len(shape) - 1))[: len(shape)], shape)


def _try(traced: Traced, reduction: MonoidReduction, xs: Sequence[int]) -> Pairing | str:
    jaxpr = traced.jaxpr.jaxpr
    consts = [row_tags(v, "i" if k in xs else None) for k, v in enumerate(jaxpr.constvars)]
    try:
        outs = _run(jaxpr, [row_tags(v, "j") for v in jaxpr.invars], consts)
    except _Refused as e:
        return str(e)
    n = int(np.shape(traced.consts[xs[0]])[0])
    shapes = jax.tree.leaves(traced.out_shape)
    axes: dict[int, int] = {}
    for leaf in reduction.leaves:
        # a term's sources have the x rows on one axis (constant along it: a broadcast)
        at = {outs[s].index("i") for s in leaf.sources if "i" in outs[s]}
        if len(at) != 1:
            return f"{leaf.monoid.name} reads no x rows, or x rows on axes {sorted(at)}"
        p = at.pop()
        for s in leaf.sources:
            tags = outs[s]
            if tags[0] not in ("j", "b") or "j" in tags[1:] or tags[p] not in ("i", "b"):
                return f"output {s} has axes {tags}: the chunk's rows must be axis 0, x rows {p}"
            if shapes[s].shape[p] != n:
                return f"output {s} of shape {shapes[s].shape} has no {n} x rows on axis {p}"
            axes[s] = p
        if leaf.axis != 0:
            return f"{leaf.monoid.name} reduces every axis, not only the rows"
        items = [jax.ShapeDtypeStruct(shapes[s].shape[1:], shapes[s].dtype) for s in leaf.sources]
        why = per_x_row(leaf.monoid, items, [p - 1] * len(items))
        if why:
            return why
    return Pairing(tuple(xs), n, tuple(axes.get(k, 0) for k in range(len(outs))))


def _rows(traced: Traced) -> int:
    return min((_shape(v)[:1] or (0,))[0] for v in traced.jaxpr.jaxpr.invars)


def _one_program(traced: Traced, tail: Traced | None) -> str | None:
    """Why the remainder's jaxpr ``tail`` is not the chunks' at its number of rows (the
    pairs evaluate the chunks' at one row, for every row): ``fun`` computes with its
    chunk's size. Shape-only primitives are not compared at one row, where ``jnp``
    leaves out broadcasts; ``jnp.squeeze`` without an axis shows in the shapes."""
    if tail is None:
        return None
    r = _rows(tail)
    skip = _SHAPING if r == 1 else frozenset()
    shapes = zip(*(jax.tree.leaves(t.out_shape) for t in (traced, tail)), strict=True)
    if _signature(traced.jaxpr.jaxpr, skip) != _signature(tail.jaxpr.jaxpr, skip) or any(
        tuple(b.shape) != (r, *a.shape[1:]) for a, b in shapes
    ):
        return (
            f"fun computes with its chunk's size: its primitives, constants or output "
            f"shapes differ between the chunks ({_rows(traced)} rows) and the remainder ({r})"
        )
    return None


def find(traced: Traced, reduction: MonoidReduction, tail: Traced | None = None) -> Pairing | str:
    """The constants of the prepared chunk jaxpr ``traced`` that pair with its rows
    (see the module docstring), or why none do. Candidates: the constants with at least
    two rows, those with the same number of rows together, then each alone. ``tail``:
    the remainder's jaxpr, which must be the same program (:func:`_one_program`)."""
    if _rows(traced) < 2:
        return "the chunk has fewer than 2 rows: its rows cannot be told from broadcasts"
    why = _one_program(traced, tail)
    if why:
        return why
    rows: dict[int, list[int]] = {}
    for k, c in enumerate(traced.consts):
        if np.ndim(c) and np.shape(c)[0] >= 2:
            rows.setdefault(int(np.shape(c)[0]), []).append(k)
    tries = [tuple(ks) for ks in rows.values()]
    tries += [(k,) for ks in rows.values() if len(ks) > 1 for k in ks]
    tries.sort(key=lambda ks: -sum(np.size(traced.consts[k]) for k in ks))
    whys = []
    for xs in tries:
        found = _try(traced, reduction, xs)
        if isinstance(found, Pairing):
            return found
        whys.append(found)
    return whys[0] if whys else "fun closes over no array with rows"


# -- f(xi, yj): the jaxpr at one row of each -----------------------------------------------


Sizes = dict[str, int]  # rows per tag: "i" (x rows), "j" (y rows)
ONE_PAIR: Sizes = {"i": 1, "j": 1}


def _want(v: Any, tags: Tags, sizes: Sizes) -> tuple[int, ...]:
    return tuple(sizes.get(str(t), n) for t, n in zip(tags, _shape(v), strict=True))


def _fit(value: Any, axis: int, w: int) -> Any:
    """``value`` (a broadcast along ``axis``: constant there) with ``w`` elements on it."""
    if np.shape(value)[axis] == w:
        return value
    first = lax.slice_in_dim(value, 0, 1, axis=axis)
    shape = list(np.shape(value))
    shape[axis] = w
    return jnp.broadcast_to(first, shape)


def _cut(value: Any, want: Sequence[int], skip: Sequence[int] = ()) -> Any:
    """``value`` fitted to ``want`` on each axis but ``skip`` (see :func:`_fit`)."""
    for d, w in enumerate(want):
        value = value if d in skip else _fit(value, d, w)
    return value


def _resized(
    eqn: Any, vals: list, ins: list[Tags], want: list[tuple[int, ...]], sizes: Sizes
) -> tuple:
    """Operands and parameters of ``eqn`` with each axis tagged rows at ``sizes``."""
    name, params = eqn.primitive.name, dict(eqn.params)
    if name in ELEMENTWISE or name in ("add_any", "sort"):
        vals = [v if np.ndim(v) == 0 else _cut(v, want[0]) for v in vals]
    elif name == "concatenate":
        vals = [_cut(v, want[0], skip=[params["dimension"]]) for v in vals]
    elif name == "dot_general":
        (_, _), (lb, rb) = params["dimension_numbers"]
        lhs, rhs = vals
        for k, (u, v) in enumerate(zip(lb, rb, strict=True)):  # batch axes lead the result
            lhs, rhs = _fit(lhs, u, want[0][k]), _fit(rhs, v, want[0][k])
        vals = [lhs, rhs]
    elif name == "broadcast_in_dim":
        params["shape"] = want[0]
    elif name == "reshape":
        params["new_sizes"] = want[0]
    elif name in ("slice", "dynamic_slice"):  # whole along the rows (else refused)
        at = lambda key, start: tuple(
            v if t not in _ROWS else 0 if start else sizes[str(t)]
            for t, v in zip(ins[0], params[key], strict=True)
        )
        if name == "slice":
            params["start_indices"] = at("start_indices", True)
            params["limit_indices"] = at("limit_indices", False)
        else:
            params["slice_sizes"] = at("slice_sizes", False)
    return vals, params


def evaluate(
    jaxpr: Jaxpr,
    consts: list,
    args: list,
    const_tags: list | None,
    arg_tags: list,
    sizes: Sizes = ONE_PAIR,
) -> tuple[list, list[Tags]]:
    """``jaxpr`` with its axes tagged rows at ``sizes`` (default: one row each): (values,
    tags) of its outputs (``const_tags`` None: the constants untagged). Raises
    ``_Refused`` where an equation cannot be resized. Each variable holds a (value,
    tags) pair; a call on the rows is entered, one off them bound as it is."""
    const_tags = const_tags or [(None,) * len(_shape(v)) for v in jaxpr.constvars]
    paired = lambda vs, xs, ts: [
        (x, _fix(t, _shape(v))) for v, x, t in zip(vs, xs, ts, strict=True)
    ]
    touched = lambda ins: any(t in _ROWS for _, ts in ins for t in ts)

    def enter(eqn: Any, ins: list) -> ClosedJaxpr | None:
        body = subjaxpr(eqn) if touched(ins) else None
        if body is not None and eqn.primitive.name in CUSTOM_DERIVATIVES:
            raise _Refused(f"{eqn.primitive.name} on rows: its derivative rule is not resized")
        return body

    def rule(eqn: Any, ins: list) -> list:
        vals, tags = [value for value, _ in ins], [t for _, t in ins]
        body = subjaxpr(eqn)
        outs_t = _rule(eqn, tags) if body is None else _run(body.jaxpr, tags)
        want = [_want(v, t, sizes) for v, t in zip(eqn.outvars, outs_t, strict=True)]
        params = eqn.params
        if touched(ins):
            vals, params = _resized(eqn, vals, tags, want, sizes)
        outs = bind(eqn, vals, params)
        for o, w in zip(outs, want, strict=True):
            if tuple(np.shape(o)) != w:
                raise _Refused(f"{eqn.primitive.name} makes {np.shape(o)}, not {w}")
        return paired(eqn.outvars, outs, outs_t)

    ends = paired(jaxpr.constvars, consts, const_tags), paired(jaxpr.invars, args, arg_tags)
    literal, const = lambda v: (v.val, row_tags(v, None)), lambda v, c: (c, row_tags(v, None))
    outs = walk(jaxpr, *ends, rule, literal=literal, const=const, enter=enter)
    return [value for value, _ in outs], [t for _, t in outs]


def pair(traced: Traced, reduction: MonoidReduction, found: Pairing) -> Any:
    """``f(xi, yj)`` for :func:`~adv_jax_math.pairs.api.pairwise`: ``xi`` the rows of the x
    constants (a list), ``yj`` a row of each input leaf; returns one value per term of
    ``reduction`` (a tuple of its sources' for a term reading several)."""
    jaxpr, xs, leaves = traced.jaxpr.jaxpr, set(found.consts), reduction.leaves
    const_tags = [row_tags(v, "i" if k in xs else None) for k, v in enumerate(jaxpr.constvars)]
    arg_tags = [row_tags(v, "j") for v in jaxpr.invars]

    def f(xi: list, yj: list) -> list:
        consts = list(traced.consts)
        for k, row in zip(found.consts, xi, strict=True):
            consts[k] = row[None]
        outs, _ = evaluate(jaxpr, consts, [r[None] for r in yj], const_tags, arg_tags)
        at = lambda o, axis: lax.index_in_dim(o[0], 0, axis - 1, keepdims=False)
        terms = [tuple(at(outs[s], found.axes[s]) for s in leaf.sources) for leaf in leaves]
        return [t[0] if len(t) == 1 else t for t in terms]

    return f


def results(reduction: MonoidReduction, found: Pairing, per_row: list) -> Any:
    """The chunked call's result from :func:`~adv_jax_math.pairs.api.pairwise`'s (a list, one entry
    per term: its result per x row, stacked on axis 0)."""
    out = []
    for leaf, value in zip(reduction.leaves, per_row, strict=True):
        axis = found.axes[leaf.source] - 1
        put = lambda r, s, axis=axis: jnp.moveaxis(r, 0, axis).astype(s.dtype).reshape(s.shape)
        out.append(jax.tree.map(put, value, leaf.out))
    return reduction.finish(out)
