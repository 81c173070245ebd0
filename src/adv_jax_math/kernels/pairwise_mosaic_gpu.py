"""The pairwise tile kernel on Pallas Mosaic GPU (Hopper and newer): ``plgpu.kernel``.

The tiles of ``pairwise_device`` (``bj`` y rows down, ``bi`` x rows across, ``f``'s
features unrolled) with their layouts set by hand (Lane semantics, DESIGN.md §10):
every value is a ``(bj, bi)`` tile in the WGMMA layout (``bj`` a multiple of 64, the
rows of a warpgroup's four warps; ``bi`` a multiple of 8); each feature of ``y`` is a
vector of the tile's rows broadcast across it, each feature of ``x`` a vector of its
columns broadcast down it; a fold over the tile's y rows reduces across the warps
(through shared memory) into one state per x row, in the x vectors' layout.

One program (a warpgroup) per x tile reads its x features once and the first y tile
from global memory; ``plgpu.emit_pipeline`` streams the other y tiles (TMA copies,
two in flight), each folded and merged into the states it carries; the states go
out through shared memory. Operations Mosaic GPU cannot lower are rewritten
(``fused_reduce.interpreter.portable``). On CPU the kernel runs in Mosaic GPU's
interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .fused_reduce.interpreter import portable
from .fused_reduce.mosaic_gpu import AXIS

__all__ = ["TILE_ROWS", "mosaic_gpu_tiles", "tile_ops"]

TILE_ROWS = 64  # bj: a multiple of the WGMMA layout's 64 rows (a warpgroup's warps)


def _layouts() -> tuple[Any, Any, Any]:
    """The tile's layout, a y vector's (one value per tile row) and an x vector's (one
    per tile column)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tile = plgpu.Layout.WGMMA
    return tile, tile.reduce(1), tile.reduce(0)


def tile_ops(shape: tuple[int, int]) -> tuple[Callable[..., Any], Callable[[Any], Any]]:
    """``lax.broadcasted_iota`` over a tile of ``shape``, and a value made a whole tile,
    both in the tile's layout."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    layout = _layouts()[0]

    def full(e: Any) -> Any:
        e = jnp.asarray(e)
        return e if e.shape == shape else plgpu.layout_cast(jnp.broadcast_to(e, shape), layout)

    iota = lambda dtype, shape, dim: plgpu.broadcasted_iota(dtype, shape, dim, layout=layout)
    return iota, full


def mosaic_gpu_tiles(
    tile: Callable[..., list],
    merge: Callable[[list, list], list],
    consts: list,
    x_rows: list,
    y_rows: list,
    tiles: tuple[int, int],
    counts: tuple[int, int],
    out_avals: list,
    treedef: Any,
    interpret: bool,
    name: str,
) -> list:
    """Every x row's states, each leaf (``out_avals``: one tile's, ``(bi,)``) a vector
    of every x row. ``tile(c_vals, x_vals, y_vals, start)``: the states of one tile in
    the structure ``treedef`` (x and y values whole ``(bj, bi)`` tiles, ``start`` the
    tile's first y row); ``merge``: two tiles' merged; ``consts``: flat vectors;
    ``x_rows``, ``y_rows``: every feature as a vector of ``counts`` whole tiles of rows."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    (bi, bj), (xt, yt) = tiles, counts
    _, row, col = _layouts()
    nc, nx, ny = len(consts), len(x_rows), len(y_rows)
    across = lambda v, dims: lax.broadcast_in_dim(v, (bj, bi), dims)

    def body(*refs: Any) -> None:
        c_refs, x_refs, y_refs = refs[:nc], refs[nc : nc + nx], refs[nc + nx : nc + nx + ny]
        o_refs, staged = refs[nc + nx + ny : -len(out_avals)], refs[-len(out_avals) :]
        program = lax.axis_index(AXIS)
        c_vals = [r[0, i] for r in c_refs for i in range(r.shape[1])]
        xs = [
            across(plgpu.load(r.at[pl.ds(program * bi, bi)], layout=col, optimized=False), [1])
            for r in x_refs
        ]
        y_tile = lambda blocks: [across(plgpu.load(b, layout=row), [0]) for b in blocks]
        first = y_tile([r.at[pl.ds(0, bj)] for r in y_refs]) if ny else []
        # every state per x row in the x vectors' layout (a merge may make one from
        # constants, and a loop's carry keeps its layout)
        placed = lambda states: [
            plgpu.layout_cast(v, col) if v.shape == (bi,) else v for v in jax.tree.leaves(states)
        ]
        states = placed(portable(tile, c_vals, xs, first, 0))
        if yt > 1:
            folded = lambda carry, *a: merge(jax.tree.unflatten(treedef, carry), tile(*a))

            def step(index: tuple, *blocks: Any) -> list:
                *ys, carry = blocks
                start = (index[0] + 1) * bj
                return placed(portable(folded, carry, c_vals, xs, y_tile(ys), start))

            states = plgpu.emit_pipeline(
                step,
                grid=(yt - 1,),
                in_specs=[plgpu.BlockSpec((bj,), lambda t: (t + 1,))] * ny,
                init_carry=states,
                max_concurrent_steps=min(2, yt - 1),
            )(*y_refs)
        for o, s, v in zip(o_refs, staged, states, strict=True):
            s[...] = v.astype(s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s, o.at[pl.ds(program * bi, bi)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((xt * bi,), a.dtype) for a in out_avals],
        grid=(xt,),
        grid_names=(AXIS,),
        kernel_name=name,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        scratch_types=[plgpu.SMEM((bi,), a.dtype) for a in out_avals],
    )
    return list(kernel(*(c.reshape(1, -1) for c in consts), *x_rows, *y_rows))
