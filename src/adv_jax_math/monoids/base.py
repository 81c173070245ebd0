"""Monoids: reductions as states that fold rows and merge (KeOps' four steps).

A :class:`Monoid` reduces the rows of one block of ``fun``'s output, ``(rows, *t)``,
to a *state* (a pytree of arrays shaped by ``t``), merges two states
associatively, and finalizes a state into the result; the result need not be the
state (an argmin carries the best value with its index, a mean its count and
second moment). Engines hold no knowledge of any particular monoid: the scan
engine folds chunks and merges states across chunks and devices, the fused kernel
folds blocks and merges per program, and the derivative rule (:meth:`Monoid.tangent`)
is a sum over rows, so it is computed chunk by chunk like the forward pass.

A recognized ``(reduction, chunk_reduction)`` pair, or a pytree of monoid objects
passed as ``reduction=``, becomes a
:class:`~adv_jax_math.monoids.reduction.MonoidReduction` (``monoids.reduction``):
one term per leaf of the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Monoid",
    "identity",
    "index_dtype",
    "is_monoid_tree",
    "merge_stacked",
]

State = Any  # a pytree of arrays


def identity(x: Any) -> Any:
    """Return ``x`` unchanged (the default ``chunk_reduction``)."""
    return x


def index_dtype() -> np.dtype:
    """Row indices: int32, int64 under ``jax_enable_x64`` (as ``jnp.argmin`` returns)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.int64))


class Monoid:
    """A reduction over rows: initialize, fold a block of rows, merge two states,
    finalize (the four steps of KeOps' reductions and optax's accumulators).

    Subclasses define the four steps for one block of rows and the derivative rule;
    every engine runs them unchanged (``jax.vmap`` adds the devices of a sharded
    call, the fused kernel folds blocks). Monoid objects are passed as
    ``reduction=`` (one for every leaf of ``fun``'s output, or a pytree of them, one
    per subtree); with the default ``chunk_reduction`` they reduce the mapped axis.

    Attributes
    ----------
    name : str
        Short name (``"add"``, ``"argmin"``, ``"top_k(16)"`` ...).
    arity : int
        Leaves of ``fun``'s output one term reads: 1, or 2 for
        ``SOFTMAX_WEIGHTED`` (scores and values).
    halves : bool
        Whether a row may count for half (exact for float sums): rows that two
        overlapping chunks share are halved in both; otherwise the last chunk's
        copies are dropped.
    selects : bool
        The result selects rows (max, argmin, top-k): derivatives come from
        :meth:`tangent` on every engine (ties share the derivative evenly, as
        ``jax.grad(jnp.max)``), never from differentiating :meth:`fold`.
    reads_twice : bool
        :meth:`fold_fast` reads the rows in two passes (logsumexp: the maximum,
        then the shifted sum) and takes them computed a second time when ``fun`` is
        elementwise and cheap: each pass then fuses ``fun`` into its reduction,
        where one stored copy read twice would cut the fusion.
    sorts : bool
        :meth:`fold_fast` sorts the rows it folds (top-k: ``lax.top_k``), and merging
        states costs another: the CPU tiles take fewer, larger tiles of ``y``.
    broadcasts : bool
        The leaves a term reads (``arity`` 2) may have rows of different shapes that
        broadcast to one, as NumPy's (``jax.nn.logsumexp``'s ``a`` and ``b``); the
        term's state and result are of the broadcast shape.
    native_kernel : str or None
        The native CPU kernel (``kernels.native``) that may fold a chunk of the rows
        in one pass (``"logsumexp"``), or None. The scan engine decides per chunk
        (the rows in :meth:`native_dtype`) and folds with :meth:`fold_native`; a
        monoid never imports the kernel.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> x = jnp.log(jnp.arange(1.0, 7.0)).reshape(3, 2)
    >>> ajm.batch_map(lambda v: v, x, 2, reduction=ajm.LOGSUMEXP)  # log(1+3+5), log(2+4+6)
    Array([2.1972246, 2.4849067], dtype=float32)
    >>> ajm.batch_map(lambda v: v, jnp.array([3.0, 1.0, 2.0, 1.0]), 2, reduction=ajm.ARGMIN)
    Array(1, dtype=int32)
    """

    name: str = "monoid"
    arity: int = 1
    halves: bool = False
    selects: bool = False
    reads_twice: bool = False
    sorts: bool = False
    broadcasts: bool = False
    native_kernel: str | None = None
    # For monoids whose state is their result: the plain-JAX binary combine and
    # reduction (``jnp.add``, ``jnp.sum``), used when a Monoid is called directly.
    combine: Callable[[Any, Any], Any] | None = None
    reduce: Callable[..., Any] | None = None

    def __call__(self, a: Any, b: Any) -> Any:
        if self.combine is None:
            raise TypeError(
                f"{self!r} combines states, not results (its result is not its state); "
                f"pass it as reduction={self!r} with the default chunk_reduction"
            )
        return self.combine(a, b)

    def __repr__(self) -> str:
        return f"adv_jax_math.{self.name.upper()}"

    # -- the four steps, for one block of rows (no device axis) -------------------
    def init(self, items: Sequence[jax.ShapeDtypeStruct]) -> State:
        """The identity state for rows whose trailing shapes and dtypes are ``items``
        (one per leaf the term reads)."""
        raise NotImplementedError

    def fold(self, ys: Sequence[jax.Array], idx: jax.Array, w: jax.Array | None) -> State:
        """The state of a block: ``ys`` one ``(rows, *t)`` array per leaf read,
        ``idx`` the rows' global indices, ``w`` the rows' weights in this monoid's
        :meth:`encode` (None: every row counts once). ``idx`` and ``w`` are ``(rows,)``
        or already broadcast to the shape of ``ys[0]`` (inside a kernel)."""
        raise NotImplementedError

    def fold_fast(
        self,
        ys: Sequence[jax.Array],
        idx: jax.Array,
        w: jax.Array | None,
        again: Sequence[jax.Array] | None = None,
    ) -> State:
        """:meth:`fold` where a faster implementation may serve (outside kernels).
        ``again``: the same rows as ``ys``, computed a second time, given to a monoid
        that :attr:`reads_twice` when ``fun`` is cheap to run again."""
        return self.fold(ys, idx, w)

    def native_dtype(self, dtype: Any) -> np.dtype:
        """The dtype in which the :attr:`native_kernel` reduces rows of ``dtype``."""
        return np.dtype(dtype)

    def fold_native(
        self, ys: Sequence[jax.Array], w: jax.Array | None, kernel: Callable[[jax.Array], Any]
    ) -> State:
        """:meth:`fold` where ``kernel``, the :attr:`native_kernel` (the scan engine
        passes it for the chunks it gives it), reduces the rows in one pass."""
        raise NotImplementedError

    def fold_into(
        self,
        acc: State,
        ys: Sequence[jax.Array],
        idx: jax.Array,
        w: jax.Array | None,
        native: Callable[..., Any] | None = None,
    ) -> State:
        """The state ``acc`` (of the rows before) with a block of rows folded in
        (outside kernels): :meth:`merge_fast` of :meth:`fold_fast`, or one pass of
        the native kernel ``native`` that an engine passes where it runs (top-k:
        ``kernels.native.topk_fold``)."""
        return self.merge_fast(acc, self.fold_fast(ys, idx, w))

    def merge(self, a: State, b: State) -> State:
        """Two states combined (associative; ``a`` holds the lower row indices)."""
        raise NotImplementedError

    def merge_fast(self, a: State, b: State) -> State:
        """:meth:`merge` where a faster-compiling implementation may serve (outside
        kernels: top-k's network on stacked slots)."""
        return self.merge(a, b)

    def finalize(self, state: State, items: Sequence[jax.ShapeDtypeStruct]) -> Any:
        """The result (a pytree of arrays of the result dtypes)."""
        raise NotImplementedError

    def empty(self, items: Sequence[jax.ShapeDtypeStruct]) -> Any:
        """The result over zero rows (as the plain-JAX reduction gives it)."""
        return self.finalize(self.init(items), items)

    def check_rows(self, n: int) -> None:
        """Raise if the result over ``n`` rows is undefined (as the plain-JAX reduction
        raises)."""

    # -- row weights --------------------------------------------------------------
    def encode(self, keep: Any, dtype: Any, xp: Any = np) -> Any:
        """Row weights as :meth:`fold` reads them, from ``keep`` (1: the row counts,
        0: it is left out, 1/2: it counts for half; ``xp`` is NumPy for constant
        tables or ``jax.numpy``); None when the forward pass ignores repeats (an
        idempotent monoid)."""
        return xp.asarray(keep, dtype)

    def fills(self, dtypes: Sequence[Any]) -> tuple:
        """Values for rows that do not exist (a kernel block past the last row), one
        per leaf read: with weight 0 they must not change the state (e.g. the
        identity)."""
        return tuple(self.fill(dtype) for dtype in dtypes)

    def fill(self, dtype: Any) -> Any:
        return np.zeros((), dtype)[()]

    def without(
        self, ys: Sequence[jax.Array], kept: Callable[[jax.Array], jax.Array], keep: jax.Array
    ) -> tuple[list, Any]:
        """``ys`` (the leaves read) with the rows that do not exist set to
        :meth:`fills` (``kept(y)``: True where a row of ``y`` exists, shaped against
        it), and the rows' weights from ``keep`` (True where a row exists) as
        :meth:`fold` reads them: a kernel's block past the last row."""
        fills = self.fills([y.dtype for y in ys])
        out = [
            jnp.where(kept(y), y, np.asarray(f, y.dtype)) for y, f in zip(ys, fills, strict=True)
        ]
        return out, self.encode(keep.astype(jnp.float32), out[0].dtype, jnp)

    def halves_for(self, dtype: Any) -> bool:
        """Whether shared rows count for half in each chunk (exact float sums), or the
        last chunk's copy is dropped."""
        return self.halves and bool(jnp.issubdtype(dtype, jnp.inexact))

    # -- derivative: a sum over rows ----------------------------------------------
    def tangent(
        self,
        ys: Sequence[jax.Array],
        dys: Sequence[jax.Array],
        idx: jax.Array,
        keep: jax.Array | None,
        state: State,
        items: Sequence[jax.Array],
    ) -> Any:
        """One block's share of the result's tangent, linear in ``dys`` (with parts
        that do not depend on them, e.g. a max's tied rows); shares of all blocks are
        merged (:meth:`tangent_merge`, a sum by default), then :meth:`tangent_finish`
        applies. ``keep`` are the 0/1/half row weights (None: all 1), ``state`` the
        final state of all rows."""
        raise NotImplementedError

    # -- reverse mode, row by row (the fused backward kernel) -------------------------
    @property
    def tally(self) -> Any:
        """A monoid folded over the same rows (per element, along the rows) before
        the reverse pass when :meth:`cotangent` needs more than the final state (a
        max/min's tied rows: ``monoids.extrema.Tally``), or None. Its state, with each
        element's share appended, is :meth:`cotangent`'s ``tally``."""
        return None

    def cotangent(
        self,
        ct: Any,
        ys: Sequence[jax.Array],
        idx: Any,
        keep: Any,
        state: State,
        items: Sequence[Any],
        tally: Any = None,
    ) -> tuple:
        """The cotangent of each row of ``ys`` (one ``(rows, *t)`` array per leaf
        read; None for integer leaves) from the result's cotangent ``ct`` (its float
        parts; None for integer ones): the transpose of :meth:`tangent` then
        :meth:`tangent_finish`, written elementwise (no reshape: it runs in kernels).
        ``state`` is the final state (scalar parts for a term over every axis),
        ``idx`` the rows' global indices and ``keep`` their weights, both in the
        shape of ``ys[0]``; ``tally`` as :attr:`tally` describes."""
        raise NotImplementedError

    def tangent_init(self, raw: Any) -> Any:
        """The identity of :meth:`tangent_merge`, shaped like ``raw`` (default: zeros)."""
        return jax.tree.map(jnp.zeros_like, raw)

    def tangent_merge(self, a: Any, b: Any) -> Any:
        """Two blocks' shares combined (default: their sum; ``a`` holds lower rows)."""
        return jax.tree.map(jnp.add, a, b)

    def tangent_finish(self, raw: Any, state: State, items: Sequence[Any]) -> Any:
        """The result's tangent from the merged shares (default: the sum itself)."""
        return raw


def merge_stacked(merge: Callable[[Any, Any], Any], state: Any) -> Any:
    """States stacked along a leading axis merged into one: pairwise, the lower
    index (lower rows) on the left."""
    if not jax.tree.leaves(state):  # nothing to merge (an integer result's tangent)
        return state
    while (d := jax.tree.leaves(state)[0].shape[0]) > 1:
        even = d - d % 2
        left = jax.tree.map(lambda a, e=even: a[:e:2], state)
        right = jax.tree.map(lambda a, e=even: a[1:e:2], state)
        merged = jax.vmap(merge)(left, right)
        if d % 2:
            merged = jax.tree.map(lambda m, a: jnp.concatenate([m, a[-1:]]), merged, state)
        state = merged
    return jax.tree.map(lambda a: a[0], state)


def _col(a: jax.Array, y: jax.Array) -> jax.Array:
    """A per-row array ``(rows,)`` shaped to broadcast against ``y`` ``(rows, *t)``."""
    return a.reshape(a.shape + (1,) * (y.ndim - a.ndim))


def is_monoid_tree(reduction: Any) -> bool:
    """A Monoid object, or a (non-empty) pytree whose leaves are all Monoid objects."""
    if isinstance(reduction, Monoid):
        return True
    if callable(reduction) or reduction is None:
        return False
    leaves = jax.tree.leaves(reduction, is_leaf=lambda m: isinstance(m, Monoid))
    return bool(leaves) and all(isinstance(m, Monoid) for m in leaves)
