"""The fused reverse pass: the transpose of a fused reduction's tangent, as kernels.

The gradient of a reduction over rows is itself a pass over rows: every row's
cotangent comes from the result's (``Monoid.cotangent``: 1 for a sum,
``exp(y_i - total)`` for logsumexp, an even share of the tied rows for max/min,
the softmax weights, ...), then ``fun``'s VJP on the row gives the cotangents of
the mapped inputs (written row by row: a map) and of the values ``fun`` closes over
(summed over the rows: one partial per program, summed in XLA). One ``pallas_call``
computes both on each block of rows, at the forward kernel's block. On TPU, where
the VMEM model says a block's VJP (its residuals) does not fit (``reverse_rows``),
the planner traces ``fun`` on smaller blocks too (``fused_reduce.reverse_blocks``)
and the engine runs at the largest whose backward kernel compiles.

A max/min (``Monoid.tally``) first tallies its extremum per element with the
forward kernel: the value, the first row holding it, how many rows do. The
backward kernel selects a lone extremum's row by its index, exact whatever the
last bit of its recomputation of ``fun``; tied rows by their value, and it counts
the rows it selected: where that count differs from the tally's (a recomputation a
last bit off), every cotangent is NaN, never silently wrong.

Rows past ``n`` in the last block are replaced by the program's first row before
``fun`` sees them (their cotangent is 0, but ``0 * inf`` in the VJP would be NaN).

The backward kernel itself is ``backward_kernel``'s; this module plans the reverse
pass (the tallies, the block, the compile check) and runs it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from ...core.targets import TPU_F32_MATH, Target, tpu_vmem_limit
from ...monoids.reduction import MonoidReduction
from . import groups as _groups
from .backward_kernel import BACKWARD_NAME, Backward, _block_args, _block_vjp
from .backward_mosaic_gpu import backward_groups
from .blocks import tpu_block
from .build import block_terms, build_kernel
from .kernel import (
    Kernel,
    Term,
    _to_kernel_const,
    forward,
    kernel_const_aval,
    named_jit,
    partial_shape,
)
from .probe import probe
from .rules import analyze, live_at_peak, mosaic_gpu_missing, triton_size_problem

__all__ = [
    "BACKWARD_NAME",
    "Backward",
    "ReverseKernels",
    "float_positions",
    "plan_reverse",
    "reverse_rows",
    "run_reverse",
]

MAX_PARTIAL_BYTES = 256 << 20  # the per-program partials of the constants' cotangents
# The share of the VMEM limit the model lets a backward block fill before the planner
# also traces smaller blocks (the compiler then picks among them; lowered only, the
# model's block runs): on v5p the VJP needed 1.18-1.28x the modelled residuals
# (issue_nbody4_vg: 75.5 MiB at 256 rows against a modelled 64, 94.7 MiB at 296
# against 74, mostly "register allocator spill slots"); issue_field_vg's model
# over-counts (bench/accel/FINDINGS.md §7).
TPU_MARGIN_BACKWARD = 0.6


def float_positions(values: Sequence[Any]) -> list[int]:
    """The positions of the floating-point values (those with a cotangent)."""
    return [j for j, v in enumerate(values) if jnp.issubdtype(jnp.result_type(v), jnp.inexact)]


def _aval(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a))


@dataclasses.dataclass(frozen=True)
class ReverseKernels:
    """The kernels of one reverse pass: the tallies (the forward kernel with each
    tallied term's ``Monoid.tally``), then the backward kernel."""

    kernel: Backward
    tally: tuple[Kernel, list[int]] | None  # the tallying kernel, the terms it tallies
    compiled: bool = False  # the backward kernel compiled for the target (not only lowered)
    declined: tuple[str, ...] = ()  # targets tried before this one: "<label> not used: <why>"


def plan_reverse(
    closed: Any,
    out_shape: Sequence[Any],
    xs: Sequence[Any],
    reduction: MonoidReduction,
    states: Sequence[Any],
    *,
    c_idx: Sequence[int],
    x_idx: Sequence[int],
    rows: int,
    steps: int,
    target: Target,
    interpret: bool,
    vmem_model: bool = True,
) -> ReverseKernels | str:
    """The kernels of the reverse pass at the block of ``closed``, each built (compiled
    where a compiler is present, lowered otherwise) for ``target``; or why not.
    ``vmem_model=False``: the TPU compiler alone says whether the block fits VMEM."""
    tallied = [j for j, leaf in enumerate(reduction.leaves) if leaf.monoid.tally is not None]
    tally = None
    tallies: list = [None] * len(reduction.leaves)
    if tallied:
        sums = dataclasses.replace(reduction.tallies(tallied), prologue=list)
        t = build_kernel(
            (closed, list(out_shape)), list(xs), sums, (rows, steps), target, interpret
        )
        if not interpret:
            verdict = probe(t)
            if verdict.problem:
                return f"the tally of the tied rows: {verdict.problem}"
        tally = (t, tallied)
        for j, term in zip(tallied, block_terms(sums, out_shape, rows), strict=True):
            tallies[j] = jax.tree.map(_aval, (*term.state, term.state[2]))  # + the shares
    per_term = _per_term(reduction, states, tallies)
    block = (rows, steps)
    k = _build(closed, out_shape, xs, reduction, c_idx, x_idx, per_term, block, target, interpret)
    if interpret and not target.mosaic_gpu:
        return ReverseKernels(k, tally)
    problem = _problem(k, vmem_model)  # (Mosaic GPU's rules hold in its interpreter too)
    if problem:
        return f"the backward kernel: {problem}"
    if interpret:
        return ReverseKernels(k, tally)
    verdict = probe(k)
    if verdict.problem:
        return f"the backward kernel: {verdict.problem}"
    return ReverseKernels(k, tally, verdict.compiled)


def _problem(k: Backward, vmem_model: bool) -> str | None:
    """Why the backward kernel cannot run at its block, from its VJP's jaxpr."""
    if k.target.triton:
        return triton_size_problem(k.target, analyze(_vjp_jaxpr(k).jaxpr, k.rows), k.rows)
    if k.target.mosaic_gpu:
        for t, whole in zip(k.terms, k.per_term, strict=True):
            shape = t.items[0].shape
            for a in jax.tree.leaves(whole):  # the backward_mosaic_gpu._pick rule
                if a.shape not in (shape, ()) and a.shape[1:] != shape:
                    return (
                        "Mosaic GPU's backward kernel takes each term element by element, but "
                        f"{t.leaf.monoid!r} has a result or state of shape {a.shape} for rows "
                        f"of shape {shape}"
                    )
        found = backward_groups(k)[-1]
        if isinstance(found, int):
            return (
                "Mosaic GPU's backward kernel holds one row per thread: one element of fun's "
                f"output needs {found} values of its row at once, over the "
                f"{_groups.REGISTERS // 2} a thread may hold in a VJP"
            )
        return mosaic_gpu_missing(_vjp_jaxpr(k).jaxpr, "fun's VJP")
    if k.target.mosaic and vmem_model:
        fits = _tpu_rows(k)
        if isinstance(fits, str):
            return fits
        if fits < k.rows:
            return f"its intermediates need blocks of at most {fits} rows, not {k.rows}"
    return None


def _per_term(reduction: MonoidReduction, states: Sequence[Any], tallies: Sequence[Any]) -> tuple:
    """Per term: the avals of its cotangent (float leaves; None for integer ones), of
    its final state, and its tally's (or None)."""
    return tuple(
        (
            jax.tree.map(lambda s: s if jnp.issubdtype(s.dtype, jnp.inexact) else None, leaf.out),
            jax.tree.map(_aval, state),
            t,
        )
        for leaf, state, t in zip(reduction.leaves, states, tallies, strict=True)
    )


def _build(
    closed: Any,
    out_shape: Sequence[Any],
    xs: Sequence[Any],
    reduction: MonoidReduction,
    c_idx: Sequence[int],
    x_idx: Sequence[int],
    per_term: tuple,
    block: tuple[int, int],
    target: Target,
    interpret: bool = False,
) -> Backward:
    """The backward kernel for ``fun`` traced on a block (``closed``, its output avals
    ``out_shape``) at ``block = (rows, steps)``."""
    (rows, steps), n = block, int(np.shape(xs[0])[0])
    row = lambda s: jax.ShapeDtypeStruct(tuple(s.shape[1:]), s.dtype)
    items = lambda leaf: tuple(map(row, reduction.reads(out_shape, leaf)))
    terms = [Term(leaf, items(leaf), None) for leaf in reduction.leaves]
    const_avals = tuple(_aval(c) for c in closed.consts)
    # Few enough programs that their partials (one per constant) fit MAX_PARTIAL_BYTES.
    part_bytes = sum(math.prod(const_avals[i].shape) * const_avals[i].dtype.itemsize for i in c_idx)
    programs = max(1, MAX_PARTIAL_BYTES // max(part_bytes, 1))
    steps = max(steps, pl.cdiv(pl.cdiv(n, rows), programs))
    if target.triton:
        steps = 1 << (steps - 1).bit_length()
    return Backward(
        jaxpr=closed.jaxpr,
        const_avals=const_avals,
        in_avals=tuple(_aval(x) for x in xs),
        c_idx=tuple(c_idx),
        x_idx=tuple(x_idx),
        terms=tuple(terms),
        per_term=per_term,
        n=n,
        rows=rows,
        steps=steps,
        target=target,
        interpret=interpret,
    )


def _vjp_jaxpr(k: Backward) -> Any:
    """One block's VJP, as the kernel runs it (for the static analysis of its jaxpr)."""
    return jax.make_jaxpr(lambda c, x: _block_vjp(k, c, x))(*_block_args(k))


def _tpu_rows(k: Backward) -> int | str:
    """The most rows (up to ``k.rows``) per block whose VJP fits Mosaic's VMEM limit,
    by the VMEM model (``blocks.tpu_block``) with the VJP's residuals live at once
    (``rules.live_at_peak``); or why no block fits."""
    vjp = _vjp_jaxpr(k)
    body = analyze(vjp.jaxpr, k.rows)
    block = tpu_block(
        k.n,
        k.rows,
        inputs=list(k.in_avals) + [k.in_avals[i] for i in k.x_idx],
        consts=[kernel_const_aval(a) for a in (*k.const_avals, *k.whole())],
        partials=[(partial_shape(a), a.dtype) for a in k.sums()],
        body=body.avals,
        traced_rows=k.rows,
        elementwise=body.elementwise,
        limit=tpu_vmem_limit(k.target.device_kind),
        v4=k.target.device_kind == "TPU v4",
        f32_math=k.target.device_kind in TPU_F32_MATH,
        held=() if body.elementwise else live_at_peak(vjp, k.rows),
        margin=TPU_MARGIN_BACKWARD,
    )
    return block if isinstance(block, str) else block[0]


def reverse_rows(
    closed: Any,
    out_shape: Sequence[Any],
    xs: Sequence[Any],
    reduction: MonoidReduction,
    states: Sequence[Any],
    rows: int,
    target: Target,
) -> int | str:
    """Rows per block of the backward kernel for ``fun`` traced on the forward's
    block of ``rows`` (``closed``, ``out_shape``): on TPU, the most that fit with
    respect to every float constant and input (their VJP's residuals can need far
    more VMEM than the forward); elsewhere ``rows``. Or why no block fits."""
    if not target.mosaic:
        return rows
    per_term = _per_term(reduction, states, [None] * len(states))
    c_idx, x_idx = float_positions(closed.consts), float_positions(xs)
    k = _build(closed, out_shape, xs, reduction, c_idx, x_idx, per_term, (rows, 1), target)
    return _tpu_rows(k)


def _tallies(r: ReverseKernels, closed: Any, xs: Sequence[Any]) -> list:
    """Per term: its tally with the elements' shares (``Tally.shares``), or None."""
    out: list = [None] * len(r.kernel.terms)
    if r.tally is None:
        return out
    k, tallied = r.tally
    for j, state in zip(tallied, forward(k, list(closed.consts), list(xs)), strict=True):
        leaf = r.kernel.terms[j].leaf
        out[j] = leaf.monoid.tally.shares(state, leaf.axis is None)
    return out


def run_reverse(
    r: ReverseKernels,
    closed: Any,
    xs: Sequence[Any],
    cts: Sequence[Any],
    states: Sequence[Any],
) -> tuple[list, list]:
    """``(cotangents of constants c_idx, of inputs x_idx)`` from the reverse kernels
    (``closed``: fun's trace on a block, its constants those of this call)."""
    k = r.kernel
    tallies = _tallies(r, closed, xs)
    whole = jax.tree.leaves(list(zip(cts, states, tallies, strict=True)))
    outs = named_jit(k.call(), BACKWARD_NAME)(
        jnp.zeros((1, 1), jnp.int32),
        *map(_to_kernel_const, closed.consts),
        *xs,
        *map(_to_kernel_const, whole),
    )
    nx, nc = len(k.x_idx), len(k.c_idx)
    dx = list(outs[:nx])
    dc = [
        jnp.sum(p, axis=0).reshape(k.const_avals[i].shape).astype(k.const_avals[i].dtype)
        for i, p in zip(k.c_idx, outs[nx : nx + nc], strict=True)
    ]
    seen = iter(outs[nx + nc :])
    wrong = jnp.zeros((), bool)
    for term, tally in zip(k.terms, tallies, strict=True):
        if tally is not None:  # ties recomputed otherwise than tallied: no answer
            got = jnp.sum(next(seen), axis=0).reshape(term.items[0].shape)
            wrong = wrong | jnp.any((got != tally[2]) & (tally[3] > 0))
    if any(t is not None for t in tallies):
        poison = lambda a: jnp.where(wrong, jnp.nan, a).astype(a.dtype)
        dx, dc = [poison(a) for a in dx], [poison(a) for a in dc]
    return dc, dx
