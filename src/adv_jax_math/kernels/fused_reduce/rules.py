"""What the kernel supports: static rules on inputs, dtypes and array sizes, from
``fun``'s jaxpr traced on a small block."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..._jaxpr_graph import ELEMENTWISE
from ..._trace import sub_jaxprs
from .blocks import is_pow2
from .targets import Target

__all__ = ["Analysis", "analyze", "dtype_problem", "triton_size_problem"]


def _all_avals(jaxpr: Any) -> Iterator[Any]:
    """Every array aval in ``jaxpr`` and its sub-jaxprs (inputs, intermediates, outputs)."""
    for v in (*jaxpr.constvars, *jaxpr.invars):
        yield v.aval
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield v.aval
        for sub in sub_jaxprs(eqn.params):
            yield from _all_avals(sub)


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What the kernel needs to know about ``fun`` traced on a block of ``rows``."""

    row_elems: int  # elements per row of the largest row-mapped array
    row_bytes: int  # bytes per row of the largest row-mapped array
    fixed_elems: int  # elements of the largest array without a row axis
    avals: tuple[tuple[tuple[int, ...], np.dtype], ...]  # every (shape, dtype) in the body
    elementwise: bool  # every operation is elementwise (nothing to keep live across ops)


def analyze(jaxpr: Any, rows: int) -> Analysis:
    row_elems = row_bytes = fixed = 1
    avals = []
    elementwise = all(eqn.primitive.name in ELEMENTWISE for eqn in jaxpr.eqns)
    for a in _all_avals(jaxpr):
        shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
        if shape is None or dtype is None:
            continue
        shape = tuple(int(d) for d in shape)
        avals.append((shape, np.dtype(dtype)))
        size = math.prod(shape)
        if rows in shape:
            per_row = max(1, size // rows)
            row_elems = max(row_elems, per_row)
            row_bytes = max(row_bytes, per_row * np.dtype(dtype).itemsize)
        else:
            fixed = max(fixed, size)
    return Analysis(row_elems, row_bytes, fixed, tuple(avals), elementwise)


def dtype_problem(target: Target, dtypes: Sequence[Any], where: str) -> str | None:
    if target.platform == "cpu":
        return None
    for dt in map(np.dtype, dtypes):
        if jnp.issubdtype(dt, jnp.complexfloating):
            return f"{target.label} kernels do not support complex types ({dt.name} in {where})"
        if target.mosaic and dt.itemsize == 8:
            return (
                f"TPU kernels do not support 64-bit types ({dt.name} in {where}); "
                "use 32-bit inputs or disable jax_enable_x64"
            )
    return None


def _fmt_shape(shape: Sequence[int], dtype: Any, rows: int) -> str:
    dims = ", ".join("Bk" if d == rows else str(d) for d in shape)
    return f"{np.dtype(dtype).name}[{dims}]"


def triton_size_problem(target: Target, analysis: Analysis, rows: int) -> str | None:
    for shape, dtype in analysis.avals:
        if not is_pow2(math.prod(shape)):
            return (
                "Triton needs every array in the kernel to have a power-of-two size, but fun "
                f"makes {_fmt_shape(shape, dtype, rows)} for a block of Bk rows; pad trailing "
                "axes to a power of two (e.g. (N, 3) -> (N, 4)) or split them into separate leaves"
            )
    assert target.max_elems is not None  # set on the Triton targets
    if max(analysis.fixed_elems, analysis.row_elems) > target.max_elems:
        big = max(analysis.fixed_elems, analysis.row_elems)
        return (
            f"fun makes an array of {big} elements per block row or constant, over Triton's "
            f"limit of {target.max_elems} elements per array"
        )
    return None
