"""Trace a user function once per call and reuse its jaxpr.

Every engine needs the output structure of ``fun`` before it runs the loop (to
seed a carry, to check row counts, to hoist constants into a kernel). Tracing
``fun`` for that and again inside the loop would run the user's Python twice;
instead the planner traces it once per chunk shape to a closed jaxpr, and every
chunk of the call evaluates that jaxpr.

Each call traces afresh: ``jax.make_jaxpr`` keeps a cache keyed on the function
object, so a ``fun`` whose closure changed between two eager calls would otherwise
mix an old trace (the chunks) with a new one (a remainder), a result neither
version of ``fun`` computes. Under ``jax.jit`` the whole call is cached by JAX, as
any jitted code is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun

from .sharding import explicit

__all__ = ["Traced", "fresh_jaxpr", "rebind", "rows_aval", "size", "sub_jaxprs", "trace"]


@dataclass(frozen=True, eq=False)
class Traced:
    """``fun`` traced on one input shape: call it like ``fun`` on that shape."""

    jaxpr: ClosedJaxpr
    out_shape: Any  # pytree of jax.ShapeDtypeStruct

    def __call__(self, x: Any) -> Any:
        flat = jaxpr_as_fun(self.jaxpr)(*jax.tree.leaves(x))
        return jax.tree.unflatten(jax.tree.structure(self.out_shape), flat)

    @property
    def consts(self) -> list[Any]:
        return list(self.jaxpr.consts)

    def with_consts(self, values: Mapping[int, Any]) -> Traced:
        """The same jaxpr with each constant ``c`` replaced by ``values[id(c)]`` (if
        present): e.g. a device's copies inside ``shard_map``."""
        return Traced(rebind(self.jaxpr, values), self.out_shape)


def rebind(closed: ClosedJaxpr, values: Mapping[int, Any]) -> ClosedJaxpr:
    """``closed`` with its constants looked up in ``values`` by ``id``."""
    consts = [values.get(id(c), c) for c in closed.consts]
    return ClosedJaxpr(closed.jaxpr, consts)


def fresh_jaxpr(fun: Callable, *args: Any, return_shape: bool = False) -> Any:
    """``jax.make_jaxpr(fun, return_shape=...)(*args)``, tracing ``fun`` now (never a
    cached trace of the same function object: see the module docstring)."""
    fresh = lambda *a: fun(*a)
    if return_shape:
        return jax.make_jaxpr(fresh, return_shape=True)(*args)
    return jax.make_jaxpr(fresh)(*args)


def trace(fun: Callable, x_aval: Any) -> Traced:
    """Trace ``fun`` on the pytree of ``jax.ShapeDtypeStruct`` ``x_aval``."""
    closed, out_shape = fresh_jaxpr(fun, x_aval, return_shape=True)
    return Traced(closed, out_shape)


def rows_aval(xs: Any, rows: int) -> Any:
    """The avals of ``xs`` with the leading (mapped) dimension set to ``rows``, typed
    as a slice of its rows is (:func:`_row_slice_sharding`)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (rows, *x.shape[1:]), x.dtype, sharding=_row_slice_sharding(x)
        ),
        xs,
    )


def _row_slice_sharding(x: Any) -> Any:
    """The type's sharding of ``x``'s rows sliced, when it is on a mesh with an
    Explicit axis and its rows are whole (the chunks a loop takes have it), else None
    (no mesh). ``fun`` is traced once and its jaxpr evaluated on the chunks: a ``jit``
    inside ``fun`` (a nested ``batch_map``) keeps the types it was traced with, and
    its transpose returns cotangents of those types, which a chunk's slice typed on
    the mesh refuses to take back (``dynamic_update_slice`` of a cotangent on no mesh
    into one on the mesh)."""
    try:
        sharding = jax.typeof(x).sharding if np.ndim(x) else None
    except TypeError:  # not an array type
        return None
    if not explicit(sharding) or (len(sharding.spec) and sharding.spec[0] is not None):
        return None  # on no mesh, or rows split over devices (the engine lays them out)
    return sharding


def sub_jaxprs(params: dict[str, Any]) -> Iterator[Jaxpr]:
    """The jaxprs inside an equation's parameters (call bodies, branches, scan bodies);
    ``jax.extend.core.jaxprs_in_params`` does this from jax 0.10 on."""
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, Jaxpr):
                yield item


def size(jaxpr: Jaxpr) -> int:
    """Equations of ``jaxpr`` and of the jaxprs inside it."""
    return sum(1 + sum(size(sub) for sub in sub_jaxprs(e.params)) for e in jaxpr.eqns)
