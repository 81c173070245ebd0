"""A monoid reduction of ``fun``'s output, a pytree of terms.

A recognized ``(reduction, chunk_reduction)`` pair, or a pytree of monoid objects
passed as ``reduction=``, becomes a :class:`MonoidReduction`: one
:class:`LeafReduction` (monoid, the leaves of ``fun``'s output it reads, axes,
result shape) per term of the result, plus the elementwise prologue a recognized
chunk reduction applies first (see ``analysis.recognize``). Each term runs the
four steps of its :class:`~adv_jax_math.monoids.base.Monoid` (``monoids.base``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .base import Monoid, State

__all__ = ["LeafReduction", "MonoidReduction"]


@dataclass(frozen=True)
class LeafReduction:
    """One term of the result: ``monoid`` over the leaves ``sources`` of the prepared
    output (one array per source, rows first) along ``axis`` (``0``: the rows;
    ``None``: every axis). ``out`` is the term's result: a ``ShapeDtypeStruct``, or a
    pytree of them for monoids whose result has several parts (values and indices);
    recognized reductions reshape their result to it (``keepdims``)."""

    sources: tuple[int, ...]
    monoid: Monoid
    axis: int | None
    out: Any
    has_prologue: bool = False

    @property
    def source(self) -> int:
        return self.sources[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(jax.tree.leaves(self.out)[0].shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(jax.tree.leaves(self.out)[0].dtype)

    def __str__(self) -> str:
        axes = "all axes" if self.axis is None else "axis 0"
        pre = " after an elementwise map" if self.has_prologue else ""
        return f"{self.monoid.name} over {axes}{pre}"

    def _rows(self, ys: Sequence[Any], per_row: Sequence[Any]) -> tuple[list, list]:
        """``ys`` and per-row vectors as the monoid reads them: reducing every axis,
        each element is a row (per-row vectors repeated over the trailing elements)."""
        if self.axis == 0:
            return list(ys), list(per_row)
        (y,) = ys
        per = int(np.prod(y.shape[1:], dtype=np.int64))
        flat = y.reshape(y.shape[0] * per)
        spread = lambda a: None if a is None else jnp.repeat(a, per, total_repeat_length=flat.size)
        return [flat], [spread(a) for a in per_row]

    def fold(
        self,
        ys: Sequence[Any],
        idx: Any,
        w: Any,
        *,
        fast: bool = False,
        again: Any = None,
        native: Callable[[jax.Array], Any] | None = None,
    ) -> State:
        """:meth:`Monoid.fold` over this term's rows (``fast``: :meth:`Monoid.fold_fast`,
        with the rows computed ``again`` if given; ``native``: :meth:`Monoid.fold_native`
        with that kernel)."""
        ys, (idx, w) = self._rows(ys, [idx, w])
        if native is not None:
            return self.monoid.fold_native(ys, w, native)
        if not fast:
            return self.monoid.fold(ys, idx, w)
        if again is not None:
            return self.monoid.fold_fast(ys, idx, w, self._rows(again, [])[0])
        return self.monoid.fold_fast(ys, idx, w)

    def fold_into(
        self,
        acc: State | None,
        ys: Sequence[Any],
        idx: Any,
        w: Any,
        native: Callable | None = None,
        fast: bool = True,
    ) -> State:
        """:meth:`Monoid.fold_into` over this term's rows; ``acc`` None (the first
        block): :meth:`fold`, or for a top-k that ``native`` folds, into its empty
        state (the tile loops outside kernels)."""
        if acc is None and native is not None and self.monoid.native_kernel == "topk":
            acc = self.monoid.init(self.items(ys))
        if acc is None:
            return self.fold(ys, idx, w, fast=fast)
        ys, (idx, w) = self._rows(ys, [idx, w])
        return self.monoid.fold_into(acc, ys, idx, w, native)

    def tangent(
        self, ys: Sequence[Any], dys: Sequence[Any], idx: Any, keep: Any, state: State, items: Any
    ) -> Any:
        """:meth:`Monoid.tangent` over this term's rows."""
        ys, (idx, keep) = self._rows(ys, [idx, keep])
        dys, _ = self._rows(dys, [])
        return self.monoid.tangent(ys, dys, idx, keep, state, items)

    def items(self, ys_shapes: Sequence[Any]) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Trailing shapes and dtypes of one row as the monoid sees it."""
        if self.axis == 0:
            return tuple(jax.ShapeDtypeStruct(tuple(s.shape[1:]), s.dtype) for s in ys_shapes)
        return tuple(jax.ShapeDtypeStruct((), s.dtype) for s in ys_shapes)

    def result(self, state: State, items: Sequence[Any]) -> Any:
        """The finalized result in this term's shapes and dtypes."""
        return self.shaped(self.monoid.finalize(state, items))

    def shaped(self, out: Any) -> Any:
        """A result of the monoid in this term's shapes and dtypes."""
        cast = lambda r, s: jnp.asarray(r).astype(s.dtype).reshape(s.shape)
        return jax.tree.map(cast, out, self.out)


@dataclass(frozen=True, eq=False)
class MonoidReduction:
    """A monoid reduction of ``fun``'s output: one :class:`LeafReduction` per term.

    Engines evaluate ``prepare(fun)(x)`` (a list of arrays, rows first: each term
    reads ``sources`` of it), fold and merge each term's state, and hand the final
    states to :meth:`finish`, which gives the result's structure (``out_tree``, one
    leaf per term), shapes and dtypes.
    """

    leaves: tuple[LeafReduction, ...]
    out_tree: Any
    prologue: Callable[[Any], list[jax.Array]]
    how: str = ""

    def __str__(self) -> str:
        kinds = sorted({str(leaf) for leaf in self.leaves})
        return kinds[0] if len(kinds) == 1 else "per leaf: " + "; ".join(map(str, self.leaves))

    @property
    def selects(self) -> bool:
        return any(leaf.monoid.selects for leaf in self.leaves)

    def prepare(self, fun: Callable) -> Callable[[Any], list[jax.Array]]:
        """``fun`` followed by the prologue: a list of arrays the terms read."""
        return lambda x: self.prologue(fun(x))

    def reads(self, ys: Sequence[Any], leaf: LeafReduction) -> list[Any]:
        return [ys[s] for s in leaf.sources]

    def check_rows(self, n: int) -> None:
        for leaf in self.leaves:
            leaf.monoid.check_rows(n)

    def merge_states(self, a: list | None, b: list) -> list:
        """Each term's states ``a`` and ``b`` merged (``merge_fast``), ``a`` over the
        rows before ``b``'s; ``a`` None: ``b``, the first part's states."""
        if a is None:
            return b
        return [leaf.monoid.merge_fast(s, t) for leaf, s, t in zip(self.leaves, a, b, strict=True)]

    def tallies(self, terms: Sequence[int]) -> MonoidReduction:
        """The tallies (``Monoid.tally``) of the terms numbered ``terms``, over the same
        rows, along the rows, per element (for a term over every axis too): what a
        max/min's reverse pass finds its tied rows with."""
        leaves = tuple(
            LeafReduction(
                self.leaves[t].sources, self.leaves[t].monoid.tally, 0, self.leaves[t].out
            )
            for t in terms
        )
        return MonoidReduction(leaves, jax.tree.structure([0] * len(leaves)), self.prologue)

    def finish(self, results: Sequence[Any]) -> Any:
        """Each term's result (see :meth:`LeafReduction.result`) in the result tree."""
        return jax.tree.unflatten(self.out_tree, list(results))

    def empty_result(self, ys_shapes: Sequence[Any]) -> Any:
        """The result for ``n == 0`` (``ys_shapes``: the prepared output's avals)."""
        items = lambda leaf: leaf.items(self.reads(ys_shapes, leaf))
        return self.finish([leaf.shaped(leaf.monoid.empty(items(leaf))) for leaf in self.leaves])
