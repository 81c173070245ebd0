"""Trace a user function once and reuse its jaxpr.

Every engine needs the output structure of ``fun`` before it runs the loop (to
seed a carry, to check row counts, to hoist constants into a kernel). Tracing
``fun`` for that and again inside the loop would run the user's Python twice;
instead we trace it once to a closed jaxpr and evaluate that jaxpr everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun

__all__ = ["Traced", "rows_aval", "size", "sub_jaxprs", "trace"]


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
