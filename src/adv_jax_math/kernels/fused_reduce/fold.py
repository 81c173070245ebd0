"""What every fused kernel does with a block (Triton and TPU: ``kernel.pallas_call``;
Mosaic GPU: ``mosaic_gpu``): each term's state over its rows, and the shape of a
program's partial of a state in the kernel's outputs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ...monoids.base import index_dtype

__all__ = ["partial_shape", "term_state"]


def partial_shape(aval: jax.ShapeDtypeStruct) -> tuple[int, ...]:
    """One program's partial of ``aval`` (a state leaf, a partial sum) in the kernel's
    outputs (no 0-d blocks)."""
    return (1, *(aval.shape or (1,)))


def term_state(
    k: Any,
    term: Any,
    ys: Sequence[Any] | Mapping[int, Any],
    first_row: Any,
    offset: Any,
    iota: Callable[..., Any] = lax.broadcasted_iota,
) -> Any:
    """One block's state of ``term`` (a ``kernel.Term`` of the kernel ``k``; ``ys``:
    ``fun``'s outputs on the block, by index) whose first row is ``first_row`` of the
    kernel's; rows past ``n`` filled and weighted 0; ``offset`` is the global index of
    the kernel's first row. Row indices and weights have the block's full shape (Mosaic
    cannot reshape a vector of rows into a column), made by ``iota``
    (``lax.broadcasted_iota``'s arguments; Mosaic GPU sets its layout)."""
    src = [ys[s] for s in term.leaf.sources]
    row = lambda y: first_row + iota(jnp.int32, y.shape, 0)
    rows = row(src[0])
    w = None
    if k.n % k.tile:
        src, w = term.leaf.monoid.without(src, lambda y: row(y) < k.n, rows < k.n)
    if k.interpret:
        # A kernel computes each value once; XLA running it in interpret mode fuses
        # a cheap fun into each pass of a fold that reads it twice (a maximum, then
        # exponentials), rounded differently in each: at scores of 1e9 an ulp is
        # beyond exp's range (softmax weights 0 / 0).
        src = list(lax.optimization_barrier(src))
    return term.rows_leaf.fold(src, (offset + rows).astype(index_dtype()), w)
