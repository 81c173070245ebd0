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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..._monoid import LeafReduction, MonoidReduction, index_dtype
from .blocks import tpu_block
from .interpreter import evaluate
from .kernel import (
    Grid,
    Kernel,
    Term,
    _load_const,
    _to_kernel_const,
    compiler_params,
    forward,
    kernel_const_aval,
)
from .probe import probe
from .rules import analyze, live_at_peak, triton_size_problem
from .targets import KERNEL_NAME, TPU_F32_MATH, Target, tpu_vmem_limit

__all__ = [
    "BACKWARD_NAME",
    "Backward",
    "Reverse",
    "float_positions",
    "plan_reverse",
    "reverse_rows",
    "run_reverse",
]

BACKWARD_NAME = KERNEL_NAME + "_backward"
MAX_PARTIAL_BYTES = 256 << 20  # the per-program partials of the constants' cotangents
# The share of the VMEM limit the model lets a backward block fill before the planner
# also traces smaller blocks (the compiler then picks among them; lowered only, the
# model's block runs): on v5p the VJP needed 1.18-1.28x the modelled residuals
# (issue_nbody4_vg: 75.5 MiB at 256 rows against a modelled 64, 94.7 MiB at 296
# against 74, mostly "register allocator spill slots"); issue_field_vg's model
# over-counts (bench/accel/FINDINGS.md §7).
TPU_MARGIN_BACKWARD = 0.6


@dataclasses.dataclass(frozen=True)
class Backward(Grid):
    """Everything static about one backward kernel."""

    jaxpr: Any  # the prepared fun on a block of ``rows`` rows, constants as constvars
    const_avals: tuple[jax.ShapeDtypeStruct, ...]
    in_avals: tuple[jax.ShapeDtypeStruct, ...]  # the (n, ...) inputs
    c_idx: tuple[int, ...]  # constants with a cotangent
    x_idx: tuple[int, ...]  # inputs with a cotangent
    terms: tuple[Term, ...]
    per_term: tuple  # per term (cotangent, final state, tally or None): avals
    n: int
    rows: int
    steps: int
    target: Target
    interpret: bool

    def whole(self) -> list[jax.ShapeDtypeStruct]:
        """What every program reads whole (cotangents, states, tallies), flat."""
        return jax.tree.leaves(self.per_term)

    def sums(self) -> list[jax.ShapeDtypeStruct]:
        """What each program sums: the constants' cotangents, then per tallied term
        the count of rows it selected (per element of a row)."""
        seen = [
            jax.ShapeDtypeStruct(t.items[0].shape, tally[2].dtype)
            for t, (_, _, tally) in zip(self.terms, self.per_term, strict=True)
            if tally is not None
        ]
        return [self.const_avals[i] for i in self.c_idx] + seen

    def args(self) -> list[jax.ShapeDtypeStruct]:
        offset = jax.ShapeDtypeStruct((1, 1), np.int32)
        consts = [kernel_const_aval(a) for a in self.const_avals]
        return [offset, *consts, *self.in_avals, *map(kernel_const_aval, self.whole())]

    def call(self) -> Callable[..., Any]:
        return _pallas_call(self)

    def key(self) -> tuple:
        terms = tuple(t.key() for t in self.terms)
        shapes = (self.const_avals, self.in_avals, str(self.per_term))
        return (
            "backward",
            str(self.jaxpr),
            shapes,
            self.c_idx,
            self.x_idx,
            terms,
            self.n,
            self.rows,
            self.steps,
        )


def float_positions(values: Sequence[Any]) -> list[int]:
    """The positions of the floating-point values (those with a cotangent)."""
    return [j for j, v in enumerate(values) if jnp.issubdtype(jnp.result_type(v), jnp.inexact)]


def _aval(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a))


def _partial(a: jax.ShapeDtypeStruct) -> tuple[int, ...]:
    """One program's partial sum of ``a`` in the kernel's outputs (no 0-d blocks)."""
    return (1, *(a.shape or (1,)))


def _zero_cotangent(y: jax.ShapeDtypeStruct) -> Any:
    if jnp.issubdtype(y.dtype, jnp.inexact):
        return jnp.zeros(y.shape, y.dtype)
    return np.zeros(y.shape, jax.dtypes.float0)


def _pallas_call(k: Backward) -> Callable[..., Any]:
    nc, nx, nw = len(k.const_avals), len(k.in_avals), len(k.whole())
    ndx = len(k.x_idx)
    per_term_tree = jax.tree.structure(k.per_term)

    def kernel(offset_ref, *refs):
        c_refs, x_refs = refs[:nc], refs[nc : nc + nx]
        w_refs, o_refs = refs[nc + nx : nc + nx + nw], refs[nc + nx + nw :]
        dx_refs, sum_refs = o_refs[:ndx], o_refs[ndx:]
        consts = [_load_const(r, a) for r, a in zip(c_refs, k.const_avals, strict=True)]
        whole = [_load_const(r, a) for r, a in zip(w_refs, k.whole(), strict=True)]
        per_term = jax.tree.unflatten(per_term_tree, whole)
        offset = offset_ref[...].reshape(())
        tile_start = pl.program_id(0) * k.tile

        firsts = [  # a program's first row is always one of the n
            r[(pl.ds(0, 1),) + (slice(None),) * (a.ndim - 1)]
            for r, a in zip(x_refs, k.in_avals, strict=True)
            if k.n % k.tile
        ]

        def block(j: Any, sums: list) -> list:
            start: Any = 0
            if k.steps == 1:
                xs = [r[...] for r in x_refs]
            else:
                start = j * k.rows if isinstance(j, int) else pl.multiple_of(j * k.rows, k.rows)
                xs = [
                    r[(pl.ds(start, k.rows),) + (slice(None),) * (a.ndim - 1)]
                    for r, a in zip(x_refs, k.in_avals, strict=True)
                ]
            first_row = tile_start + start
            if k.n % k.tile:  # rows past n: the program's first row (finite, never NaN)
                row = lambda x: first_row + lax.broadcasted_iota(jnp.int32, x.shape, 0)
                xs = [
                    jnp.where(row(x) < k.n, x, jnp.broadcast_to(f, x.shape))
                    for x, f in zip(xs, firsts, strict=True)
                ]

            def f(c_nz: list, x_nz: list) -> list:
                cvals, xvals = list(consts), list(xs)
                for i, v in zip(k.c_idx, c_nz, strict=True):
                    cvals[i] = v
                for i, v in zip(k.x_idx, x_nz, strict=True):
                    xvals[i] = v
                return evaluate(k.jaxpr, cvals, xvals, upcast=k.target.triton)

            ys, vjp = jax.vjp(f, [consts[i] for i in k.c_idx], [xs[i] for i in k.x_idx])
            ct_ys: list = [None] * len(ys)
            seen = []
            for term, (ct, state, tally) in zip(k.terms, per_term, strict=True):
                src = [ys[s] for s in term.leaf.sources]
                local = lax.broadcasted_iota(jnp.int32, src[0].shape, 0)
                keep = (first_row + local < k.n).astype(jnp.float32) if k.n % k.tile else None
                idx = (offset + first_row + local).astype(index_dtype())
                if tally is not None:  # the rows this pass selects, checked against the tally
                    hit = term.leaf.monoid.tally.selected(src[0], idx, tally)
                    seen.append(jnp.sum(hit if keep is None else hit * keep, axis=0))
                row_cts = term.leaf.monoid.cotangent(ct, src, idx, keep, state, term.items, tally)
                for s, c in zip(term.leaf.sources, row_cts, strict=True):
                    if c is not None:
                        ct_ys[s] = c if ct_ys[s] is None else ct_ys[s] + c
            ct_ys = [
                _zero_cotangent(y) if c is None else c.astype(y.dtype)
                for y, c in zip(ys, ct_ys, strict=True)
            ]
            dc, dx = vjp(ct_ys)
            for o_ref, d, i in zip(dx_refs, dx, k.x_idx, strict=True):
                if k.steps == 1:
                    o_ref[...] = d.astype(o_ref.dtype)
                else:
                    at = (pl.ds(start, k.rows),) + (slice(None),) * (k.in_avals[i].ndim - 1)
                    o_ref[at] = d.astype(o_ref.dtype)
            new = [*dc, *seen]
            sums = [a + b.reshape(a.shape).astype(a.dtype) for a, b in zip(sums, new, strict=True)]
            return sums

        sums = block(0, [jnp.zeros(_partial(a), a.dtype) for a in k.sums()])
        if k.steps > 1:
            sums = lax.fori_loop(1, k.steps, block, sums)
        for o_ref, a in zip(sum_refs, sums, strict=True):
            o_ref[...] = a.reshape(o_ref.shape).astype(o_ref.dtype)

    index_map = lambda first, ndim: lambda i: (i if first else 0,) + (0,) * (ndim - 1)
    whole = lambda shape: pl.BlockSpec(shape, index_map(False, len(shape)))
    rows = lambda shape: pl.BlockSpec((k.tile, *shape[1:]), index_map(True, len(shape)))

    def partial(shape: tuple[int, ...]) -> Any:
        return pl.BlockSpec((None, *shape), index_map(True, len(shape) + 1))

    dx_avals = [k.in_avals[i] for i in k.x_idx]
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in dx_avals]
        + [jax.ShapeDtypeStruct((k.grid, *_partial(a)), a.dtype) for a in k.sums()],
        grid=(k.grid,),
        in_specs=[whole((1, 1))]
        + [whole(kernel_const_aval(a).shape) for a in k.const_avals]
        + [rows(a.shape) for a in k.in_avals]
        + [whole(kernel_const_aval(a).shape) for a in k.whole()],
        out_specs=[rows(a.shape) for a in dx_avals] + [partial(_partial(a)) for a in k.sums()],
        interpret=k.interpret,
        compiler_params=compiler_params(
            k.target, k.interpret, k.rows * max(math.prod(a.shape[1:]) for a in k.in_avals)
        ),
        name=BACKWARD_NAME,
    )


@dataclasses.dataclass(frozen=True)
class Reverse:
    """The kernels of one reverse pass: the tallies (the forward kernel with each
    tallied term's ``Monoid.tally``), then the backward kernel."""

    kernel: Backward
    tally: tuple[Kernel, list[int]] | None  # the tallying kernel, the terms it tallies
    compiled: bool = False  # the backward kernel compiled for the target (not only lowered)


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
) -> Reverse | str:
    """The kernels of the reverse pass at the block of ``closed``, each built (compiled
    where a compiler is present, lowered otherwise) for ``target``; or why not.
    ``vmem_model=False``: the TPU compiler alone says whether the block fits VMEM."""
    from . import _kernel, _terms

    tallied = [j for j, leaf in enumerate(reduction.leaves) if leaf.monoid.tally is not None]
    tally = None
    tallies: list = [None] * len(reduction.leaves)
    if tallied:
        leaves = tuple(_tally_leaf(reduction.leaves[j]) for j in tallied)
        sums = MonoidReduction(leaves, jax.tree.structure([0] * len(leaves)), list)
        t = _kernel((closed, list(out_shape)), list(xs), sums, (rows, steps), target, interpret)
        if not interpret:
            verdict = probe(t)
            if verdict.problem:
                return f"the tally of the tied rows: {verdict.problem}"
        tally = (t, tallied)
        for j, term in zip(tallied, _terms(sums, out_shape, rows), strict=True):
            tallies[j] = jax.tree.map(_aval, (*term.state, term.state[2]))  # + the shares
    per_term = _per_term(reduction, states, tallies)
    block = (rows, steps)
    k = _build(closed, out_shape, xs, reduction, c_idx, x_idx, per_term, block, target, interpret)
    if interpret:
        return Reverse(k, tally)
    problem = _problem(k, vmem_model)
    if problem:
        return f"the backward kernel: {problem}"
    verdict = probe(k)
    if verdict.problem:
        return f"the backward kernel: {verdict.problem}"
    return Reverse(k, tally, verdict.compiled)


def _problem(k: Backward, vmem_model: bool) -> str | None:
    """Why the backward kernel cannot run at its block, from its VJP's jaxpr."""
    if k.target.triton:
        return triton_size_problem(k.target, analyze(_vjp_jaxpr(k).jaxpr, k.rows), k.rows)
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


def _tally_leaf(leaf: LeafReduction) -> LeafReduction:
    """A term's tally: along the rows, per element (for a term over every axis too)."""
    return LeafReduction(leaf.sources, leaf.monoid.tally, 0, leaf.out)


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
    terms = []
    for leaf in reduction.leaves:
        src = reduction.reads(out_shape, leaf)
        terms.append(
            Term(leaf, tuple(jax.ShapeDtypeStruct(tuple(s.shape[1:]), s.dtype) for s in src), None)
        )
    const_avals = tuple(_aval(c) for c in closed.consts)
    # Few enough programs that their partials (one per constant) fit MAX_PARTIAL_BYTES.
    part_bytes = sum(math.prod(const_avals[i].shape) * const_avals[i].dtype.itemsize for i in c_idx)
    programs = max(1, MAX_PARTIAL_BYTES // max(part_bytes, 1))
    steps = max(steps, pl.cdiv(pl.cdiv(n, rows), programs))
    if target.triton:
        steps = 1 << (steps - 1).bit_length()
    k = Backward(
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
    return k


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
        partials=[(_partial(a), a.dtype) for a in k.sums()],
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


def _block_args(k: Backward) -> list:
    """Avals of one block's VJP inputs (for the static analysis of its jaxpr)."""
    block = [jax.ShapeDtypeStruct((k.rows, *a.shape[1:]), a.dtype) for a in k.in_avals]
    return [list(k.const_avals), block]


def _block_vjp(k: Backward, consts: list, xs: list) -> list:
    f = lambda c, x: evaluate(k.jaxpr, c, x, upcast=k.target.triton)
    ys, vjp = jax.vjp(f, consts, xs)
    cts = [
        jnp.ones(y.shape, y.dtype) if jnp.issubdtype(y.dtype, jnp.inexact) else _zero_cotangent(y)
        for y in ys
    ]
    return jax.tree.leaves(vjp(cts))


def _tallies(r: Reverse, closed: Any, xs: Sequence[Any]) -> list:
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
    r: Reverse,
    closed: Any,
    xs: Sequence[Any],
    cts: Sequence[Any],
    states: Sequence[Any],
) -> tuple[list, list]:
    """``(cotangents of constants c_idx, of inputs x_idx)`` from the reverse kernels
    (``closed``: fun's trace on a block, its constants those of this call)."""
    k = r.kernel
    tallies = _tallies(r, closed, xs)
    call = k.call()

    def kernel_call(*args):
        return call(*args)

    kernel_call.__name__ = kernel_call.__qualname__ = BACKWARD_NAME
    whole = jax.tree.leaves(list(zip(cts, states, tallies, strict=True)))
    outs = jax.jit(kernel_call)(
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
