"""The chunks of the scan engine's plans: how a plan's rows are cut (shares, one per
device, and chunks of them), the weights of the rows the last two overlapping chunks
share, a chunk's evaluation from ``fun``'s trace, and the loop over chunks with its
rematerialization policy. Shared by the monoid folds (``engines.scan``), their tangents
(``engines.scan_tangent``) and the maps and generic reductions (``engines.scan_map``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from ..core import config as _config
from ..core import progress as _progress
from ..core.sharding import Lanes, on_context_mesh
from ..core.trace import Traced, size
from ..monoids.base import index_dtype
from ..monoids.reduction import LeafReduction, MonoidReduction
from ..plan.base import Plan

__all__ = ["LARGE_FUN", "RECOMPUTED"]

RECOMPUTED = "adv_jax_math.recomputed"  # checkpoint_name of values a gradient recomputes
LARGE_FUN = 100  # equations (sub-jaxprs included): a fun this large is materialized


def _remat(f: Callable) -> Callable:
    """``f`` rematerialized in a gradient (O(batch_size) memory); with ``remat`` off,
    only the values named :data:`RECOMPUTED` (slices of loop inputs and constants,
    cheaper to take again than to store per chunk) are."""
    if _config.current().remat:
        return jax.checkpoint(f, prevent_cse=False)
    return jax.checkpoint(f, prevent_cse=False, policy=_save_all_but_recomputed)


def _save_all_but_recomputed(prim: Any, *_: Any, **params: Any) -> bool:
    # A slice is a copy: it is taken again rather than stored per chunk (the value
    # before the name is a dynamic_slice; jax's save_anything_except_these_names
    # saves everything, named values too).
    if prim.name == "name":
        return params.get("name") != RECOMPUTED
    return prim.name != "dynamic_slice"


def _steps(step: Callable, init: Any, k: int, *, rows: int) -> tuple[Any, Any]:
    """``state, y = step(i, state)`` for ``i`` in ``range(k)`` in a scan; the ``y``
    are stacked. The index is scanned over, not carried: a carried counter would be
    a residual that keeps the forward loop alive in a gradient. ``init`` is typed on
    the context mesh (``on_context_mesh``): a nested call's loop is vmapped over the
    outer rows."""
    start = on_context_mesh(init)
    return _progress.scan(lambda state, i: step(i, state), start, jnp.arange(k), rows=rows)


# -- the rows of a plan: shares, chunks, indices ---------------------------------------
@dataclasses.dataclass(frozen=True)
class _Rows:
    """How a plan's rows are cut: ``m`` rows per share (``d`` shares, one per device,
    or one), chunks of ``b`` rows, the last ``r`` of them repeated (overlap) or a
    remainder of ``r`` rows apart; ``offset`` is the global index of the first row."""

    plan: Plan
    offset: int

    @property
    def lanes(self) -> Lanes | None:
        lanes = self.plan.lanes
        return lanes if lanes is not None and lanes.count > 1 else None

    @property
    def d(self) -> int:
        return self.lanes.count if self.lanes else 1

    @property
    def m(self) -> int:
        assert self.plan.n is not None
        return self.plan.n

    def whole(self, x: Any) -> Any:
        """A leaf of all the plan's rows (every share, in order)."""
        return x if not self.lanes else self.lanes.constrain(x)

    def view(self, x: Any) -> Any:
        """A leaf as ``(d, m, ...)`` (as it is for one share)."""
        if not self.lanes:
            return x
        return self.lanes.constrain(x.reshape(self.d, self.m, *x.shape[1:]))

    def unview(self, y: Any) -> Any:
        if not self.lanes:
            return y
        return self.lanes.constrain(y.reshape(self.d * self.m, *y.shape[2:]))

    def take(self, views: list, start: Any, rows: int, *, named: bool = True) -> list:
        """``rows`` rows of every share from ``start``, as one chunk for ``fun``
        (``named``: a slice a gradient takes again, see ``_remat``; not for tangents,
        which have no transpose through a name)."""
        axis = 1 if self.lanes else 0
        out = []
        for v in views:
            c = lax.dynamic_slice_in_dim(v, start, rows, axis)
            c = checkpoint_name(c, RECOMPUTED) if named else c
            out.append(c if not self.lanes else self.lanes.constrain(c.reshape(-1, *c.shape[2:])))
        return out

    def shares(self, y: jax.Array, rows: int) -> jax.Array:
        """A chunk output ``(d * rows, ...)`` as ``(d, rows, ...)``."""
        if not self.lanes:
            return y
        return self.lanes.constrain(y.reshape(self.d, rows, *y.shape[1:]))

    def index(self, start: Any, rows: int) -> jax.Array:
        """Global row indices of a chunk: ``(rows,)``, or ``(d, rows)`` with lanes."""
        local = self.offset + start + jnp.arange(rows, dtype=index_dtype())
        if not self.lanes:
            return local
        first = jnp.arange(self.d, dtype=index_dtype())[:, None] * self.m
        return self.lanes.constrain(first + local[None])

    def per_share(self, f: Callable, last: int | None = None) -> Callable:
        """``f`` over one share's arrays, mapped over the device axis with lanes (the
        last argument, e.g. the final state, is shared unless ``last=0``)."""
        return f if not self.lanes else jax.vmap(f, in_axes=(0, 0, None, last))


def _start(i: jax.Array, m: int, rows: int) -> jax.Array:
    """The first row of overlapping chunk ``i``: ``i * rows``, the last at ``m - rows``."""
    return jnp.minimum(i * rows, m - rows)


def _place(i: jax.Array, k: int) -> jax.Array:
    """0 for most chunks, 1 for the one before the last, 2 for the last."""
    return (i == k - 2).astype(jnp.int32) + 2 * (i == k - 1).astype(jnp.int32)


def _keep_table(leaf: LeafReduction, dtype: Any, r: int, rows: int) -> np.ndarray:
    """How much each row of a chunk counts, by place (see :func:`_place`): the ``r``
    rows the last two chunks share count for half in both, or only in the first."""
    table = np.ones((3, rows), np.float32)
    if r:
        half = leaf.monoid.halves_for(dtype)
        table[2, :r] = 0.5 if half else 0.0
        if half:
            table[1, -r:] = 0.5
    return table


def _weights(
    rows: _Rows, leaf: LeafReduction, dtypes: list, r: int, place: Any, *, keep: bool
) -> Any:
    """This chunk's row weights for ``leaf``: the monoid's encoding (``keep=False``)
    or the 0/1/half weights themselves; None when every row counts once. A row of a
    constant table (a mask or a select in the loop measured 8-9x slower on XLA:CPU)."""
    if not r:
        return None
    table = _keep_table(leaf, dtypes[0], r, rows.plan.rows_per_chunk)
    if not keep:
        table = leaf.monoid.encode(table, dtypes[0], np)
        if table is None:
            return None
    row = lax.dynamic_index_in_dim(jnp.asarray(table), place, 0, False)
    return checkpoint_name(row, RECOMPUTED)


def _evaluator(traced: Traced) -> Callable[[list], list]:
    """A chunk's prepared outputs from ``fun``'s trace; a large ``fun`` is materialized
    before it is reduced: XLA would fuse it into every reduction reading it and
    compile and run it several times (360 equations: compile 15 s -> 0.5 s, run
    1400 -> 22 ms). Cheap funs stay fused: materializing cost 9x on XLA:CPU."""
    closed = traced.jaxpr
    large = size(closed.jaxpr) >= LARGE_FUN
    barrier: Callable = lax.optimization_barrier if large else (lambda y: y)
    return lambda leaves: barrier(jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves))


def _items(reduction: MonoidReduction, leaf: LeafReduction, out_shape: Any) -> tuple:
    """One row of each leaf ``leaf`` reads, from the prepared outputs' shapes."""
    return leaf.items(reduction.reads(jax.tree.leaves(out_shape), leaf))
