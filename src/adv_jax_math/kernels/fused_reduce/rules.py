"""What the kernel supports: static rules on inputs, dtypes and array sizes, from
``fun``'s jaxpr traced on a small block."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ...analysis.jaxpr_graph import ELEMENTWISE, graph, row_local
from ...core.targets import Target
from ...core.trace import sub_jaxprs
from .blocks import is_pow2, tpu_padded_bytes

__all__ = [
    "Analysis",
    "analyze",
    "block_constants",
    "dtype_problem",
    "empty_problem",
    "held_across_reductions",
    "live_at_peak",
    "mosaic_gpu_features_problem",
    "mosaic_gpu_missing",
    "mosaic_problem",
    "triton_size_problem",
]


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


def empty_problem(shapes: Sequence[tuple[str, Sequence[int]]]) -> str | None:
    """Why the kernel cannot take an array of one of ``shapes`` (``(what, shape)``
    pairs: its inputs, constants and states), or None: Pallas divides by every block
    dimension, so an array without elements (``(n, 0)`` rows, a ``(0,)`` state)
    cannot be a kernel operand. Nothing is lost: the result has no elements there."""
    for what, shape in shapes:
        if 0 in tuple(shape):
            return (
                f"{what} has shape {tuple(shape)}, without elements: Pallas blocks cannot "
                "have a zero-size dimension, so the scan engine computes the (empty) result"
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


def _eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn.params):
            yield from _eqns(sub)


def mosaic_problem(target: Target, jaxpr: Any, rows: int, where: str) -> str | None:
    """What Mosaic TPU cannot compile that the jaxpr shows (checked before compiling)."""
    for eqn in _eqns(jaxpr):
        if eqn.primitive.name != "dot_general":
            continue
        out = eqn.outvars[0].aval
        if np.dtype(out.dtype).itemsize < 4:
            # Mosaic: "'tpu.matmul' op Expected matmul acc to be 32-bit" (a verification
            # error at lowering, reported as an internal error to file)
            ins = ", ".join(_fmt_shape(v.aval.shape, v.aval.dtype, rows) for v in eqn.invars)
            return (
                f"{target.label} matmuls accumulate in 32 bits, but {where} has a dot_general "
                f"of {ins} to {_fmt_shape(out.shape, out.dtype, rows)}; ask for a 32-bit result "
                "(e.g. jnp.matmul(a, b, preferred_element_type=jnp.float32), then .astype)"
            )
    return None


# What Pallas Mosaic GPU (jax 0.12) does not lower (DESIGN.md §10), beside what
# ``interpreter.PORTABLE`` rewrites. (Its kernels unroll ``fun``'s small matmuls into
# products and sums: ``unrolled``.)
MOSAIC_GPU_MISSING = frozenset(
    {"floor", "ceil", "round", "argmax", "argmin", "sort", "cumsum", "cumprod"}
    | {"cummax", "cummin", "pow", "gather", "scatter", "scatter-add", "top_k"}
)


def mosaic_gpu_missing(jaxpr: Any, where: str) -> str | None:
    """The first operation of ``jaxpr`` Mosaic GPU has no lowering for, as a reason."""
    for eqn in _eqns(jaxpr):
        if eqn.primitive.name in MOSAIC_GPU_MISSING:
            return f"Mosaic GPU has no lowering for {eqn.primitive.name} (in {where})"
    return None


def mosaic_gpu_features_problem(closed: Any, rows: int, items: Sequence[Any]) -> str | None:
    """Why the Mosaic GPU kernel cannot take ``fun`` (``closed``, traced on a block of
    ``rows`` rows) feature by feature, each feature a vector of the block's rows
    (``unrolled.evaluate`` with ``rows``), or None. ``items``: each term's items (one
    row of each source) and state leaves. It needs ``fun`` to work row by row (its
    constants without a row axis: :func:`block_constants`), and each term to reduce
    every element of its items
    on its own (its sources of one shape, its state of that shape: sums, extrema,
    logsumexp, moments, top-k). (How many values of a row it holds at once is the
    element groups' rule, ``groups``.)"""
    why = "Mosaic GPU lowers one value per row, so fun's blocks go feature by feature"
    if not row_local(closed, rows, bounded=False):
        return (
            f"{why} only when fun works row by row (elementwise, reshapes, sums over features, "
            "products by a constant matrix)"
        )
    for monoid, sources, states in items:
        shapes = {tuple(a.shape) for a in (*sources, *states)}
        if len(shapes) > 1:
            return (
                f"{why} when each element is reduced on its own, but {monoid!r} reduces rows "
                f"of shapes {sorted(shapes)} together"
            )
    return None


def block_constants(closed: Any, rows: int) -> list[tuple[int, ...]]:
    """The shapes of ``closed``'s constants with a leading axis of ``rows`` (``fun``
    traced on a block of ``rows`` rows): made of the block's size (``np.arange(len(x))``)
    where a trace at another block size has them too."""
    return [tuple(c.aval.shape) for c in closed.jaxpr.constvars if c.aval.shape[:1] == (rows,)]


def _lifetimes(closed: Any, rows: int) -> tuple[list, Callable[[Any], bool], dict[int, int]]:
    """``closed`` flattened to nodes, whether a node is block-shaped (leading axis
    ``rows``), and each node's last use (``id`` to index; outputs: past the end)."""
    _, outs, nodes = graph(closed)
    block = lambda n: tuple(getattr(n.aval, "shape", ())[:1]) == (rows,)
    last: dict[int, int] = {}
    for node in nodes:
        for arg in node.args:
            last[id(arg)] = max(last.get(id(arg), -1), node.k)
    for node in outs:
        last[id(node)] = len(nodes)
    return nodes, block, last


def held_across_reductions(closed: Any, rows: int) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """The block-shaped values (leading axis ``rows``) a jaxpr still needs after one
    of its reductions over the rows: the largest such set over its reductions.

    A fold that reduces its block and then uses the block again (the extremum, then
    the rows equal to it; top-k's k passes; a mean, then the deviations) holds those
    arrays whole in VMEM across the reduction (Mosaic's register allocator spills
    them: "register allocator spill slots" on v4), where a single-pass fold (a sum,
    a max) streams its block."""
    nodes, block, last = _lifetimes(closed, rows)
    ops = [n for n in nodes if n.name not in ("in", "lit", "const")]
    reductions = [
        n.k for n in ops if _over_rows(n, block) or (not block(n) and any(map(block, n.args)))
    ]
    best: list = []
    for r in reductions:
        held = [n for n in nodes if block(n) and n.k <= r < last.get(id(n), -1)]
        size = sum(math.prod(n.aval.shape) * np.dtype(n.aval.dtype).itemsize for n in held)
        if size > sum(math.prod(s) * dt.itemsize for s, dt in best):
            best = [(tuple(int(d) for d in n.aval.shape), np.dtype(n.aval.dtype)) for n in held]
    return tuple(best)


def _over_rows(n: Any, block: Callable[[Any], bool]) -> bool:
    """Whether node ``n`` reduces a block over its rows (axis 0), by its parameters: a
    reduction's result of ``rows`` elements (a state per feature, ``rows`` of them)
    has a block's shape."""
    if n.name == "dot_general":
        (lc, rc), _ = n.params["dimension_numbers"]
        return (block(n.args[0]) and 0 in lc) or (block(n.args[1]) and 0 in rc)
    return 0 in n.params.get("axes", ()) and any(map(block, n.args))


def live_at_peak(closed: Any, rows: int) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """The block-shaped values (leading axis ``rows``) of a jaxpr live at once where
    they take the most bytes (in Mosaic's tiles), each live from its creation to its
    last use in program order: what a block's VJP holds (its residuals) while the
    cotangents flow back. A trailing axis of 1 (``keepdims``) is left implicit, as in
    Mosaic's layouts: ``(Bk, 128, 1)`` is held as ``(Bk, 128)``, not 128 padded lanes
    per element. A bound, not a measure: issue_field_vg's VJP, so counted 160 MiB at
    512 rows, compiled on v5e within 96 MiB (bench/accel/FINDINGS.md §7)."""
    nodes, block, last = _lifetimes(closed, rows)
    values = [n for n in nodes if block(n) and n.name not in ("lit", "const")]
    shape = lambda n: _implicit_ones(tuple(int(d) for d in n.aval.shape))
    nbytes = lambda n: tpu_padded_bytes(shape(n), np.dtype(n.aval.dtype).itemsize)
    change = [0] * (len(nodes) + 2)  # bytes made live at k, freed after their last use
    for n in values:
        change[n.k] += nbytes(n)
        change[max(n.k, last.get(id(n), n.k)) + 1] -= nbytes(n)
    total, peak, at = 0, 0, -1
    for k, c in enumerate(change):
        total += c
        if total > peak:
            peak, at = total, k
    live = [n for n in values if n.k <= at <= last.get(id(n), n.k)]
    return tuple((shape(n), np.dtype(n.aval.dtype)) for n in live)


def _implicit_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    while len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    return shape
