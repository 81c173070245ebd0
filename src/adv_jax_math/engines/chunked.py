"""The internal chunked call: :func:`prepare` validates the arguments of a chunked
call into a :class:`~..plan.base.Call` (the public ``batch_map`` and ``batch_vmap``
use it), and :func:`chunked` plans and runs one on the installed engines. The
pairwise scan route calls :func:`chunked`, not the public ``batch_map``: it does
not re-enter the front end (no nested-call listening, no argument forms of the
public API)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..analysis.validate import batch_size_from, check_callable, check_reduction, resolve_mesh
from ..core.sharding import on_context_mesh
from ..monoids.base import identity
from ..plan.base import Call
from . import registry
from .shard import as_global

__all__ = ["check_callables", "chunked", "prepare"]


def check_callables(fun: Any, reduction: Any, chunk_reduction: Any) -> None:
    """A clear error unless ``fun`` and ``chunk_reduction`` are callable and
    ``reduction`` is None, a binary callable or a pytree of monoids."""
    check_callable(fun, "fun")
    check_reduction(reduction)
    check_callable(chunk_reduction, "chunk_reduction")


def _as_input(x: Any) -> Any:
    """``x`` as an array, on the context mesh when it has an Explicit axis and ``x`` is
    on no mesh (``on_context_mesh``): there JAX may type the tangent of ``x`` on that
    mesh (linearizing a ``jit``), and the cotangent of a chunk, typed as ``fun`` was
    traced (``rows_aval``), must agree with the buffer its slice is transposed into."""
    return x if isinstance(x, jax.ShapeDtypeStruct) else on_context_mesh(jnp.asarray(x))


def prepare(
    fun: Callable,
    fun_input: Any,
    batch_size: Any,
    reduction: Callable | None,
    chunk_reduction: Callable,
    shard: bool,
    mesh: Any,
    kwargs: dict[str, Any],
) -> Call:
    """Validate the arguments of :func:`batch_map` into a :class:`Call`."""
    batch_size = batch_size_from(batch_size, kwargs)
    check_callables(fun, reduction, chunk_reduction)
    if not isinstance(shard, bool):
        raise TypeError(f"shard={shard!r} must be a bool")
    if mesh is not None and not shard:
        warnings.warn("mesh is only used with shard=True; it is ignored", UserWarning, stacklevel=3)
        mesh = None
    if shard:
        mesh = resolve_mesh(mesh)
        fun_input = jax.tree.map(lambda x: as_global(x, mesh), fun_input)
    elif batch_size is not None:
        fun_input = jax.tree.map(_as_input, fun_input)
    return Call(fun, fun_input, batch_size, reduction, chunk_reduction, shard, mesh)


def chunked(
    fun: Callable,
    xs: Any,
    batch_size: Any,
    *,
    reduction: Callable | None = None,
    chunk_reduction: Callable = identity,
    shard: bool = False,
    mesh: Any = None,
) -> Any:
    """``chunk_reduction(fun(xs))`` in chunks of ``batch_size`` rows, combined with
    ``reduction`` (None: stacked): ``batch_map``'s semantics, planned and run on the
    installed engines."""
    call = prepare(fun, xs, batch_size, reduction, chunk_reduction, shard, mesh, {})
    return registry.run(registry.plan(call), call)
