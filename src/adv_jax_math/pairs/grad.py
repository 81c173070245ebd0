"""Derivatives of the pairwise kernel: the reverse pass as pairwise sums.

With ``s_ij`` the terms' sources for the pair ``(i, j)`` (``f`` then the
reduction's prologue), each pair's cotangent ``g_ij = Monoid.cotangent(ct_i, s_ij,
j, state_i)`` depends only on x row ``i``'s result cotangent and final state, so

* ``dx_i = sum_j (d s_ij / d x_i)^T g_ij``: a pairwise sum over y, x rows in parallel;
* ``dy_j = sum_i (d s_ij / d y_j)^T g_ij``: the same with the roles of x and y swapped;
* ``dc = sum_ij (d s_ij / d c)^T g_ij`` for the values ``f`` closes over: summed over
  each x tile inside the first pass's kernel, then over the tiles;

each a kernel recomputing ``f`` and its VJP on tiles (``pairs.kernel``):
nothing ``N x M`` is stored. A max/min first tallies its tied pairs with the
forward kernel (``Monoid.tally``); the first pass counts the pairs it selects, and
where that count differs from the tally's (a recomputation a last bit off) every
cotangent is NaN, never silently wrong.

Forward mode (``jax.jvp``, ``jax.jacfwd``) takes the scan engine's tangent; reverse
mode transposes it with these kernels (``core.linear.linear_call``), and differentiating
the reverse pass again gives JAX's transpose of that tangent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..analysis.tangent import nonzero
from ..core.linear import cotangent_for, linear_call
from ..kernels.pairwise_device import Layout
from ..monoids.base import index_dtype
from ..monoids.reduction import MonoidReduction
from .kernel import kernel_states, kernel_sums, like, struct
from .matmul import reverse as matmul_reverse
from .matmul import states as matmul_states
from .tiles import reverse

__all__ = ["Pairs", "fused"]


@dataclasses.dataclass(frozen=True, eq=False)
class Pairs:
    """One pairwise reduction on the kernel engine: ``conv(xi, yj, *consts)`` (``f``
    closure-converted), its terms ``red`` over ``j``, the tiles ``(bi, bj)``, the scan
    engine computing the same (``scan(consts, x, y)``: forward mode's tangent), and
    which kernel (``pairs.kernel.kernel_states``'s ``layout``)."""

    conv: Callable
    red: MonoidReduction
    tiles: tuple[int, int]
    scan: Callable[[list, Any, Any], Any]
    layout: Layout | None = None  # the tile kernel's (None: the interpret kernel)

    def sources(self, c: list, xi: Any, yj: Any) -> list:
        return self.red.prologue(self.conv(xi, yj, *c))

    def states(self, c: list, x: Any, y: Any) -> tuple[list, list]:
        """Each term's state for every x row, and its items (one row's)."""
        if self.layout is not None and self.layout.kind == "matmul":
            return matmul_states(self.conv, c, self.red, x, y, self.layout)
        return kernel_states(self.conv, c, self.red, x, y, self.tiles, layout=self.layout)

    def results(self, states: list, items: list) -> Any:
        """The result (every x row) from each term's per-row states."""
        one = lambda *s: self.red.finish(
            [leaf.result(st, it) for leaf, st, it in zip(self.red.leaves, s, items, strict=True)]
        )
        return jax.vmap(one)(*states)


def _inexact(a: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(a), jnp.inexact))


def _with(tree: Any, pos: Sequence[int], values: Sequence[Any]) -> Any:
    """``tree`` with ``values`` at leaves ``pos``."""
    leaves, treedef = jax.tree.flatten(tree)
    for k, v in zip(pos, values, strict=True):
        leaves[k] = v
    return jax.tree.unflatten(treedef, leaves)


def _pick(tree: Any, pos: Sequence[int]) -> list:
    """``tree``'s leaves ``pos``."""
    leaves = jax.tree.leaves(tree)
    return [leaves[k] for k in pos]


def fused(p: Pairs, consts: list, x: Any, y: Any) -> Any:
    """The result of ``p`` on the kernel engine, differentiable in every mode."""

    @jax.custom_jvp
    def run(c: list, x: Any, y: Any) -> Any:
        return p.results(*p.states(c, x, y))

    def rule(primals: tuple, tangents: tuple) -> tuple:
        c, x, y = primals
        per_term, items = p.states(c, x, y)
        out = p.results(per_term, items)
        # The nonzero float tangents, per argument (c, x, y): what the reverse pass
        # computes cotangents for (none for an empty leaf: rows of no features).
        pos = [
            [
                k
                for k, t in enumerate(jax.tree.leaves(ts, is_leaf=_zero))
                if nonzero(t) and np.prod(jnp.shape(t), dtype=np.int64) > 0
            ]
            for ts in tangents
        ]
        lin = tuple(
            [jax.tree.leaves(ts, is_leaf=_zero)[k] for k in ks]
            for ts, ks in zip(tangents, pos, strict=True)
        )
        res = (*primals, per_term)

        def tangent(lin: tuple, res: tuple) -> list:
            # jvp in the nonzero tangents only, the other leaves closed over (symbolic
            # zeros, as in plain JAX): a zero tangent made explicit meets f's infinite
            # partial derivatives there, 0 / 0 = NaN (jvp by x of t * log(y) at y = 0)
            c, x, y, _ = res
            at = lambda *nz: [_with(a, ks, v) for a, ks, v in zip((c, x, y), pos, nz, strict=True)]
            primal = tuple(_pick(a, ks) for a, ks in zip((c, x, y), pos, strict=True))
            dout = jax.jvp(lambda *nz: p.scan(*at(*nz)), primal, tuple(lin))[1]
            return [
                jax.tree.map(lambda d, o: d if _inexact(o) else None, d, leaf.out)
                for leaf, d in zip(p.red.leaves, p.red.out_tree.flatten_up_to(dout), strict=True)
            ]

        structs = jax.tree.map(struct, lin)

        @jax.custom_jvp
        def transpose(cts: list, res: tuple) -> tuple:
            return _reverse(p, cts, res, items, pos)

        def reference(cts: list, res: tuple) -> tuple:
            return jax.linear_transpose(lambda lin: tangent(lin, res), structs)(cts)[0]

        transpose.defjvp(lambda pr, ts: jax.jvp(reference, pr, ts))
        per_out = p.red.out_tree.flatten_up_to(out)
        # the tangent's structure: the result's float leaves (the scan tangent is traced
        # only where forward mode runs it)
        floats = [jax.tree.map(lambda o: struct(o) if _inexact(o) else None, o) for o in per_out]
        douts = linear_call(tangent, transpose, lin, res, out=floats)
        float0 = lambda d, o: np.zeros(o.shape, jax.dtypes.float0) if d is None else d
        dout = p.red.finish(
            [
                jax.tree.map(float0, d, o, is_leaf=lambda a: a is None)
                for d, o in zip(douts, per_out, strict=True)
            ]
        )
        return out, dout

    run.defjvp(rule, symbolic_zeros=True)
    return run(consts, x, y)


def _zero(t: Any) -> bool:
    return isinstance(t, jax.custom_derivatives.SymbolicZero)


def _reverse(p: Pairs, cts: list, res: tuple, items: list, pos: list) -> tuple:
    """The cotangents of the nonzero tangents (``pos`` per argument) from the result's
    (``cts``: per term, its float leaves; None for integer ones)."""
    if p.layout is not None and p.layout.kind == "matmul":
        dc, dx, dy, wrong = matmul_reverse(p.conv, p.red, p.layout, res, cts, pos)
    else:
        dc, dx, dy, wrong = _kernel_reverse(p, cts, res, items, pos)
    spoil = lambda a, primal: like(jnp.where(wrong, jnp.asarray(jnp.nan, a.dtype), a), primal)
    c, x, y, _ = res
    return tuple(
        [spoil(a, primal) for a, primal in zip(part, _pick(arg, ks), strict=True)]
        for part, arg, ks in zip((dc, dx, dy), (c, x, y), pos, strict=True)
    )


def _kernel_reverse(p: Pairs, cts: list, res: tuple, items: list, pos: list) -> tuple:
    """:func:`_reverse` on the tile or interpret kernel: ``(dc, dx, dy, wrong)``, where
    ``wrong`` says a max/min's selected pairs differ from its tally."""
    c, x, y, per_term = res
    red, (bi, bj) = p.red, p.tiles
    tallied = [
        t
        for t, leaf in enumerate(red.leaves)
        if leaf.monoid.tally is not None and any(map(_inexact, jax.tree.leaves(leaf.out)))
    ]
    tallies: list = [None] * len(red.leaves)
    across_x, across_y = reverse(None if p.layout is None else p.layout.kind, (bi, bj))
    at = lambda tiles: None if p.layout is None else dataclasses.replace(p.layout, tiles=tiles)
    if tallied:
        found, _ = kernel_states(
            p.conv, c, red.tallies(tallied), x, y, across_x, layout=at(across_x)
        )
        for t, state in zip(tallied, found, strict=True):
            leaf = red.leaves[t]
            shares = lambda s, leaf=leaf: leaf.monoid.tally.shares(s, leaf.axis is None)
            tallies[t] = jax.vmap(shares)(state)
    rows = list(zip(cts, per_term, tallies, strict=True))  # leading axis: the x rows
    m = jax.tree.leaves(y)[0].shape[0]
    yj = (y, jnp.arange(m, dtype=index_dtype()))

    def pair(c: list, xi: Any, yj: Any, j: Any, row: list) -> tuple:
        """The cotangents of ``(c, xi, yj)`` from the pair's, and the selected counts."""
        src, vjp = jax.vjp(lambda *a: p.sources(*a), c, xi, yj)
        # The values as the forward folds read them: computed once (the folds hold
        # them behind a barrier too), not contracted into the weights' exponent, which
        # rounds them apart from the state's maximum and sum (a logsumexp's gradient
        # 2e-2 off at scores of 1e6, all of it from 1e9 on)
        src = list(lax.optimization_barrier(src))
        cot: list = [None] * len(src)
        counts = []
        for leaf, it, (ct, state, tally) in zip(red.leaves, items, row, strict=True):
            reads = [src[s][None] for s in leaf.sources]
            got = leaf.monoid.cotangent(ct, reads, j[None], None, state, it, tally)
            for s, g in zip(leaf.sources, got, strict=True):
                if g is not None:
                    cot[s] = g[0] if cot[s] is None else cot[s] + g[0]
            if tally is not None:
                counts.append(leaf.monoid.tally.selected(reads[0], j[None], tally)[0])
        cot = [cotangent_for(s, g) for s, g in zip(src, cot, strict=True)]
        return (*vjp(cot), counts)

    pc, px, py = pos

    def over_y(xe: tuple, ye: tuple) -> tuple:  # one pair of the pass over x tiles
        dc, dx, _, counts = pair(c, xe[0], ye[0], ye[1], xe[1])
        return _pick(dx, px), _pick(dc, pc), counts

    def over_x(ye: tuple, xe: tuple) -> list:  # one pair of the pass over y tiles
        return _pick(pair(c, xe[0], ye[0], ye[1], xe[1])[2], py)

    dx, dc, got = [], [], []
    if px or pc or tallied:
        nx, nc = len(px), len(pc)
        out = kernel_sums(over_y, (x, rows), yj, across_x, range(nx, nx + nc), at(across_x))
        dx, dc, got = out[:nx], out[nx : nx + nc], out[nx + nc :]
    dy = kernel_sums(over_x, yj, (x, rows), across_y, (), at(across_y)) if py else []
    wrong = jnp.asarray(False)
    for n, t in zip(got, tallied, strict=True):
        count, share = tallies[t][2], tallies[t][3]
        wrong = wrong | jnp.any((n != count) & (share > 0))
    return dc, dx, dy, wrong
