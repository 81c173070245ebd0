"""``f``'s values on a tile cut where they start to read both rows (the matmul tiles'
reverse pass: ``pairs.matmul``).

The reverse pass sums the cotangents of the one-sided values at the cut over every
tile of the other side before one VJP of that side, as plain JAX's transpose of a
broadcast does: a derivative of an x-only value that is infinite (``|a|^2`` at
``a = inf``) then meets the sum of its cotangents, not one tile's, which can be 0
(``0 * inf``: NaN where plain JAX has +-inf).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..kernels.pairwise_device import Layout
from ..monoids.reduction import MonoidReduction
from .dots import guarded, outputs, prologue_jaxpr, tile
from .kernel import first_row, struct

__all__ = ["Sides", "sides"]


@dataclasses.dataclass(frozen=True)
class Sides:
    """``f``'s values on a tile cut where they start to depend on both rows: ``x(c,
    xs)`` gives the x-only values that the rest reads (of every x row given: the x rows'
    leaves themselves, or values made of them alone, ``|a|^2``), ``y(c, ys)`` the
    y-only ones, and ``pairs(c, bx, by, keep=None)`` the values from a tile of those,
    as :func:`sources`' from a tile of x and y rows (``c``: ``consts``, then the
    constants ``x`` and ``y`` take). ``floats``: per side, which of its values are
    floats (the others have no cotangent).

    The reverse pass sums the cotangents of ``bx`` over every y tile before one VJP of
    ``x`` (and of ``by`` over every x tile), as plain JAX's transpose of a broadcast
    does: a derivative of an x-only value that is infinite (``|a|^2`` at ``a = inf``)
    then meets the sum of its cotangents, not a tile's, which can be 0 (NaN)."""

    x: Callable[[list, list], list]
    y: Callable[[list, list], list]
    pairs: Callable[..., list]
    floats: tuple[tuple[int, ...], tuple[int, ...]]
    consts: list


def sides(
    conv: Callable, consts: list, x: Any, y: Any, red: MonoidReduction, layout: Layout
) -> Sides:
    """:class:`Sides` of ``f``'s values (``layout.per_y`` as :func:`sources`')."""
    per_y, on = layout.per_y, layout.on
    closed = prologue_jaxpr(conv, consts, x, y, red)
    nc, nx = len(consts), len(jax.tree.leaves(x))
    cut: dict[str, list[int]] = {}

    def find(c: list, xs: list, ys: list) -> None:
        made: list = []
        outs = tile(closed, c, xs, ys, made=made, on=on, reverse=True)
        number = {id(v): k for k, v in enumerate(made)}
        ends = {"x": [v for v in outs if v.kind == "x"], "y": [v for v in outs if v.kind == "y"]}
        seen, todo = set(), [v for v in outs if v.kind == "p"]
        while todo:  # the per-pair values made, and what of one side they read
            v = todo.pop()
            if id(v) not in seen:
                seen.add(id(v))
                todo += [u for u in v.ins if u.kind == "p"]
                for kind, vals in ends.items():
                    vals += [u for u in v.ins if u.kind == kind]
        for kind, first in (("x", nc), ("y", nc + nx)):  # never none: a tile's rows
            cut[kind] = sorted({number[id(v)] for v in ends[kind] if id(v) in number} or {first})
        out = [made[k].get() for k in cut["x"] + cut["y"]]
        cut["floats"] = [k for k, a in enumerate(out) if jnp.issubdtype(a.dtype, jnp.inexact)]

    two = lambda t: [jax.ShapeDtypeStruct((2, *a.shape), a.dtype) for a in first_row(t)]
    jax.eval_shape(
        find, [struct(a) for a in consts], two(jax.tree.leaves(x)), two(jax.tree.leaves(y))
    )
    nbx = len(cut["x"])
    nones = lambda t: [None] * len(jax.tree.leaves(t))

    def side(kind: str) -> Callable[[list, list], list]:
        def run(c: list, rows: list) -> list:
            made: list = []
            xs, ys = (rows, nones(y)) if kind == "x" else (nones(x), rows)
            tile(closed, c, xs, ys, made=made, on=on, reverse=True)
            return [made[k].get() for k in cut[kind]]

        return run

    def pairs(c: list, bx: list, by: list, keep: tuple | None = None) -> list:
        given = dict(zip(cut["x"] + cut["y"], bx + by, strict=True))
        k = len(closed.consts)
        vals = tile(
            closed,
            c[k:],
            nones(x),
            nones(y),
            keep=keep,
            on=on,
            given=given,
            own=c[:k],
            reverse=True,
        )
        return outputs(vals, per_y, bx[0].shape[0], by[0].shape[0], guarded(keep))

    floats = cut["floats"]
    split = (tuple(k for k in floats if k < nbx), tuple(k - nbx for k in floats if k >= nbx))
    return Sides(side("x"), side("y"), pairs, split, list(closed.consts))
