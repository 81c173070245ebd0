"""A validated call, and which of its values are being differentiated.

:class:`Call` is what the user passed (``xs`` may hold ``jax.ShapeDtypeStruct``);
``batch_size="auto"`` asks :func:`autodiff_leaves` whether a reverse pass will
count towards the memory budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["Call", "autodiff_leaves", "is_autodiff", "is_inexact", "tracer_layers"]

# Tracers of JAX's autodiff transformations, by class name: jax exposes no public
# way to ask whether a value is being differentiated.
_AUTODIFF_TRACERS = ("JVPTracer", "LinearizeTracer")


@dataclass(frozen=True, eq=False)
class Call:
    """A validated call: what the user passed (``xs`` may hold ShapeDtypeStructs)."""

    fun: Callable
    xs: Any
    batch_size: int | str | None  # an int, "auto" or None
    reduction: Callable | None
    chunk_reduction: Callable
    shard: bool = False
    mesh: Any = None  # shard=True: a Mesh (or the context AbstractMesh inside jit)
    # batch_size="auto": which leaves of xs are differentiated, when xs are
    # placeholders (a device's share of rows); None: look at xs themselves.
    grad_rows: tuple[bool, ...] | None = None
    # a part of a sharded call (a device's share, a global remainder): the shard layer
    # merges the parts' monoid states, so its engine must give them (``Engine.states``)
    share: bool = False

    def with_rows(self, xs: Any) -> Call:
        """The same call on other rows (a part of a sharded call), not sharded again."""
        grad_rows = self.grad_rows
        if grad_rows is None and self.batch_size == "auto":
            grad_rows = autodiff_leaves(self.xs)
        return Call(
            self.fun,
            xs,
            self.batch_size,
            self.reduction,
            self.chunk_reduction,
            grad_rows=grad_rows,
            share=True,
        )


def tracer_layers(x: Any) -> list[Any]:
    """``x`` and the tracers it wraps (``JVPTracer.primal``, ``BatchTracer.val``, ...)."""
    out: list[Any] = []
    while isinstance(x, jax.core.Tracer) and len(out) < 64:
        out.append(x)
        inner = getattr(x, "primal", None)
        x = inner if inner is not None else getattr(x, "val", None)
    return out


def is_inexact(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def is_autodiff(x: Any) -> bool:
    """A float tracer of an autodiff transformation, possibly under ``vmap`` layers."""
    layers = tracer_layers(x)
    return (
        bool(layers)
        and is_inexact(x.dtype)
        and any(type(t).__name__ in _AUTODIFF_TRACERS for t in layers)
    )


def autodiff_leaves(xs: Any) -> tuple[bool, ...]:
    """Which leaves of ``xs`` are being differentiated (see :func:`is_autodiff`)."""
    return tuple(is_autodiff(x) for x in jax.tree.leaves(xs))
