"""The backward kernel on Pallas Mosaic GPU (Hopper and newer): ``plgpu.kernel``.

The same :class:`~.backward_kernel.Backward` record and the same arithmetic as the
Triton/TPU backward kernel (``backward_kernel``), built the way the Mosaic GPU forward
kernel is (``mosaic_gpu``): feature by feature. XLA splits each input into vectors of
rows; ``plgpu.emit_pipeline`` streams blocks of them in, and each block's cotangents
of the mapped inputs go out through shared memory (TMA both ways); ``fun`` runs
unrolled over its own axes inside ``jax.vjp``; each term's rows get their cotangents
element by element (``Monoid.cotangent``, with the final state's element, a top-k's k
slots as a list, or its scalar for a term over every axis); the cotangents of the
constants (one per element) and the tallies' counts are carried through the pipeline
and written per program, summed in XLA. Rows past ``n`` are replaced by the program's
first row before ``fun`` sees them.
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
from . import groups as _groups
from .groups import Group, run, words
from .interpreter import portable
from .mosaic_gpu import AXIS, Features, elements_of, features, scalar_items, wire_dtype, wired

__all__ = ["backward_groups", "kernel_count", "mosaic_gpu_backward"]


def _pick(leaf: Any, cell: tuple, shape: tuple) -> Any:
    """Element ``cell`` of a whole array's elements (an object array) whose items have
    ``shape``: of a ``(k, *shape)`` array (a top-k's values), its k slots as a list; its
    one element where it has none (a term over every axis)."""
    if leaf.shape == shape:
        return leaf[cell]
    if leaf.shape[1:] == shape:
        return [leaf[(j, *cell)] for j in range(leaf.shape[0])]
    return leaf[()]


def mosaic_gpu_backward(k: Any, name: str) -> Callable[..., Any]:
    """The backward kernels of ``k`` (a ``backward_kernel.Backward`` for Mosaic GPU), one
    per element group (``groups``, at half the forward's budget: a VJP holds its
    residuals too): the arguments and outputs of ``backward_kernel._pallas_call``'s."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f, nc, nw = Features(k), len(k.const_avals), len(k.whole())
    bounds = np.cumsum([0, *f.widths])
    dx_features = {j for i in k.x_idx for j in range(bounds[i], bounds[i + 1])}
    c_bounds = np.cumsum([0, *(math.prod(a.shape) for a in k.const_avals)])
    dc_elements = {j for i in k.c_idx for j in range(c_bounds[i], c_bounds[i + 1])}
    elements = f.elements()
    per_term_tree = jax.tree.structure(k.per_term)
    closed, n_consts, reads, groups = backward_groups(k)
    assert not isinstance(groups, int), groups  # (backward._problem)
    feature_dtypes = [a.dtype for a in f.feature_avals()]
    tallied = [
        e for e, (t, _) in enumerate(elements) if k.per_term[k.terms.index(t)][2] is not None
    ]

    def group_kernel(g: Group, shared: list[int]) -> Any:
        """The kernel of group ``g``; ``shared``: its features whose cotangents earlier
        groups' kernels wrote (read and added to)."""
        dc = [j for j in g.consts if j in dc_elements]
        dx = [j for j in g.features if j in dx_features]
        seen_of = [e for e in g.elements if e in tallied]
        sum_dtypes = [_const_dtype(k, c_bounds, j) for j in dc]
        sum_dtypes += [k.per_term[k.terms.index(elements[e][0])][2][2].dtype for e in seen_of]

        def block(carry, xs, firsts, consts, prior, whole, start, offset) -> tuple:
            local = f.iota(jnp.int32, (k.rows,), 0)
            inside = start + local < k.n
            if k.n % k.tile:  # rows past n: the program's first row (finite, never NaN)
                xs = [jnp.where(inside, x, v) for x, v in zip(xs, firsts, strict=True)]
            keep = inside.astype(jnp.float32) if k.n % k.tile else None
            idx = (offset + start + local).astype(index_dtype())
            shaped = [objects(w, a.shape) for w, a in zip(whole, k.whole(), strict=True)]
            per_term = jax.tree.unflatten(per_term_tree, shaped)
            at_c = {j: p for p, j in enumerate(g.consts)}
            at_x = {j: p for p, j in enumerate(g.features)}

            def fun(c_nz: list, x_nz: list) -> dict:
                cs, vs = list(consts), list(xs)
                for j, c in zip(dc, c_nz, strict=True):
                    cs[at_c[j]] = c
                for j, v in zip(dx, x_nz, strict=True):
                    vs[at_x[j]] = v
                return run(closed, n_consts, g, cs, vs)

            ys, vjp = jax.vjp(fun, [consts[at_c[j]] for j in dc], [xs[at_x[j]] for j in dx])
            cts: dict = {}
            seen = []
            for e in g.elements:
                t, cell = elements[e]
                shape = t.items[0].shape
                items = scalar_items(t)
                ct, state, tally = per_term[k.terms.index(t)]
                ct_e, state_e, tally_e = jax.tree.map(
                    lambda o, c=cell, s=shape: _pick(o, c, s), (ct, state, tally)
                )
                src = [ys[o] for o in reads[e]]
                if tally is not None:  # the rows this pass selects, checked against the tally
                    hit = t.leaf.monoid.tally.selected(src[0], idx, tally_e)
                    seen.append(jnp.sum(hit if keep is None else hit * keep))
                row_cts = t.leaf.monoid.cotangent(ct_e, src, idx, keep, state_e, items, tally_e)
                for o, c in zip(reads[e], row_cts, strict=True):
                    if c is not None:
                        cts[o] = c if o not in cts else cts[o] + c
            d_c, d_x = vjp({o: f.strided(cotangent_for(y, cts.get(o))) for o, y in ys.items()})
            d_x = [d + p for d, p in zip(d_x, prior, strict=True)] if prior else d_x
            new = [*d_c, *seen]
            return [a + b.astype(a.dtype) for a, b in zip(carry, new, strict=True)], d_x

        def body(offset_ref: Any, *refs: Any) -> None:
            nx, ns, nd = len(g.features), len(shared), len(dx)
            c_refs, x_refs = refs[:nc], refs[nc : nc + nx]
            p_refs = refs[nc + nx : nc + nx + ns]
            w_refs, o_refs = refs[nc + nx + ns : nc + nx + ns + nw], refs[nc + nx + ns + nw :]
            dx_refs, sum_refs, staged = (
                o_refs[:nd],
                o_refs[nd : len(o_refs) - nd],
                o_refs[len(o_refs) - nd :],
            )
            consts = f.const_elements(c_refs, g.consts)
            whole = [elements_of(r, a) for r, a in zip(w_refs, k.whole(), strict=True)]
            offset, program = offset_ref[0, 0], lax.axis_index(AXIS)
            firsts = [
                wired(r[program * k.tile], feature_dtypes[j]) if k.n % k.tile else None
                for r, j in zip(x_refs, g.features, strict=True)
            ]

            def step(index: tuple, *blocks: Any) -> list:
                *in_blocks, carry = blocks
                start = (program * k.steps + index[0]) * k.rows
                loaded = [
                    f.load(b, feature_dtypes[j])
                    for b, j in zip(in_blocks, [*g.features, *shared], strict=True)
                ]
                xs, prior = loaded[:nx], loaded[nx:]
                prior_dx = _prior(dx, shared, prior)
                carry, d_x = portable(
                    block, carry, xs, firsts, consts, prior_dx, whole, start, offset
                )
                # Written through shared memory by hand: the pipeline's own copies out are
                # predicated, which Mosaic GPU's interpreter does not take (jax 0.12).
                for o, s, d, dtype in zip(dx_refs, staged, d_x, dtypes, strict=True):
                    s[...] = wired(d.astype(dtype))
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(s, o.at[pl.ds(start, k.rows)])
                    plgpu.wait_smem_to_gmem(0)
                return carry

            spec = plgpu.BlockSpec((k.rows,), lambda j: (program * k.steps + j,))
            pipeline = plgpu.emit_pipeline(
                step,
                grid=(k.steps,),
                in_specs=[spec] * (nx + ns),
                init_carry=[jnp.zeros((), d) for d in sum_dtypes],
                max_concurrent_steps=min(2, k.steps),
            )
            for part, o_ref in zip(pipeline(*x_refs, *p_refs), sum_refs, strict=True):
                o_ref[program] = part.reshape(o_ref.shape[1:]).astype(o_ref.dtype)

        dtypes = [feature_dtypes[j] for j in dx]
        dx_type = [jax.ShapeDtypeStruct((k.n,), wire_dtype(d)) for d in dtypes]
        staging = [plgpu.SMEM((k.rows,), wire_dtype(d)) for d in dtypes]
        return f.kernel(body, sum_dtypes, name, out_type=dx_type, scratch_types=staging), dc, dx

    kernels: list = []
    written: set[int] = set()
    for g in groups:
        shared = [j for j in g.features if j in dx_features and j in written]
        kernels.append((g, shared, *group_kernel(g, shared)))
        written.update(j for j in g.features if j in dx_features)

    def call(first: Any, *args: Any) -> list:
        """Each group's kernel on the features it reads (and the cotangents earlier
        groups wrote of them); the inputs' cotangents and the programs' sums stacked."""
        vectors = [v for x in args[nc : nc + len(k.in_avals)] for v in features(x)]
        whole = args[nc + len(k.in_avals) :]
        d_x: dict[int, Any] = {}
        sums: dict[Any, list] = {}
        for g, shared, kernel, dc, dx in kernels:
            ins = [*(vectors[j] for j in g.features), *(d_x[j] for j in shared)]
            outs = iter(kernel(first, *args[:nc], *ins, *whole))
            d_x.update((j, next(outs)) for j in dx)
            for j in dc:
                sums.setdefault(("c", j), []).append(next(outs))
            for e in (e for e in g.elements if e in tallied):
                sums[("seen", e)] = [next(outs)]
        zeros = lambda dt: jnp.zeros((k.grid, 1, 1), dt)  # (an element no group reads)
        total = lambda key, dt: sum(sums.get(key, []), start=zeros(dt)).astype(dt)
        out = [
            jnp.stack(
                [
                    wired(d_x[j], a.dtype) if j in d_x else jnp.zeros((k.n,), a.dtype)
                    for j in range(bounds[i], bounds[i + 1])
                ],
                -1,
            ).reshape(a.shape)
            for i in k.x_idx
            for a in [k.in_avals[i]]
        ]
        for i in k.c_idx:
            a = k.const_avals[i]
            parts = [total(("c", j), a.dtype) for j in range(c_bounds[i], c_bounds[i + 1])]
            out.append(f.stacked(parts, a))
        seen_avals = k.sums()[len(k.c_idx) :]
        tallied_terms = [t for t in k.terms if k.per_term[k.terms.index(t)][2] is not None]
        for t, a in zip(tallied_terms, seen_avals, strict=True):
            mine = [e for e in tallied if elements[e][0] is t]
            out.append(f.stacked([total(("seen", e), a.dtype) for e in mine], a))
        return out

    return call


def backward_groups(k: Any) -> tuple[Any, int, list, list[Group] | int]:
    """``Features.grouped`` for the backward kernel of ``k``: at half the forward's
    budget (a VJP holds its residuals too), each element holding what it reads whole
    (its cotangent, final state and tally); only the elements of terms with a float
    cotangent or a tally (an argmin's indices have neither: its rows get nothing)."""
    f = Features(k)
    terms = [t for t, _ in f.elements()]
    whole = [k.per_term[k.terms.index(t)] for t in terms]
    held = [  # (a top-k's (k, *shape) cotangent: k values per element)
        sum(
            words(a.dtype) * max(1, a.size // math.prod(t.items[0].shape))
            for a in jax.tree.leaves(w)
        )
        for w, t in zip(whole, terms, strict=True)
    ]
    only = [e for e, (ct, _, tally) in enumerate(whole) if jax.tree.leaves(ct) or tally]
    return f.grouped(_groups.REGISTERS // 2, held, only)


def kernel_count(k: Any) -> int:
    """The backward kernels of ``k`` (one per group; 0: no element has a cotangent)."""
    groups = backward_groups(k)[-1]
    assert not isinstance(groups, int), groups  # (backward._problem)
    return len(groups)


def _const_dtype(k: Any, c_bounds: np.ndarray, j: int) -> Any:
    """The dtype of constants' element ``j`` (flat)."""
    return k.const_avals[int(np.searchsorted(c_bounds, j, side="right")) - 1].dtype


def _prior(dx: list[int], shared: list[int], prior: list) -> list:
    """Per feature of ``dx``, the cotangent earlier groups wrote of it (0: none)."""
    of = dict(zip(shared, prior, strict=True))
    return [of.get(j, 0) for j in dx] if shared else []
