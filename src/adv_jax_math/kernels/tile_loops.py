"""One Pallas kernel looping over tiles: for each tile of an outer axis, a body over
every tile of an inner axis, its outputs combined across the inner tiles (the matmul
tiles' forward pass and both halves of their reverse pass, ``kernels/matmul_tiles.py``).

* ``"gpu"``: a program per outer tile, a loop over the inner tiles inside (the inner
  operands read from global memory), the outputs in registers;
* ``"tpu"``: a grid ``(outer tiles "parallel", inner tiles "arbitrary")``, the
  outputs in their output blocks, which stay in VMEM across the inner tiles (set at
  the first, combined into at the others); and where asked (``across``), outputs of
  the inner tiles: each a whole array in VMEM across the grid (both axes then
  "arbitrary"), a tile's rows summed into at every outer tile (the reverse pass's
  ``dx`` and ``dy`` in one pass).

Every operand is at least 2-D there (Mosaic's blocks): a whole operand of fewer
dimensions as ``(1, n)``, a tiled one of one value per row as ``(rows, 1)``, one per
tile ``(tiles, *s)`` with ``s`` padded to 2-D in front; the body sees each in its own
shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .fused_reduce.kernel import named_jit

__all__ = ["Tiled", "tile_kernel"]


@dataclasses.dataclass(frozen=True)
class Tiled:
    """An operand split into tiles along its leading axis: ``rows`` rows per tile, or
    None: one entry per tile (the leading axis indexes the tiles)."""

    array: Any
    rows: int | None


def _two_d(shape: tuple) -> tuple:
    return (1,) * (2 - len(shape)) + tuple(shape)


def tile_kernel(
    body: Callable[[list, list, list, Any, Any], list],
    combine: Callable[[list, list], list],
    whole: Sequence[Any],
    outer: Sequence[Tiled],
    inner: Sequence[Tiled],
    tiles: tuple[int, int],
    layout: Any,
    name: str,
    across: int = 0,
) -> list:
    """``combine``-d over the inner tiles ``t`` of ``body(whole, outer, inner, i, t)``
    (flat lists of the operands' blocks in their own shapes, the outer tile ``i``),
    for each outer tile: one array per output, its leading axis the outer tiles
    (``tiles``: how many outer and inner tiles; ``layout``: a
    ``pairwise_device.Layout``, its ``on``, ``interpret`` and ``params``). On TPU the
    last ``across`` outputs are the inner tile's (leading axis: its rows), summed over
    the outer tiles: each one array, the inner tiles' rows in order."""
    n_outer, n_inner = tiles
    block = lambda op: (op.rows, *op.array.shape[1:]) if op.rows else op.array.shape[1:]
    w_shapes = [jnp.shape(a) for a in whole]
    o_shapes, i_shapes = [block(op) for op in outer], [block(op) for op in inner]
    ws = [jnp.reshape(a, _two_d(jnp.shape(a))) for a in whole]

    def stored(op: Tiled) -> Any:  # the operand at least 2-D
        a = op.array
        if op.rows:
            return a.reshape(-1, 1) if a.ndim == 1 else a
        return a.reshape(a.shape[0], *_two_d(a.shape[1:]))

    os_, is_ = [stored(op) for op in outer], [stored(op) for op in inner]
    dtype = lambda group: [a.dtype for a in group]
    structs = lambda shapes, dtypes: [
        jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=True)
    ]
    args = (
        structs(w_shapes, dtype(ws)),
        structs(o_shapes, dtype(os_)),
        structs(i_shapes, dtype(is_)),
    )
    outs = jax.eval_shape(lambda w, o, i: body(w, o, i, 0, 0), *args)
    own = len(outs) - across
    assert not across or layout.on == "tpu", "outputs across the outer tiles: TPU only"
    out_shape = [jax.ShapeDtypeStruct((n_outer, *_two_d(s.shape)), s.dtype) for s in outs[:own]]
    rows = lambda s: (n_inner * s.shape[0], *(s.shape[1:] or (1,)))  # at least 2-D
    summed = [jax.ShapeDtypeStruct(rows(s), s.dtype) for s in outs[own:]]
    nw, no, ni = len(ws), len(os_), len(is_)
    split = lambda refs: (
        refs[:nw],
        refs[nw : nw + no],
        refs[nw + no : nw + no + ni],
        refs[nw + no + ni :],
    )

    def read(refs: Sequence[Any], shapes: list, index: Any = ...) -> list:
        return [r[index].reshape(s) for r, s in zip(refs, shapes, strict=True)]

    def write(o_refs: Sequence[Any], values: list) -> None:
        for o, v in zip(o_refs, values, strict=True):
            o[...] = v.reshape(o.shape).astype(o.dtype)

    whole_spec = lambda a: pl.BlockSpec(a.shape, lambda *ij: (0,) * a.ndim)

    def spec(op: Tiled, a: Any, axis: int) -> Any:  # a block per tile of the grid's axis
        if op.rows:
            return pl.BlockSpec(
                (op.rows, *a.shape[1:]), lambda *ij: (ij[axis],) + (0,) * (a.ndim - 1)
            )
        return pl.BlockSpec((None, *a.shape[1:]), lambda *ij: (ij[axis],) + (0,) * (a.ndim - 1))

    if layout.on == "gpu":

        def kernel(*refs: Any) -> None:
            w_refs, o_refs, i_refs, out_refs = split(refs)
            i = pl.program_id(0)
            w, o = read(w_refs, w_shapes), read(o_refs, o_shapes)

            def at(t: Any) -> list:
                rows = [
                    r[pl.ds(t * op.rows, op.rows) if op.rows else pl.ds(t, 1)]
                    for r, op in zip(i_refs, inner, strict=True)
                ]
                return body(w, o, [v.reshape(s) for v, s in zip(rows, i_shapes, strict=True)], i, t)

            step = lambda t, acc: combine(acc, at(t))
            write(out_refs, lax.fori_loop(1, n_inner, step, at(0)) if n_inner > 1 else at(0))

        grid: tuple[int, ...] = (n_outer,)
        inner_specs = [whole_spec(a) for a in is_]
    else:

        def kernel(*refs: Any) -> None:
            w_refs, o_refs, i_refs, out_refs = split(refs)
            i, t = pl.program_id(0), pl.program_id(1)
            w, o, n = read(w_refs, w_shapes), read(o_refs, o_shapes), read(i_refs, i_shapes)
            new = body(w, o, n, i, t)
            mine, theirs = out_refs[:own], out_refs[own:]

            @pl.when(t == 0)
            def _first() -> None:
                write(mine, new[:own])

            @pl.when(t > 0)
            def _next() -> None:
                old = [r[...].reshape(s.shape) for r, s in zip(mine, outs[:own], strict=True)]
                write(mine, combine(old, new[:own]))

            for r, v in zip(theirs, new[own:], strict=True):
                _add_rows(r, v, t, i == 0)

        grid = (n_outer, n_inner)
        inner_specs = [spec(op, a, 1) for op, a in zip(inner, is_, strict=True)]
    in_specs = [whole_spec(a) for a in ws]
    in_specs += [spec(op, a, 0) for op, a in zip(outer, os_, strict=True)]
    in_specs += inner_specs
    out_specs = [
        pl.BlockSpec((None, *s.shape[1:]), lambda *ij, s=s: (ij[0],) + (0,) * (len(s.shape) - 1))
        for s in out_shape
    ] + [whole_spec(s) for s in summed]
    params = layout.params
    if summed and params is not None:  # every outer tile adds to them: in order, one core
        params = dataclasses.replace(params, dimension_semantics=("arbitrary", "arbitrary"))
    call = pl.pallas_call(
        kernel,
        out_shape=[*out_shape, *summed],
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=layout.interpret,
        compiler_params=params,
        name=name,
    )
    out = named_jit(call, name)(*ws, *os_, *is_)
    tiled = [r.reshape(n_outer, *s.shape) for r, s in zip(out[:own], outs[:own], strict=True)]
    return tiled + [r.reshape(-1, *s.shape[1:]) for r, s in zip(out[own:], outs[own:], strict=True)]


def _add_rows(ref: Any, v: jax.Array, t: Any, first: Any) -> None:
    """``v``, the rows of inner tile ``t``, set into ``ref`` (``first``) or added."""
    b = v.shape[0]
    at = pl.ds(pl.multiple_of(t * b, b), b)
    v = v.reshape(b, *ref.shape[1:]).astype(ref.dtype)

    @pl.when(first)
    def _set() -> None:
        ref[at] = v

    @pl.when(jnp.logical_not(first))
    def _add() -> None:
        ref[at] = ref[at] + v
