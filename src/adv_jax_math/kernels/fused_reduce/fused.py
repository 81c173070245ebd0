"""The fused Pallas map-reduce: a chunk's ``fun`` and its monoid reductions in one
kernel (GPU: Mosaic GPU or Triton; TPU: Mosaic; CPU: interpret mode).

``fun`` (prepared: one array per result leaf, see ``MonoidReduction.prepare``) is
traced on a block of ``Bk`` rows to a jaxpr whose constants (concrete arrays,
integer constants, tracers of enclosing transformations) become whole-array
kernel inputs. The kernel folds each term's monoid state per program; the states
are merged in XLA (``kernel.forward``). ``pallas_call`` has no transpose rule, so
the engine wraps it in a :func:`jax.custom_jvp` whose tangent is the monoid's
row tangent summed chunk by chunk (``analysis.tangent.reduce``).

This module checks a call against the kernel's rules and builds its kernels
(``check``, ``fused_states``, ``reverse_blocks``). Beside it: ``build`` (``fun``
traced on a block, the terms, the :class:`Kernel` record), ``blocks`` (block
sizing), ``rules`` (what the kernel supports), ``kernel`` (the kernel body and
``pallas_call``), ``mosaic_gpu`` (the same kernel on Mosaic GPU), ``fold`` (a block's
states, which both fold), ``backward`` and ``backward_kernel`` (the reverse pass), ``probe``
(cached compile check), ``interpreter`` (jaxpr evaluation inside the kernel). The
platforms and devices to build for are ``core.targets``; the engine adapter is
``engines.fused``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ...analysis.validate import mapped_rows, rowwise_problem
from ...core import config as _config
from ...core.gpu_backends import gpu_backends, mosaic_gpu_problem
from ...core.targets import (
    KERNEL_NAME,
    PLATFORMS,
    TPU_F32_MATH,
    Target,
    silence_triton_deprecation,
    target,
    tpu_vmem_limit,
    triton_problem,
)
from ...monoids.reduction import MonoidReduction
from . import groups as _groups
from .backward import reverse_rows
from .blocks import choose_block, choose_steps, gpu_block, row_stats, tpu_block, tpu_legal_rows
from .build import block_terms, build_kernel, fold_jaxpr, traced_at
from .fold import partial_shape
from .kernel import Kernel, forward, kernel_const_aval
from .mosaic_gpu import Features
from .probe import probe
from .rules import (
    analyze,
    block_constants,
    dtype_problem,
    empty_problem,
    held_across_reductions,
    mosaic_gpu_features_problem,
    mosaic_gpu_missing,
    mosaic_problem,
    triton_size_problem,
)

__all__ = [
    "KERNEL_NAME",
    "Check",
    "check",
    "fused_states",
    "kernel_targets",
    "reverse_blocks",
]


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
    kernel: Kernel | None = dataclasses.field(default=None, compare=False, repr=False)
    known: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # rows: trace
    empty: bool = False  # the problem is an array without elements: not an error when forced
    declined: tuple[str, ...] = ()  # targets tried before this one: "<label> not used: <why>"
    groups: int = 1  # Mosaic GPU: kernels, one per group of fun's output elements

    @property
    def backend(self) -> str:
        """The Pallas backend of the kernel (``Target.backend``; "" without one)."""
        return self.kernel.target.backend if self.kernel is not None else ""


def kernel_targets(platform: str) -> list[tuple[Target, str | None]]:
    """The targets the kernel is tried for on ``platform``, in order, each with why it
    cannot be (None: it may): on CUDA GPUs Mosaic GPU, then Triton
    (``core.targets.gpu_backends``, ``config(gpu_backend=...)``); in interpret mode
    (``"cpu"``) Pallas' interpreter, or Mosaic GPU's with ``gpu_backend="mosaic_gpu"``."""
    forced = _config.current().gpu_backend
    if PLATFORMS.get(platform) == "cpu":
        if forced == "mosaic_gpu":
            return [(target("cpu", "mosaic_gpu"), mosaic_gpu_problem())]
        return [(target("cpu"), None)]
    tgt = target(platform)
    if tgt.platform != "cuda":
        return [(tgt, None)]
    return [(target(platform, b), why) for b, why in gpu_backends(tgt.device_kind, forced)]


def check(
    fun: Callable,
    xs: Any,
    reduction: MonoidReduction,
    *,
    platform: str,
    max_rows: int | None,
    traced: Any = None,
    judge: Callable[[Check], str | None] | None = None,
) -> Check:
    """Whether the fused kernel can run ``reduction`` of ``fun(xs)`` on ``platform``.

    Static rules (inputs, dtypes, block sizes, array sizes) come first, from ``fun``
    traced on a small block; then the kernel is built at the block it will run and
    lowered for the platform (cached). Without such hardware present, GPU lowering
    targets an abstract NVIDIA H100 and TPU lowering an abstract TPU v5 lite. On a
    GPU the backends of :func:`kernel_targets` are tried in order: the first whose
    kernel builds runs; the others' reasons are kept (``Check.declined``).

    ``fun`` is prepared (a list of ``(rows, ...)`` leaves to a list of ``(rows, ...)``
    arrays, one per result leaf), ``xs`` arrays or ShapeDtypeStructs of ``n`` rows;
    ``platform`` ``"cpu"`` (interpret mode), ``"gpu"``/``"cuda"``/``"rocm"`` or
    ``"tpu"``; ``max_rows`` the user's ``batch_size``, an upper bound on the block.
    ``traced``: ``fun`` already traced on some number of rows (the planner's chunk),
    reused for a block of that many rows, so no shape is traced twice. ``judge``:
    why a kernel that builds is declined all the same (the roofline model's verdict),
    asked of every backend but the last (whose verdict the caller judges).
    """
    known: dict[int, tuple[Any, list[Any]]] = {}
    if traced is not None:
        known[traced.jaxpr.in_avals[0].shape[0]] = (traced.jaxpr, jax.tree.leaves(traced.out_shape))
    try:
        chain = kernel_targets(platform)
        mapped_rows(xs, "xs")
    except ValueError as e:
        return Check(str(e))
    declined: list[str] = []
    for i, (tgt, why) in enumerate(chain):
        asked = judge if i < len(chain) - 1 else None
        verdict = Check(why) if why else _check(fun, xs, reduction, tgt, max_rows, known, asked)
        if verdict.problem is None or verdict.empty or len(chain) == 1:
            return dataclasses.replace(verdict, declined=tuple(declined))
        declined.append(f"{tgt.label} not used: {verdict.problem}")
    return Check("; ".join(declined), declined=tuple(declined))


def _check(
    fun: Callable,
    xs: Any,
    reduction: MonoidReduction,
    tgt: Target,
    max_rows: int | None,
    known: dict[int, tuple[Any, list[Any]]],
    judge: Callable[[Check], str | None] | None = None,
) -> Check:
    """:func:`check` for one target; ``judge`` weighs the kernel before it is built
    (a compile Mosaic GPU's groups would spend for a kernel the model declines)."""
    n = mapped_rows(xs, "xs")
    leaves = jax.tree.leaves(xs)
    if n < 1:
        return Check("no rows (n == 0): the result is the identity")
    problem = empty_problem([(f"input leaf {i}", x.shape) for i, x in enumerate(leaves)])
    if problem:
        return Check(problem, empty=True)
    problem = triton_problem() if tgt.triton else None
    problem = problem or dtype_problem(tgt, [x.dtype for x in leaves], "the inputs")
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
        closed, out_shape = traced_at(fun, xs, small, known)
    except Exception as e:  # fun may not trace on other row counts; the scan engine will
        return Check(f"fun could not be traced on a block of {small} rows: {type(e).__name__}: {e}")
    problem = rowwise_problem(out_shape, small, "fun's output", _ROWWISE)
    if problem:
        return Check(problem)
    analysis = analyze(closed.jaxpr, small)
    terms = block_terms(reduction, out_shape, small)
    states = [a for t in terms for a in jax.tree.leaves(t.state)]
    problem = empty_problem(
        [(f"constant {i} of fun", np.shape(c)) for i, c in enumerate(closed.consts)]
        + [
            (f"the state of {t.leaf.monoid!r}", a.shape)
            for t in terms
            for a in jax.tree.leaves(t.state)
        ]
    )
    if problem:
        return Check(problem, empty=True)
    problem = dtype_problem(
        tgt, [dt for _, dt in analysis.avals] + [a.dtype for a in states], "fun"
    )
    if problem:
        return Check(problem)
    if tgt.triton:
        problem = triton_size_problem(tgt, analysis, small)
        if problem:
            return Check(problem)
    if tgt.mosaic_gpu:
        problem = _mosaic_gpu_problem(closed, small, reduction, out_shape, terms)
        sized = lambda r: block_constants(traced_at(fun, xs, r, known)[0], r)
        if not problem and sized(small) and sized(2 * small):  # (not of its size by chance)
            problem = f"a constant of fun has a leading axis of the block's {small} rows"
        if problem:
            return Check(problem)
    vmem = 0
    if tgt.mosaic:
        folds = [(t, fold_jaxpr(t, small)) for t in terms]
        problem = mosaic_problem(tgt, closed.jaxpr, small, "fun")
        for t, fold in folds:
            problem = problem or mosaic_problem(tgt, fold.jaxpr, small, f"{t.leaf.monoid!r}'s fold")
        if problem:
            return Check(problem)
        block = tpu_block(
            n,
            max_rows,
            inputs=leaves,
            consts=[
                kernel_const_aval(jax.ShapeDtypeStruct(np.shape(c), c.dtype)) for c in closed.consts
            ],
            partials=[(partial_shape(a), a.dtype) for a in states],
            body=analysis.avals,
            traced_rows=small,
            elementwise=analysis.elementwise,
            limit=tpu_vmem_limit(tgt.device_kind),
            v4=tgt.device_kind == "TPU v4",
            f32_math=tgt.device_kind in TPU_F32_MATH,
            held=[a for _, fold in folds for a in held_across_reductions(fold, small)],
        )
        if isinstance(block, str):
            return Check(block)
        rows, vmem = block
    else:
        rows = gpu_block(tgt, n, max_rows, analysis, terms, one_d)
    if isinstance(rows, str):
        return Check(rows)
    steps = choose_steps(tgt, n, rows)
    closed, out_shape = traced_at(fun, xs, rows, known)
    k = build_kernel((closed, out_shape), xs, reduction, (rows, steps), tgt, tgt.platform == "cpu")
    groups = 1
    if tgt.mosaic_gpu:
        found = Features(k).grouped()[-1]
        if isinstance(found, int):
            return Check(
                f"Mosaic GPU holds one row per thread: one element of fun's output needs {found} "
                "values of its row at once (the features it reads, what fun makes of them, its "
                f"state, the constants' elements), over the {_groups.REGISTERS} a thread may hold"
            )
        groups = len(found)
    planned = Check(
        None, rows, steps, False, tgt.device_kind, vmem, (closed, out_shape), k, known,
        groups=groups,
    )  # fmt: skip
    if judge is not None and (problem := judge(planned)):
        return dataclasses.replace(planned, problem=problem)
    built = probe(k)
    return dataclasses.replace(planned, problem=built.problem, compiled=built.compiled)


def _mosaic_gpu_problem(
    closed: Any, rows: int, reduction: MonoidReduction, out_shape: list, terms: Any
) -> str | None:
    """Why the Mosaic GPU kernel cannot take ``fun`` (traced on ``rows`` rows), feature
    by feature (``mosaic_gpu``): its rules, and operations of ``fun`` and of each
    term's fold on one feature that Mosaic GPU does not lower."""
    items = [(t.leaf.monoid, t.items, jax.tree.leaves(t.state)) for t in terms]
    problem = mosaic_gpu_features_problem(closed, rows, items)
    problem = problem or mosaic_gpu_missing(closed.jaxpr, "fun")
    features = [jax.ShapeDtypeStruct((rows,), o.dtype) for o in out_shape]
    for t in block_terms(reduction, features, rows):
        problem = problem or mosaic_gpu_missing(
            fold_jaxpr(t, rows).jaxpr, f"{t.leaf.monoid!r}'s fold"
        )
    return problem


def reverse_blocks(
    fun: Callable,
    xs: Any,
    reduction: MonoidReduction,
    verdict: Check,
    platform: str,
    max_rows: int | None = None,
) -> tuple[tuple[Any, list[Any], int, int], ...]:
    """``fun`` traced on smaller blocks for the backward kernel, largest first, each
    ``(jaxpr, output avals, rows, steps)``: on TPU, where the VMEM model of a block's
    VJP (with respect to every float constant and input) says the forward's block
    :func:`check` chose does not fit, half and a quarter of it and the model's own
    block (the smallest legal one when none fits). The reverse pass tries the
    forward's block, then these, and runs at the first that compiles (lowered only:
    the model's block). After a Mosaic GPU forward, Triton's own block (where
    Mosaic GPU's backward kernel declines, Triton's runs at the block Triton's forward
    would have: the Mosaic GPU block's rows can be too wide for it). Empty where the
    forward's block fits, or elsewhere."""
    tgt = target(platform)
    if verdict.backend == "mosaic_gpu" and tgt.platform == "cuda":
        return _triton_block(fun, xs, reduction, verdict, platform, max_rows)
    if not tgt.mosaic or verdict.kernel is None:
        return ()
    closed, out_shape = verdict.traced
    states = [t.state for t in verdict.kernel.terms]
    leaves = jax.tree.leaves(xs)
    try:
        fits = reverse_rows(closed, out_shape, leaves, reduction, states, verdict.rows, tgt)
    except Exception:  # fun not differentiable: reverse mode will say why
        return ()
    if isinstance(fits, int) and fits >= verdict.rows:
        return ()
    last = fits if isinstance(fits, int) else tpu_legal_rows(1, leaves)
    halves = {tpu_legal_rows(verdict.rows // d, leaves) for d in (2, 4)}
    blocks = sorted({r for r in halves if last < r < verdict.rows} | {last}, reverse=True)
    out = []
    for rows in blocks:
        try:
            traced = traced_at(fun, xs, rows, verdict.known)
        except Exception:  # fun does not trace on that block: the others may serve
            continue
        out.append((*traced, rows, choose_steps(tgt, verdict.kernel.n, rows)))
    return tuple(out)


def fused_states(
    traced: tuple[Any, list[Any]],
    xs: Any,
    reduction: MonoidReduction,
    *,
    rows: int,
    steps: int = 1,
    interpret: bool,
    platform: str | None = None,
    backend: str | None = None,
    offset: Any = 0,
) -> list[Any]:
    """Each term's state of ``reduction`` over the rows of ``xs``, computed by one
    Pallas kernel (the programs' states merged in XLA). ``traced`` is the prepared
    ``fun`` traced on a block of ``rows`` rows (:attr:`Check.traced`; its constants
    are the kernel's constant inputs), ``steps`` the blocks per program (both from
    :func:`check`); ``xs`` has ``n >= 1`` rows. ``platform`` (default:
    ``jax.default_backend()``) is compiled for unless ``interpret``, with ``backend``
    (:attr:`Check.backend`; ``"mosaic_gpu"`` interpreted too). ``offset``, an int or
    traced, is the global index of the first row (row indices of ARGMIN, top-k).
    """
    tgt = target("cpu" if interpret else platform or jax.default_backend(), backend)
    if tgt.triton:
        silence_triton_deprecation()
    leaves = jax.tree.leaves(xs)
    mapped_rows(xs, "xs")  # validates the inputs
    closed, out_shape = traced
    problem = rowwise_problem(out_shape, rows, "fun's output", _ROWWISE)
    if problem:
        raise ValueError(problem)
    k = build_kernel((closed, out_shape), xs, reduction, (rows, steps), tgt, interpret)
    return forward(k, list(closed.consts), list(leaves), offset)


def _triton_block(
    fun: Callable,
    xs: Any,
    reduction: MonoidReduction,
    verdict: Check,
    platform: str,
    max_rows: int | None,
) -> tuple[tuple[Any, list[Any], int, int], ...]:
    """``fun`` traced at Triton's block, where it is smaller than the Mosaic GPU
    forward's (``reverse_blocks``); empty without Pallas Triton."""
    if triton_problem() or _config.current().gpu_backend == "mosaic_gpu":
        return ()
    assert verdict.kernel is not None  # (a Mosaic GPU verdict's)
    tgt, (closed, out_shape) = target(platform, "triton"), verdict.traced
    leaves = jax.tree.leaves(xs)
    one_d = any(len(x.shape) == 1 for x in leaves)
    terms = block_terms(reduction, out_shape, verdict.rows)
    n = verdict.kernel.n
    rows = gpu_block(tgt, n, max_rows, analyze(closed.jaxpr, verdict.rows), terms, one_d)
    if isinstance(rows, str) or rows >= verdict.rows:
        return ()
    return ((*traced_at(fun, xs, rows, verdict.known), rows, choose_steps(tgt, n, rows)),)
