"""Shardings of the user's arrays: where rows live, and placing values on a mesh.

With sharding in types (``AxisType.Explicit``, the default of ``jax.make_mesh`` in
jax 0.12) every array carries its mesh and partition spec, and operations whose
operands disagree raise. These helpers read an input's sharding (its type, or a
concrete array's ``NamedSharding``) and build values that agree with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

__all__ = [
    "Lanes",
    "RowSharding",
    "context_mesh",
    "explicit",
    "explicit_context",
    "follow_layout",
    "kernel_blocked",
    "mesh_context",
    "on_context_mesh",
    "on_every_device",
    "place",
    "row_sharding",
    "sharding_of",
    "typed_mesh",
    "whole",
    "zeros",
]


def sharding_of(x: Any) -> NamedSharding | None:
    """``x``'s named sharding: a concrete array's own (Auto axes too), else its type's
    (tracers; only Explicit axes appear in types); None for host values."""
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return sharding if isinstance(sharding, NamedSharding) else None
    if isinstance(x, jax.ShapeDtypeStruct | jax.core.Tracer):
        try:
            sharding = jax.typeof(x).sharding if isinstance(x, jax.core.Tracer) else sharding
        except Exception:  # no aval (an exotic tracer)
            return None
        return sharding if isinstance(sharding, NamedSharding) else None
    return None


def explicit(sharding: Any) -> TypeGuard[NamedSharding]:
    """A named sharding on a mesh with an Explicit axis (sharding in types)."""
    return isinstance(sharding, NamedSharding) and AxisType.Explicit in tuple(
        sharding.mesh.axis_types
    )


class RowSharding:
    """The mesh axes an input's rows are split over (more than one device)."""

    def __init__(self, mesh: Any, axes: tuple[str, ...]):
        self.mesh, self.axes = mesh, axes

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    def __repr__(self) -> str:
        return f"RowSharding({dict(self.mesh.shape)}, axes={self.axes})"


def row_sharding(xs: Any) -> RowSharding | None:
    """Where the rows of ``xs`` live: the mesh axes the first leaf whose leading axis
    is split over several devices uses, or None when every leaf has its rows whole
    on each device (replicated, single-device, host values)."""
    for x in jax.tree.leaves(xs):
        sharding = sharding_of(x)
        if sharding is None or not np.ndim(x) or not len(sharding.spec):
            continue
        entry = sharding.spec[0]  # a mesh axis, several, or None
        axes = tuple(entry) if isinstance(entry, tuple | list) else (entry,) if entry else ()
        if axes and math.prod(sharding.mesh.shape[a] for a in axes) > 1:
            return RowSharding(sharding.mesh, axes)
    return None


@dataclasses.dataclass(frozen=True)
class Lanes:
    """Rows spread over devices within one program: ``count`` equal shares, share
    ``d`` living on device ``d`` of the mesh axes ``axes``. Arrays of a share's shape
    with a leading ``count`` axis are kept sharded along it: in their types on
    Explicit axes, by a sharding constraint on Auto axes."""

    count: int
    mesh: Any = dataclasses.field(compare=False)
    axes: tuple[str, ...] = ()

    def spec(self) -> PartitionSpec:
        return PartitionSpec(self.axes[0] if len(self.axes) == 1 else self.axes)

    def constrain(self, a: jax.Array) -> jax.Array:
        """``a`` with its leading axis split over the lanes' devices (on the mesh,
        also for one device)."""
        return self._put(a, self.spec())

    def gather(self, a: jax.Array) -> jax.Array:
        """``a`` (a device axis first) whole on every device: small states to merge."""
        return self._put(a, PartitionSpec())

    def _put(self, a: jax.Array, spec: PartitionSpec) -> jax.Array:
        sharding = NamedSharding(self.mesh, spec)
        if AxisType.Explicit in tuple(self.mesh.axis_types):
            return jax.sharding.reshard(a, sharding)
        return jax.lax.with_sharding_constraint(a, sharding)


def context_mesh() -> Any:
    """The mesh set with ``jax.set_mesh`` (inside ``jit``: its abstract mesh), or None."""
    mesh: Any
    try:
        mesh = jax.sharding.get_mesh()
        if not getattr(mesh, "empty", True):
            return mesh
    except Exception:  # inside jit get_mesh raises: the abstract mesh is what is visible
        pass
    mesh = jax.sharding.get_abstract_mesh()
    return None if getattr(mesh, "empty", True) else mesh


def place(x: Any, mesh: Any, spec: PartitionSpec) -> Any:
    """``x`` as an argument ``shard_map`` over ``mesh`` takes with ``spec``: on
    Explicit axes shard_map requires the argument's type to match ``spec``, so the
    value is resharded (it must be on ``mesh`` already, or unsharded); on Auto axes
    it passes as it is (shard_map moves it)."""
    if explicit(sharding_of(x)) or AxisType.Explicit in tuple(mesh.axis_types):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return x


@jax.custom_jvp
def _follow(x: jax.Array) -> jax.Array:
    return x


@_follow.defjvp
def _follow_jvp(primals: tuple, tangents: tuple) -> tuple:
    (x,), (dx,) = primals, tangents
    # the same tangent either way, read through a select on x: XLA places the tangent
    # (and the cotangent, the select's transpose) where x lives
    return x, jnp.where(jnp.isnan(x), dx, dx)


def follow_layout(xs: Any) -> Any:
    """``xs`` unchanged, with derivatives laid out as each value is on Auto axes.

    On an Auto mesh a sharding is no part of a value's type: inside ``jit`` XLA
    places each value, and it gathered the cotangent of rows split over devices
    on every device (the chunks' cotangents are written into a buffer it sees no
    reason to split), where plain JAX keeps the rows' sharding. Tied to its primal
    through a select, the cotangent goes where the primal is. Floating leaves on a
    mesh with an Auto axis over several devices only (Explicit axes carry their
    sharding in the type; elsewhere nothing is split).
    """

    def follow(x: Any) -> Any:
        if not isinstance(x, jax.Array) or not jnp.issubdtype(x.dtype, jnp.inexact):
            return x
        mesh = getattr(jax.typeof(x).sharding, "mesh", None)
        sizes, types = getattr(mesh, "axis_sizes", ()), getattr(mesh, "axis_types", ())
        split = any(t == AxisType.Auto and k > 1 for k, t in zip(sizes, types, strict=True))
        return _follow(x) if split else x

    return jax.tree.map(follow, xs)


def whole(a: Any) -> Any:
    """``a`` replicated where its type has it split (Explicit axes): read whole by
    every device (as a value closed over is), e.g. every row of ``y`` by every x row
    of a pairwise reduction, or the tiles' loops over rows."""
    sharding = sharding_of(a)
    if not explicit(sharding) or all(s is None for s in sharding.spec):
        return a
    return jax.sharding.reshard(a, NamedSharding(sharding.mesh, PartitionSpec()))


def explicit_context() -> Any:
    """The abstract context mesh where it has an Explicit axis (a kernel there runs in
    a ``shard_map``; values start on it), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if getattr(mesh, "empty", True) or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    return mesh


def kernel_blocked() -> str | None:
    """Why no kernel can run here, or None: under an Explicit context mesh a kernel
    runs in a ``shard_map`` (mesh axes manual), which jax refuses inside a ``vmap``
    over rows typed on those axes (``shard=True``'s spread rows, or a user's
    ``jax.vmap``): "all mesh axes are already manual". Found by tracing an empty
    ``shard_map`` here."""
    mesh = explicit_context()
    if mesh is None:
        return None
    empty = jax.shard_map(lambda: jnp.zeros(()), mesh=mesh, in_specs=(), out_specs=PartitionSpec())
    try:
        jax.eval_shape(empty)
    except ValueError:
        axes = ", ".join(map(str, mesh.axis_names))
        return (
            f"inside a vmap over rows typed on the Explicit mesh axes ({axes}), which a "
            "kernel's shard_map cannot take manual"
        )
    return None


def on_every_device(kernel: Callable, *args: Any) -> Any:
    """``kernel(*args)``; under an Explicit mesh (the context's, or that of ``args``'
    types) on every device, its arguments replicated: a kernel runs with manual mesh
    axes only (as the 1-D kernel does)."""
    with typed_mesh(args):
        mesh = explicit_context()
        if mesh is None:
            return kernel(*args)
        replicated = NamedSharding(mesh, PartitionSpec())
        args = jax.tree.map(lambda a: jax.sharding.reshard(jnp.asarray(a), replicated), args)
        spec = PartitionSpec()
        run = jax.shard_map(kernel, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        return run(*args)


def zeros(shape: tuple[int, ...], dtype: Any, like: Any = None, fill: Any = 0) -> jax.Array:
    """``jnp.full(shape, fill, dtype)`` with the sharding of ``like`` (a
    ``ShapeDtypeStruct`` or array of the same rank) when that is in its type, so
    that it can be updated with, or carried next to, values of that type."""
    out = jnp.full(shape, fill, dtype)
    sharding = sharding_of(like) if like is not None else None
    if explicit(sharding) and len(sharding.spec) <= len(shape):
        out = jax.sharding.reshard(out, sharding)
    return out


def on_context_mesh(tree: Any) -> Any:
    """``tree``'s arrays typed on no mesh, replicated on the context mesh when it has
    an Explicit axis (others unchanged). A loop's carry that starts as such a value
    and is batched later (a ``scan`` under ``vmap`` over rows split on that axis)
    would otherwise be typed on the empty mesh with the rows' axis, which jax refuses
    (``Resource axis ... not found in mesh: ()``)."""
    mesh = explicit_context()
    if mesh is None:
        return tree

    def put(x: Any) -> Any:
        sharding = getattr(jax.typeof(x), "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.empty:
            return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec()))
        return x

    return jax.tree.map(put, tree)


@contextlib.contextmanager
def typed_mesh(*values: Any) -> Iterator[None]:
    """The mesh of the first of ``values`` typed on Explicit axes, made the context
    mesh when none is set: JAX builds values that must agree with typed operands
    (zeros for cotangents, buffers) on the context mesh, and without one they come
    out unsharded. Outside ``jit`` a concrete mesh is set (``jax.set_mesh``), inside
    its abstract mesh (``use_abstract_mesh``); the enclosing ``jit`` records it."""
    mesh = None
    if context_mesh() is None:
        for x in jax.tree.leaves(values):
            sharding = sharding_of(x)
            if explicit(sharding):
                concrete = getattr(x, "sharding", None)
                mesh = getattr(concrete, "mesh", None) or sharding.mesh
                break
    with contextlib.nullcontext() if mesh is None else mesh_context(mesh):
        yield


@contextlib.contextmanager
def mesh_context(mesh: Any) -> Iterator[None]:
    """``mesh`` made the context mesh: set with ``jax.set_mesh`` outside ``jit``; inside
    (``set_mesh`` refuses), or for an abstract mesh, its abstract mesh set."""
    context: contextlib.AbstractContextManager[Any]
    concrete = isinstance(mesh, jax.sharding.Mesh)
    try:
        if not concrete:
            raise ValueError("an abstract mesh")
        context = jax.set_mesh(mesh)
        context.__enter__()
    except ValueError:  # "set_mesh can only be used outside of jax.jit"
        context = jax.sharding.use_abstract_mesh(mesh.abstract_mesh if concrete else mesh)
        context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)
