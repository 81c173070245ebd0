"""The backward kernel on Pallas Mosaic GPU (Hopper and newer): ``plgpu.kernel``.

The same :class:`~.backward_kernel.Backward` record and the same arithmetic as the
Triton/TPU backward kernel (``backward_kernel``), built the way the Mosaic GPU forward
kernel is (``mosaic_gpu``): feature by feature. XLA splits each input into vectors of
rows; ``plgpu.emit_pipeline`` streams blocks of them in, and each block's cotangents
of the mapped inputs go out through shared memory (TMA both ways); ``fun`` runs
unrolled over its own axes inside ``jax.vjp``; each term's rows get their cotangents
element by element (``Monoid.cotangent``, with the final state's element, or its scalar
for a term over every axis); the cotangents of the constants (one per element) and the
tallies' counts are carried through the pipeline and written per program, summed in
XLA. Rows past ``n`` are replaced by the program's first row before ``fun`` sees them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ...core.linear import cotangent_for
from ...monoids.base import index_dtype
from ..unrolled import objects
from .interpreter import portable
from .mosaic_gpu import AXIS, Features, elements_of, features

__all__ = ["mosaic_gpu_backward"]


def _pick(leaf: Any, cell: tuple, shape: tuple) -> Any:
    """Element ``cell`` of a whole array's elements (an object array) whose items have
    ``shape``; its one element where it has none (a term over every axis)."""
    return leaf[cell] if leaf.shape == shape else leaf[()]


def mosaic_gpu_backward(k: Any, name: str) -> Callable[..., Any]:
    """The backward kernel of ``k`` (a ``backward_kernel.Backward`` for Mosaic GPU): the
    arguments and outputs of ``backward_kernel._pallas_call``'s."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f, nc, nw = Features(k), len(k.const_avals), len(k.whole())
    nx, bounds = sum(f.widths), np.cumsum([0, *f.widths])
    dx_features = [j for i in k.x_idx for j in range(bounds[i], bounds[i + 1])]
    out_avals = [v.aval for v in k.jaxpr.outvars]
    # fun's outputs flat, element by element: where (output, element) sits
    cells = [(o, cell) for o, a in enumerate(out_avals) for cell in np.ndindex(*a.shape[1:])]
    at = {c: i for i, c in enumerate(cells)}
    per_term_tree = jax.tree.structure(k.per_term)
    sum_dtypes = [a.dtype for a in k.sums() for _ in range(math.prod(a.shape))]

    def block(
        carry: list, xs: list, firsts: list, consts: list, whole: list, start: Any, offset: Any
    ) -> tuple:
        local = f.iota(jnp.int32, (k.rows,), 0)
        inside = start + local < k.n
        if k.n % k.tile:  # rows past n: the program's first row (finite, never NaN)
            xs = [jnp.where(inside, x, v) for x, v in zip(xs, firsts, strict=True)]
        keep = inside.astype(jnp.float32) if k.n % k.tile else None
        idx = (offset + start + local).astype(index_dtype())
        shaped = [objects(w, a.shape) for w, a in zip(whole, k.whole(), strict=True)]
        per_term = jax.tree.unflatten(per_term_tree, shaped)

        def fun(c_nz: list, x_nz: list) -> list:
            cs, vs = list(consts), list(xs)
            for i, c in zip(k.c_idx, c_nz, strict=True):
                cs[i] = c
            for j, v in zip(dx_features, x_nz, strict=True):
                vs[j] = v
            outs = f.outputs(cs, vs)
            return [f.row(outs[o][(0, *cell)], out_avals[o].dtype) for o, cell in cells]

        c_nz = [consts[i] for i in k.c_idx]
        ys, vjp = jax.vjp(fun, c_nz, [xs[j] for j in dx_features])
        cts: list = [None] * len(ys)
        seen = []
        for t, (ct, state, tally) in zip(k.terms, per_term, strict=True):
            shape = t.items[0].shape
            items = [jax.ShapeDtypeStruct((), it.dtype) for it in t.items]
            for cell in np.ndindex(*shape):
                ct_e, state_e, tally_e = jax.tree.map(
                    lambda o, c=cell, s=shape: _pick(o, c, s), (ct, state, tally)
                )
                src = [ys[at[(s, cell)]] for s in t.leaf.sources]
                if tally is not None:  # the rows this pass selects, checked against the tally
                    hit = t.leaf.monoid.tally.selected(src[0], idx, tally_e)
                    seen.append(jnp.sum(hit if keep is None else hit * keep))
                row_cts = t.leaf.monoid.cotangent(ct_e, src, idx, keep, state_e, items, tally_e)
                for s, c in zip(t.leaf.sources, row_cts, strict=True):
                    if c is not None:
                        i = at[(s, cell)]
                        cts[i] = c if cts[i] is None else cts[i] + c
        dc, dx = vjp([cotangent_for(y, c) for y, c in zip(ys, cts, strict=True)])
        new = [*(e for c in dc for e in c), *seen]
        return [a + b.astype(a.dtype) for a, b in zip(carry, new, strict=True)], dx

    def body(offset_ref: Any, *refs: Any) -> None:
        c_refs, x_refs = refs[:nc], refs[nc : nc + nx]
        w_refs, o_refs = refs[nc + nx : nc + nx + nw], refs[nc + nx + nw :]
        nd = len(dx_features)
        dx_refs, sum_refs, staged = (
            o_refs[:nd],
            o_refs[nd : -nd or None],
            o_refs[len(o_refs) - nd :],
        )
        consts = [elements_of(r, a) for r, a in zip(c_refs, k.const_avals, strict=True)]
        whole = [elements_of(r, a) for r, a in zip(w_refs, k.whole(), strict=True)]
        offset, program = offset_ref[0, 0], lax.axis_index(AXIS)
        firsts = [r[program * k.tile] for r in x_refs] if k.n % k.tile else [None] * nx

        def step(index: tuple, *blocks: Any) -> list:
            *x_blocks, carry = blocks
            start = (program * k.steps + index[0]) * k.rows
            xs = [plgpu.load(b, layout=f.layout) for b in x_blocks]
            carry, dx = portable(block, carry, xs, firsts, consts, whole, start, offset)
            # Written through shared memory by hand: the pipeline's own copies out are
            # predicated, which Mosaic GPU's interpreter does not take (jax 0.12).
            for o, s, d in zip(dx_refs, staged, dx, strict=True):
                s[...] = d.astype(s.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(s, o.at[pl.ds(start, k.rows)])
                plgpu.wait_smem_to_gmem(0)
            return carry

        spec = plgpu.BlockSpec((k.rows,), lambda j: (program * k.steps + j,))
        pipeline = plgpu.emit_pipeline(
            step,
            grid=(k.steps,),
            in_specs=[spec] * nx,
            init_carry=[jnp.zeros((), d) for d in sum_dtypes],
            max_concurrent_steps=min(2, k.steps),
        )
        for part, o_ref in zip(pipeline(*x_refs), sum_refs, strict=True):
            o_ref[program] = part.reshape(o_ref.shape[1:]).astype(o_ref.dtype)

    dx_type = [
        jax.ShapeDtypeStruct((k.n,), k.in_avals[i].dtype)
        for i in k.x_idx
        for _ in range(f.widths[i])
    ]
    staging = [plgpu.SMEM((k.rows,), a.dtype) for a in dx_type]
    kernel = f.kernel(body, sum_dtypes, name, out_type=dx_type, scratch_types=staging)

    def call(first: Any, *args: Any) -> list:
        """``kernel``'s inputs split into features; the cotangents of the inputs and
        the programs' sums stacked back."""
        split = [v for x in args[nc : nc + len(k.in_avals)] for v in features(x)]
        outs = iter(kernel(first, *args[:nc], *split, *args[nc + len(k.in_avals) :]))
        dx = [
            jnp.stack([next(outs) for _ in range(f.widths[i])], -1).reshape(k.in_avals[i].shape)
            for i in k.x_idx
        ]
        sums = [f.stacked([next(outs) for _ in range(math.prod(a.shape))], a) for a in k.sums()]
        return [*dx, *sums]

    return call
