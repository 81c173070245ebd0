"""What the fused kernel is built from: ``fun`` traced on a block of rows, each term's
state on that block, one term's fold as a jaxpr, and the :class:`Kernel` record."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...core.targets import Target
from ...monoids.base import index_dtype
from ...monoids.reduction import MonoidReduction
from .kernel import Kernel, Term

__all__ = ["block_terms", "build_kernel", "fold_jaxpr", "traced_at"]


def traced_at(fun: Callable, xs: Any, rows: int, known: dict) -> tuple[Any, list[Any]]:
    """``fun`` traced on blocks of ``rows`` rows (the inputs flattened to leaves), once
    per block shape: ``known`` holds the traces by rows."""
    if rows not in known:
        leaves, tree = jax.tree.flatten(xs)
        blocks = [jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype) for x in leaves]
        trace = lambda *ls: fun(jax.tree.unflatten(tree, ls))
        closed, out = jax.make_jaxpr(trace, return_shape=True)(*blocks)
        known[rows] = closed, jax.tree.leaves(out)
    return known[rows]


def block_terms(
    reduction: MonoidReduction, out_shape: Sequence[Any], rows: int
) -> tuple[Term, ...]:
    """Each term as the kernel folds it, with its state on a block of ``rows`` rows."""
    terms = []
    for leaf in reduction.leaves:
        src = reduction.reads(out_shape, leaf)
        items = tuple(jax.ShapeDtypeStruct(tuple(s.shape[1:]), s.dtype) for s in src)
        rows_leaf = dataclasses.replace(leaf, axis=0)
        block = [jax.ShapeDtypeStruct((rows, *it.shape), it.dtype) for it in items]
        idx = jax.ShapeDtypeStruct((rows,), index_dtype())
        state = jax.eval_shape(lambda ys, i, rl=rows_leaf: rl.fold(ys, i, None), block, idx)
        terms.append(Term(leaf, items, state))
    return tuple(terms)


def fold_jaxpr(term: Term, rows: int) -> Any:
    """One block's fold of ``term`` as the kernel runs it: row indices and weights at
    the block's full shape (``fold.term_state``)."""
    monoid = term.leaf.monoid
    block = [jax.ShapeDtypeStruct((rows, *it.shape), it.dtype) for it in term.items]

    def fold(ys: list) -> Any:
        idx = jax.lax.broadcasted_iota(index_dtype(), ys[0].shape, 0)
        w = monoid.encode((idx < rows).astype(jnp.float32), ys[0].dtype, jnp)
        return term.rows_leaf.fold(ys, idx, w)

    return jax.make_jaxpr(fold)(block)


def build_kernel(
    traced: tuple[Any, Sequence[Any]],
    xs: Any,
    reduction: MonoidReduction,
    block: tuple[int, int],
    target: Target,
    interpret: bool,
) -> Kernel:
    """The kernel for ``fun`` traced on a block (``traced``: jaxpr, output avals)
    of ``block = (rows, steps)``."""
    (closed, out_shape), (rows, steps) = traced, block
    leaves = jax.tree.leaves(xs)
    return Kernel(
        jaxpr=closed.jaxpr,
        const_avals=tuple(
            jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c)) for c in closed.consts
        ),
        in_avals=tuple(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) for x in leaves),
        terms=block_terms(reduction, out_shape, rows),
        n=int(leaves[0].shape[0]),
        rows=rows,
        steps=steps,
        target=target,
        interpret=interpret,
    )
