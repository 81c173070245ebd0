"""The kernel: ``fun`` on one block of rows plus each leaf's monoid reduction.

Each of the ``cdiv(n, T)`` programs takes a tile of ``T = steps * Bk`` rows of
every input leaf and loops over its blocks: evaluate ``fun``'s jaxpr on ``Bk``
rows, replace rows past ``n`` with the identity, reduce the rows, combine into one
partial per output leaf. The partials are combined by the monoid in XLA.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..._monoid import Monoid
from .interpreter import evaluate
from .targets import KERNEL_NAME, Target, tpu_vmem_limit

__all__ = ["Kernel", "Out", "forward", "kernel_const_aval", "pallas_call"]


@dataclasses.dataclass(frozen=True)
class Out:
    """One output leaf of the fused reduction."""

    monoid: Monoid
    axis: int | None  # 0: reduce the rows only; None: every axis
    trailing: tuple[int, ...]  # shape of one row of the prepared leaf
    acc_dtype: np.dtype  # dtype of partials and of the custom_jvp outputs


@dataclasses.dataclass(frozen=True)
class Kernel:
    """Everything static about one fused call."""

    jaxpr: Any  # prepared fun on a block of ``rows`` rows, constants as constvars
    const_avals: tuple[jax.ShapeDtypeStruct, ...]
    in_avals: tuple[jax.ShapeDtypeStruct, ...]  # full (n, ...) inputs
    outs: tuple[Out, ...]
    n: int
    rows: int  # Bk: rows of fun evaluated at once
    steps: int  # blocks of Bk rows each kernel program reduces in a loop
    chunk_blocks: int  # blocks per step of the tangent scan
    target: Target
    interpret: bool

    @property
    def tile(self) -> int:
        """Rows per kernel program."""
        return self.steps * self.rows

    @property
    def grid(self) -> int:
        return pl.cdiv(self.n, self.tile)


def kernel_const_aval(a: Any) -> jax.ShapeDtypeStruct:
    """0-d constants travel as (1, 1) (no 0-d blocks), bools as int32."""
    shape = tuple(a.shape) or (1, 1)
    dtype = np.dtype(np.int32) if a.dtype == np.bool_ else a.dtype
    return jax.ShapeDtypeStruct(shape, dtype)


def _to_kernel_const(c: Any) -> Any:
    c = jnp.asarray(c)
    if c.dtype == np.bool_:
        c = c.astype(jnp.int32)
    return c.reshape(1, 1) if c.ndim == 0 else c


def _load_const(ref: Any, aval: Any) -> Any:
    value = ref[...]
    if not aval.shape:
        value = value.reshape(())
    if aval.dtype == np.bool_:
        value = value != 0
    return value


def _block_partial(k: Kernel, y: Any, out: Out, first_row: Any) -> Any:
    """Reduce the rows of one block's output leaf, masking rows >= n."""
    y = y.astype(out.acc_dtype)
    if k.n % k.tile:
        y = out.monoid.mask(y, first_row + lax.broadcasted_iota(jnp.int32, y.shape, 0) < k.n)
    return out.monoid.reduce_stable(y, axis=0)


def _partial_shape(out: Out) -> tuple[int, ...]:
    return (1, *(out.trailing or (1,)))


def _compiler_params(k: Kernel) -> Any:
    if k.interpret or k.target.platform == "cpu":
        return None
    if k.target.mosaic:
        from jax.experimental.pallas import tpu as pltpu

        # TPUCompilerParams: older jax (not in this jax's stubs)
        params = getattr(pltpu, "CompilerParams", None) or cast(Any, pltpu).TPUCompilerParams
        return params(vmem_limit_bytes=tpu_vmem_limit(k.target.device_kind))
    from jax.experimental.pallas import triton as pltriton

    biggest = k.rows * max(1, *(math.prod(o.trailing) for o in k.outs))
    biggest = max(biggest, k.rows * max(math.prod(a.shape[1:]) for a in k.in_avals))
    return pltriton.CompilerParams(num_warps=8 if biggest >= 1 << 13 else 4)


def pallas_call(k: Kernel) -> Callable[..., Any]:
    nc, nx = len(k.const_avals), len(k.in_avals)

    def kernel(*refs):
        c_refs, x_refs, o_refs = refs[:nc], refs[nc : nc + nx], refs[nc + nx :]
        consts = [_load_const(r, a) for r, a in zip(c_refs, k.const_avals, strict=True)]
        tile_start = pl.program_id(0) * k.tile  # outside the loop: interpret mode needs that

        def block(j):
            if k.steps == 1:
                start, xs = 0, [r[...] for r in x_refs]
            else:
                start = j * k.rows if isinstance(j, int) else pl.multiple_of(j * k.rows, k.rows)
                xs = [
                    r[(pl.ds(start, k.rows),) + (slice(None),) * (a.ndim - 1)]
                    for r, a in zip(x_refs, k.in_avals, strict=True)
                ]
            ys = evaluate(k.jaxpr, consts, xs, upcast=k.target.triton)
            first_row = tile_start + start
            return [_block_partial(k, y, o, first_row) for y, o in zip(ys, k.outs, strict=True)]

        def step(j, acc):
            new = block(j)
            return [o.monoid.combine_stable(a, b) for o, a, b in zip(k.outs, acc, new, strict=True)]

        parts = block(0)
        if k.steps > 1:
            parts = lax.fori_loop(1, k.steps, step, parts)
        for part, o_ref in zip(parts, o_refs, strict=True):
            o_ref[...] = part.reshape(o_ref.shape)

    def index_map(first, ndim):
        return lambda i: (i if first else 0,) + (0,) * (ndim - 1)

    def whole(shape):
        return pl.BlockSpec(shape, index_map(False, len(shape)))

    def rows(shape):
        return pl.BlockSpec((k.tile, *shape[1:]), index_map(True, len(shape)))

    def partial(out):
        shape = _partial_shape(out)
        return pl.BlockSpec((None, *shape), index_map(True, len(shape) + 1))

    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((k.grid, *_partial_shape(o)), o.acc_dtype) for o in k.outs],
        grid=(k.grid,),
        in_specs=[whole(kernel_const_aval(a).shape) for a in k.const_avals]
        + [rows(a.shape) for a in k.in_avals],
        out_specs=[partial(o) for o in k.outs],
        interpret=k.interpret,
        compiler_params=_compiler_params(k),
        name=KERNEL_NAME,
    )


def forward(k: Kernel, consts: Sequence[Any], leaves: Sequence[Any]) -> list[Any]:
    """The fused kernel plus the XLA combine of its partials (in the acc dtypes)."""
    call = pallas_call(k)

    def kernel_call(*args):
        return call(*args)

    # A named jit makes the kernel visible in lowered text on every platform
    # (``func.func private @adv_jax_math_fused_reduce``), interpret mode included.
    kernel_call.__name__ = kernel_call.__qualname__ = KERNEL_NAME
    partials = jax.jit(kernel_call)(*map(_to_kernel_const, consts), *leaves)
    totals = []
    for p, out in zip(partials, k.outs, strict=True):
        total = out.monoid.reduce_stable(p.reshape(k.grid, *out.trailing), axis=0)
        if out.axis is None and total.ndim:
            total = out.monoid.reduce_stable(total, axis=None)
        totals.append(total)
    return totals
