"""The backward kernel: one ``pallas_call`` over blocks of rows computing the
cotangents of the mapped inputs (written row by row: a map) and each program's
partial sums of the cotangents of the values ``fun`` closes over (summed in XLA),
from the rows' cotangents (``Monoid.cotangent``) and ``fun``'s VJP on the block.

A max/min's term selects its rows against the forward's tally and counts them (an
output summed like the constants' cotangents; ``backward.run_reverse`` compares the
counts). Rows past ``n`` in the last block are replaced by the program's first row
before ``fun`` sees them (their cotangent is 0, but ``0 * inf`` in the VJP would be
NaN). Planning and running the reverse pass is ``backward``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ...core.linear import cotangent_for
from ...core.targets import KERNEL_NAME, silence_triton_deprecation
from ...monoids.base import index_dtype
from .backward_mosaic_gpu import mosaic_gpu_backward
from .interpreter import evaluate
from .kernel import (
    Grid,
    _load_const,
    compiler_params,
    kernel_const_aval,
    partial_shape,
    partial_spec,
    rows_at,
    whole_spec,
)

__all__ = ["BACKWARD_NAME", "Backward"]

BACKWARD_NAME = KERNEL_NAME + "_backward"


@dataclasses.dataclass(frozen=True)
class Backward(Grid):
    """Everything static about one backward kernel (its terms without states)."""

    c_idx: tuple[int, ...]  # constants with a cotangent
    x_idx: tuple[int, ...]  # inputs with a cotangent
    per_term: tuple  # per term (cotangent, final state, tally or None): avals

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
        if self.target.mosaic_gpu:
            return mosaic_gpu_backward(self, BACKWARD_NAME)
        return _pallas_call(self)

    def key(self) -> tuple:
        return ("backward", *super().key(), str(self.per_term), self.c_idx, self.x_idx)


def _pallas_call(k: Backward) -> Callable[..., Any]:
    if k.target.triton:  # (the forward's may be Mosaic GPU's, which does not warn)
        silence_triton_deprecation()
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

        # a program's first row is always one of the n
        firsts = [r[rows_at(0, 1, r.ndim)] for r in x_refs if k.n % k.tile]

        def block(j: Any, sums: list) -> list:
            start, xs = k.block(x_refs, j)
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
            if k.interpret:  # the values read once, as the forward kernel's (term_state)
                ys = list(lax.optimization_barrier(list(ys)))
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
            ct_ys = [cotangent_for(y, c) for y, c in zip(ys, ct_ys, strict=True)]
            dc, dx = vjp(ct_ys)
            for o_ref, d in zip(dx_refs, dx, strict=True):
                at = ... if k.steps == 1 else rows_at(start, k.rows, o_ref.ndim)
                o_ref[at] = d.astype(o_ref.dtype)
            new = [*dc, *seen]
            sums = [a + b.reshape(a.shape).astype(a.dtype) for a, b in zip(sums, new, strict=True)]
            return sums

        sums = block(0, [jnp.zeros(partial_shape(a), a.dtype) for a in k.sums()])
        if k.steps > 1:
            sums = lax.fori_loop(1, k.steps, block, sums)
        for o_ref, a in zip(sum_refs, sums, strict=True):
            o_ref[...] = a.reshape(o_ref.shape).astype(o_ref.dtype)

    dx_avals = [k.in_avals[i] for i in k.x_idx]
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in dx_avals]
        + [jax.ShapeDtypeStruct((k.grid, *partial_shape(a)), a.dtype) for a in k.sums()],
        grid=(k.grid,),
        in_specs=[whole_spec((1, 1))]
        + [whole_spec(kernel_const_aval(a).shape) for a in k.const_avals]
        + [k.rows_spec(a.shape) for a in k.in_avals]
        + [whole_spec(kernel_const_aval(a).shape) for a in k.whole()],
        out_specs=[k.rows_spec(a.shape) for a in dx_avals] + [partial_spec(a) for a in k.sums()],
        interpret=k.interpret,
        compiler_params=compiler_params(
            k.target, k.interpret, k.rows * max(math.prod(a.shape[1:]) for a in k.in_avals)
        ),
        name=BACKWARD_NAME,
    )


def _block_args(k: Backward) -> list:
    """Avals of one block's VJP inputs (for the static analysis of its jaxpr)."""
    block = [jax.ShapeDtypeStruct((k.rows, *a.shape[1:]), a.dtype) for a in k.in_avals]
    return [list(k.const_avals), block]


def _block_vjp(k: Backward, consts: list, xs: list) -> list:
    f = lambda c, x: evaluate(k.jaxpr, c, x, upcast=k.target.triton)
    ys, vjp = jax.vjp(f, consts, xs)
    cts = [
        jnp.ones(y.shape, y.dtype) if jnp.issubdtype(y.dtype, jnp.inexact) else cotangent_for(y)
        for y in ys
    ]
    return jax.tree.leaves(vjp(cts))
