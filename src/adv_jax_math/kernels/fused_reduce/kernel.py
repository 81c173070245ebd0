"""The kernel: ``fun`` on one block of rows plus each term's monoid fold.

Each of the ``cdiv(n, T)`` programs takes a tile of ``T = steps * Bk`` rows of
every input leaf and loops over its blocks: evaluate ``fun``'s jaxpr on ``Bk``
rows, fill rows past ``n`` with values that change nothing (weighted 0 where the
monoid counts rows), fold each term's state (``Monoid.fold``) with the rows'
global indices, merge into one state per program. The programs' states are merged
in XLA. A term over every axis folds the rows in the kernel and merges the
trailing elements in XLA (no reshape in the kernel).
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

from ...core.targets import KERNEL_NAME, Target, pallas_triton, tpu_vmem_limit
from ...monoids.base import merge_stacked
from ...monoids.reduction import LeafReduction
from .fold import partial_shape, term_state
from .interpreter import evaluate
from .mosaic_gpu import mosaic_gpu_call

__all__ = ["Kernel", "Term", "compiler_params", "forward", "kernel_const_aval", "pallas_call"]


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of the reduction as the kernel folds it: over the rows (axis 0)."""

    leaf: LeafReduction  # the term (its axis: 0, or None merged over elements in XLA)
    items: tuple[jax.ShapeDtypeStruct, ...]  # one row of each source
    state: Any  # pytree of ShapeDtypeStruct: one block's state

    @property
    def rows_leaf(self) -> LeafReduction:
        return dataclasses.replace(self.leaf, axis=0)

    def key(self) -> tuple:
        leaf = self.leaf
        return (repr(leaf.monoid), leaf.axis, leaf.sources, self.items)


@dataclasses.dataclass(frozen=True)
class Grid:
    """What is static about a kernel over ``n`` rows: ``fun`` on a block, the terms,
    and the grid of programs of ``steps`` blocks of ``rows`` rows."""

    jaxpr: Any  # prepared fun on a block of ``rows`` rows, constants as constvars
    const_avals: tuple[jax.ShapeDtypeStruct, ...]
    in_avals: tuple[jax.ShapeDtypeStruct, ...]  # full (n, ...) inputs
    terms: tuple[Term, ...]
    n: int
    rows: int  # Bk: rows of fun evaluated at once
    steps: int  # blocks of Bk rows each kernel program reduces in a loop
    target: Target
    interpret: bool

    @property
    def tile(self) -> int:
        """Rows per kernel program."""
        return self.steps * self.rows

    @property
    def grid(self) -> int:
        return pl.cdiv(self.n, self.tile)

    def key(self) -> tuple:
        """What the kernel's build depends on (the probe's cache key)."""
        terms = tuple(t.key() for t in self.terms)
        return (
            str(self.jaxpr),
            self.const_avals,
            self.in_avals,
            terms,
            self.n,
            self.rows,
            self.steps,
        )

    def block(self, x_refs: Sequence[Any], j: Any) -> tuple[Any, list]:
        """Block ``j`` of a program's tile: its first row in the tile, its rows of
        each input."""
        if self.steps == 1:
            return 0, [r[...] for r in x_refs]
        start = j * self.rows if isinstance(j, int) else pl.multiple_of(j * self.rows, self.rows)
        return start, [r[rows_at(start, self.rows, r.ndim)] for r in x_refs]

    def rows_spec(self, shape: tuple[int, ...]) -> Any:
        """A program's tile of an array of rows."""
        return pl.BlockSpec((self.tile, *shape[1:]), _index_map(True, len(shape)))


@dataclasses.dataclass(frozen=True)
class Kernel(Grid):
    """Everything static about one fused call."""

    def args(self) -> list[jax.ShapeDtypeStruct]:
        """The kernel's arguments: the first row's index, constants, inputs."""
        offset = jax.ShapeDtypeStruct((1, 1), np.int32)
        return [offset, *map(kernel_const_aval, self.const_avals), *self.in_avals]

    def call(self) -> Callable[..., Any]:
        return mosaic_gpu_call(self) if self.target.mosaic_gpu else pallas_call(self)

    def state_avals(self) -> list[jax.ShapeDtypeStruct]:
        """Every state leaf of every term, flat (the kernel's outputs, per program)."""
        return [a for t in self.terms for a in jax.tree.leaves(t.state)]


def rows_at(start: Any, rows: int, ndim: int) -> tuple:
    """The index of ``rows`` rows from ``start`` in an array of ``ndim`` dimensions."""
    return (pl.ds(start, rows),) + (slice(None),) * (ndim - 1)


def _index_map(first: bool, ndim: int) -> Callable[[Any], tuple]:
    return lambda i: (i if first else 0,) + (0,) * (ndim - 1)


def whole_spec(shape: tuple[int, ...]) -> Any:
    """An array every program reads whole."""
    return pl.BlockSpec(shape, _index_map(False, len(shape)))


def partial_spec(aval: jax.ShapeDtypeStruct) -> Any:
    shape = partial_shape(aval)
    return pl.BlockSpec((None, *shape), _index_map(True, len(shape) + 1))


def named_jit(call: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``jax.jit(call)`` under ``name``: a named jit makes the kernel visible in lowered
    text on every platform (``func.func private @adv_jax_math_fused_reduce``),
    interpret mode included."""

    def named(*args: Any) -> Any:
        return call(*args)

    named.__name__ = named.__qualname__ = name
    return jax.jit(named)


def kernel_const_aval(a: Any) -> jax.ShapeDtypeStruct:
    """0-d and 1-d constants travel as ``(1, 1)`` and ``(1, n)`` (no 0-d blocks; a
    vmapped kernel's blocks of a 1-d constant, ``(1, n)`` of ``(batch, n)``, broke
    Mosaic's rule for the last two dimensions), bools as int32."""
    shape = tuple(a.shape)
    dtype = np.dtype(np.int32) if a.dtype == np.bool_ else a.dtype
    return jax.ShapeDtypeStruct((1, *shape) if len(shape) == 1 else shape or (1, 1), dtype)


def _to_kernel_const(c: Any) -> Any:
    c = jnp.asarray(c)
    if c.dtype == np.bool_:
        c = c.astype(jnp.int32)
    return c.reshape(kernel_const_aval(c).shape)


def _load_const(ref: Any, aval: Any) -> Any:
    value = ref[...]
    if len(aval.shape) < 2:
        value = value.reshape(aval.shape)
    if aval.dtype == np.bool_:
        value = value != 0
    return value


def compiler_params(target: Target, interpret: bool, biggest: int) -> Any:
    """The Mosaic VMEM limit, or Triton's warps for a block of ``biggest`` elements."""
    if interpret or target.platform == "cpu":
        return None
    if target.mosaic:
        from jax.experimental.pallas import tpu as pltpu

        # Programs write their own partials (and rows): parallel, so that a chip with
        # two TensorCores (v4, v5p) splits the grid between them.
        return pltpu.CompilerParams(
            vmem_limit_bytes=tpu_vmem_limit(target.device_kind), dimension_semantics=("parallel",)
        )
    return pallas_triton().CompilerParams(num_warps=8 if biggest >= 1 << 13 else 4)


def pallas_call(k: Kernel) -> Callable[..., Any]:
    nc, nx = len(k.const_avals), len(k.in_avals)

    def kernel(offset_ref, *refs):
        c_refs, x_refs, o_refs = refs[:nc], refs[nc : nc + nx], refs[nc + nx :]
        consts = [_load_const(r, a) for r, a in zip(c_refs, k.const_avals, strict=True)]
        offset = offset_ref[...].reshape(())
        tile_start = pl.program_id(0) * k.tile  # outside the loop: interpret mode needs that

        def block(j):
            start, xs = k.block(x_refs, j)
            ys = evaluate(k.jaxpr, consts, xs, upcast=k.target.triton)
            return [term_state(k, t, ys, tile_start + start, offset) for t in k.terms]

        def step(j, acc):
            new = block(j)
            return [t.leaf.monoid.merge(a, b) for t, a, b in zip(k.terms, acc, new, strict=True)]

        parts = block(0)
        if k.steps > 1:
            parts = lax.fori_loop(1, k.steps, step, parts)
        flat = [leaf for part in parts for leaf in jax.tree.leaves(part)]
        for part, o_ref in zip(flat, o_refs, strict=True):
            o_ref[...] = part.reshape(o_ref.shape).astype(o_ref.dtype)

    avals = k.state_avals()
    biggest = k.rows * max(1, *(math.prod(a.shape) for a in avals))
    biggest = max(biggest, k.rows * max(math.prod(a.shape[1:]) for a in k.in_avals))
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((k.grid, *partial_shape(a)), a.dtype) for a in avals],
        grid=(k.grid,),
        in_specs=[whole_spec((1, 1))]
        + [whole_spec(kernel_const_aval(a).shape) for a in k.const_avals]
        + [k.rows_spec(a.shape) for a in k.in_avals],
        out_specs=[partial_spec(a) for a in avals],
        interpret=k.interpret,
        compiler_params=compiler_params(k.target, k.interpret, biggest),
        name=KERNEL_NAME,
    )


def forward(k: Kernel, consts: Sequence[Any], leaves: Sequence[Any], offset: Any = 0) -> list[Any]:
    """Each term's state over all rows: the fused kernel, then the programs' states
    merged in XLA (and, for a term over every axis, its elements). ``offset`` is the
    global index of the first row (traced inside ``shard_map``)."""
    first = jnp.asarray(offset, jnp.int32).reshape(1, 1)
    call = named_jit(k.call(), KERNEL_NAME)
    flat = iter(call(first, *map(_to_kernel_const, consts), *leaves))
    out = []
    for term in k.terms:
        avals = jax.tree.leaves(term.state)
        parts = [next(flat).reshape(k.grid, *a.shape) for a in avals]
        state = merge_stacked(
            term.leaf.monoid.merge_fast, jax.tree.unflatten(jax.tree.structure(term.state), parts)
        )
        if term.leaf.axis is None:  # every axis: the elements' states merged too
            state = jax.tree.map(lambda a: a.reshape(-1), state)
            state = merge_stacked(term.leaf.monoid.merge_fast, state)
        out.append(state)
    return out
