"""The fused Pallas map-reduce: a chunk's ``fun`` and its monoid reductions in one
kernel (GPU: Triton; TPU: Mosaic; CPU: interpret mode).

``fun`` (prepared: one array per result leaf, see ``MonoidReduction.prepare``) is
traced on a block of ``Bk`` rows to a jaxpr whose constants (concrete arrays,
integer constants, tracers of enclosing transformations) become whole-array
kernel inputs. ``pallas_call`` has no transpose rule, so the kernel is wrapped in
a :func:`jax.custom_jvp` whose tangent is the chunked scan of ``_tangent``.

Modules: ``targets`` (platforms, defaults, devices to lower for), ``blocks``
(block sizing), ``rules`` (what the kernel supports), ``kernel`` (the kernel
body and ``pallas_call``), ``probe`` (cached lowering check), ``engine`` (the
engine registry's adapter).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from ..._monoid import MonoidReduction
from ..._tangent import even_ties
from ..._validate import mapped_rows, rowwise_problem
from .blocks import choose_block, choose_steps, row_stats, tpu_block
from .kernel import Kernel, Out, forward, kernel_const_aval
from .probe import probe
from .rules import analyze, dtype_problem, triton_size_problem
from .targets import (
    KERNEL_NAME,
    TPU_F32_MATH,
    Target,
    silence_triton_deprecation,
    target,
    tpu_vmem_limit,
)

__all__ = ["KERNEL_NAME", "Check", "check", "fused_reduce"]


_ROWWISE = "the kernel needs one output row per input row"


@dataclasses.dataclass(frozen=True)
class Check:
    """The verdict on one call: ``problem`` (None: the kernel runs) and the block."""

    problem: str | None
    rows: int = 0  # Bk, rows per kernel block
    steps: int = 1  # blocks per kernel program
    compiled: bool = False  # compiled for the target (False: lowered only, or interpret)
    device: str = ""  # the device kind built for
    vmem: int = 0  # TPU: modelled VMEM footprint of one block, bytes
    traced: Any = dataclasses.field(default=None, compare=False, repr=False)  # fun at `rows`


def _traced_at(fun: Callable, xs: Any, rows: int, known: dict) -> tuple[Any, list[Any]]:
    """``fun`` traced on blocks of ``rows`` rows, once per block shape."""
    if rows not in known:
        known[rows] = _trace(fun, xs, rows)
    return known[rows]


def _trace(fun: Callable, xs: Any, rows: int) -> tuple[Any, list[Any]]:
    """``fun`` traced on blocks of ``rows`` rows, the inputs flattened to leaves."""
    leaves, tree = jax.tree.flatten(xs)
    blocks = [jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype) for x in leaves]
    trace = lambda *ls: fun(jax.tree.unflatten(tree, ls))
    closed, out = jax.make_jaxpr(trace, return_shape=True)(*blocks)
    return closed, jax.tree.leaves(out)


def _kernel(
    traced: tuple[Any, Sequence[Any]],
    xs: Any,
    reduction: MonoidReduction,
    block: tuple[int, int],
    max_rows: int | None,
    target: Target,
    interpret: bool,
) -> Kernel:
    """The kernel for ``fun`` traced on a block (``traced``: jaxpr, output avals)
    of ``block = (rows, steps)``."""
    (closed, out_shape), (rows, steps) = traced, block
    leaves = jax.tree.leaves(xs)
    n = int(leaves[0].shape[0])
    outs = tuple(
        Out(leaf.monoid, leaf.axis, tuple(y.shape[1:]), leaf.monoid.acc_dtype(y.dtype))
        for y, leaf in zip(out_shape, reduction.leaves, strict=True)
    )
    grid = pl.cdiv(n, rows)
    return Kernel(
        jaxpr=closed.jaxpr,
        const_avals=tuple(
            jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c)) for c in closed.consts
        ),
        in_avals=tuple(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) for x in leaves),
        outs=outs,
        n=n,
        rows=rows,
        steps=steps,
        chunk_blocks=grid if max_rows is None else max(1, min(grid, max_rows // rows)),
        target=target,
        interpret=interpret,
    )


def check(
    fun: Callable,
    xs: Any,
    reduction: MonoidReduction,
    *,
    platform: str,
    max_rows: int | None,
    traced: Any = None,
) -> Check:
    """Whether the fused kernel can run ``reduction`` of ``fun(xs)`` on ``platform``.

    Static rules (inputs, dtypes, block sizes, array sizes) come first, from ``fun``
    traced on a small block; then the kernel is built at the block it will run and
    lowered for the platform (cached). Without such hardware present, GPU lowering
    targets an abstract NVIDIA H100 and TPU lowering an abstract TPU v5 lite.

    Parameters
    ----------
    fun : callable
        The prepared function: a list of ``(rows, ...)`` leaves to a list of
        ``(rows, ...)`` arrays, one per result leaf.
    xs : pytree
        Arrays or ``jax.ShapeDtypeStruct`` sharing a leading size ``n``.
    reduction : MonoidReduction
        The recognized reduction.
    platform : str
        ``"cpu"`` (interpret mode), ``"gpu"``/``"cuda"``/``"rocm"`` (Triton) or ``"tpu"``.
    max_rows : int or None
        The user's ``batch_size``: an upper bound on the kernel block.
    traced : Traced, optional
        ``fun`` already traced on some number of rows (the planner's chunk): reused
        when a block has that many rows, so no shape is traced twice.
    """
    known: dict[int, tuple[Any, list[Any]]] = {}
    if traced is not None:
        known[traced.jaxpr.in_avals[0].shape[0]] = (traced.jaxpr, jax.tree.leaves(traced.out_shape))
    try:
        tgt = target(platform)
        n = mapped_rows(xs, "xs")
    except ValueError as e:
        return Check(str(e))
    leaves = jax.tree.leaves(xs)
    if n < 1:
        return Check("no rows (n == 0): the result is the identity")
    problem = dtype_problem(tgt, [x.dtype for x in leaves], "the inputs")
    if problem:
        return Check(problem)
    one_d = any(len(x.shape) == 1 for x in leaves)
    rows = choose_block(tgt, n, max_rows, *row_stats(leaves), one_d)
    if isinstance(rows, str):
        return Check(rows)
    small = rows if tgt.mosaic and rows == n else min(rows, tgt.probe_rows)
    if tgt.mosaic and one_d and small != rows:
        small = 128
    try:
        closed, out_shape = _traced_at(fun, xs, small, known)
    except Exception as e:  # fun may not trace on other row counts; the scan engine will
        return Check(f"fun could not be traced on a block of {small} rows: {type(e).__name__}: {e}")
    problem = rowwise_problem(out_shape, small, "fun's output", _ROWWISE)
    if problem:
        return Check(problem)
    analysis = analyze(closed.jaxpr, small)
    acc = [
        leaf.monoid.acc_dtype(y.dtype) for y, leaf in zip(out_shape, reduction.leaves, strict=True)
    ]
    problem = dtype_problem(tgt, [dt for _, dt in analysis.avals] + acc, "fun")
    if problem:
        return Check(problem)
    if tgt.triton:
        problem = triton_size_problem(tgt, analysis, small)
        if problem:
            return Check(problem)
    vmem = 0
    if tgt.mosaic:
        block = tpu_block(
            n,
            max_rows,
            inputs=leaves,
            consts=[
                kernel_const_aval(jax.ShapeDtypeStruct(np.shape(c), c.dtype)) for c in closed.consts
            ],
            partials=[
                ((1, *(y.shape[1:] or (1,))), dt) for y, dt in zip(out_shape, acc, strict=True)
            ],
            body=analysis.avals,
            traced_rows=small,
            elementwise=analysis.elementwise,
            limit=tpu_vmem_limit(tgt.device_kind),
            v4=tgt.device_kind == "TPU v4",
            f32_math=tgt.device_kind in TPU_F32_MATH,
        )
        if isinstance(block, str):
            return Check(block)
        rows, vmem = block
    else:
        rows = choose_block(tgt, n, max_rows, analysis.row_elems, analysis.row_bytes, one_d)
    if isinstance(rows, str):
        return Check(rows)
    steps = choose_steps(tgt, n, rows)
    closed, out_shape = _traced_at(fun, xs, rows, known)
    k = _kernel(
        (closed, out_shape), xs, reduction, (rows, steps), max_rows, tgt, tgt.platform == "cpu"
    )
    verdict = probe(k)
    traced_block = (closed, out_shape)
    return Check(
        verdict.problem, rows, steps, verdict.compiled, tgt.device_kind, vmem, traced_block
    )


def fused_reduce(
    fun: Callable,
    xs: Any,
    reduction: MonoidReduction,
    *,
    rows: int,
    steps: int = 1,
    max_rows: int | None,
    interpret: bool,
    platform: str | None = None,
    traced: tuple[Any, list[Any]] | None = None,
) -> Any:
    """``reduction`` of ``fun(xs)`` computed by one Pallas kernel.

    Parameters
    ----------
    fun : callable
        The prepared function (see :func:`check`); traced once, on one block.
    xs : pytree
        Arrays sharing a leading size ``n >= 1`` (the mapped rows).
    reduction : MonoidReduction
        Per-leaf monoids and axes; the result has its structure, shapes and dtypes.
    rows, steps : int
        Rows per kernel block and blocks per kernel program (from :func:`check`).
    max_rows : int or None
        Most rows processed at once (the user's ``batch_size``): bounds the chunks
        of the differentiation scan.
    interpret : bool
        Run the kernel in Pallas interpret mode (any platform, e.g. CPU).
    platform : str, optional
        Compiled lowering target when ``interpret`` is False; defaults to
        ``jax.default_backend()``.
    traced : (ClosedJaxpr, list of ShapeDtypeStruct), optional
        ``fun`` already traced on a block (:attr:`Check.traced`), not traced again.
    """
    tgt = target("cpu" if interpret else platform or jax.default_backend())
    if tgt.triton:
        silence_triton_deprecation()
    leaves = jax.tree.leaves(xs)
    mapped_rows(xs, "xs")  # validates the inputs
    closed, out_shape = traced or _trace(fun, xs, rows)
    problem = rowwise_problem(out_shape, rows, "fun's output", _ROWWISE)
    if problem:
        raise ValueError(problem)
    k = _kernel((closed, out_shape), xs, reduction, (rows, steps), max_rows, tgt, interpret)
    monoids = [(o.monoid, o.axis) for o in k.outs]
    run = even_ties(lambda c, x, _: forward(k, c, x), k.jaxpr, monoids, k.n, k.rows, k.chunk_blocks)
    return reduction.finish(run(list(closed.consts), list(leaves), []))
