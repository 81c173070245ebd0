"""Trace a user function once and reuse its jaxpr.

Every engine needs the output structure of ``fun`` before it runs the loop (to
seed a carry, to check row counts, to hoist constants into a kernel). Tracing
``fun`` for that and again inside the loop would run the user's Python twice;
instead we trace it once to a closed jaxpr and evaluate that jaxpr everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

__all__ = ["Traced", "rows_aval", "trace"]


@dataclass(frozen=True, eq=False)
class Traced:
    """``fun`` traced on one input shape: call it like ``fun`` on that shape."""

    jaxpr: ClosedJaxpr
    out_shape: Any  # pytree of jax.ShapeDtypeStruct

    def __call__(self, x: Any) -> Any:
        flat = jaxpr_as_fun(self.jaxpr)(*jax.tree.leaves(x))
        return jax.tree.unflatten(jax.tree.structure(self.out_shape), flat)


def trace(fun: Callable, x_aval: Any) -> Traced:
    """Trace ``fun`` on the pytree of ``jax.ShapeDtypeStruct`` ``x_aval``."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(x_aval)
    return Traced(closed, out_shape)


def rows_aval(xs: Any, rows: int) -> Any:
    """The avals of ``xs`` with the leading (mapped) dimension set to ``rows``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), xs)
