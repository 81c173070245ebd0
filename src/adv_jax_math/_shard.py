"""The shard layer: ``shard=True`` spreads a call over a one-dimensional mesh.

The divisible prefix of the rows (``n - n % D`` for ``D`` devices) is split
evenly across the devices; each device runs the same engine as an unsharded call
on its local rows, with ``batch_size`` bounding its chunks (and a local remainder
where the plan needs one). The last ``n % D`` rows, the global remainder, are
evaluated once, on the first device, and handed to the others with an
all-gather: its transpose returns cotangents to that device only, so gradients
count the remainder once. Reductions are combined across devices and the result
is replicated; a map's prefix stays sharded along the mesh axis, and when there is
a global remainder the concatenated output is replicated.

Multi-host runs use the same code on a global mesh after
``jax.distributed.initialize()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

if TYPE_CHECKING:
    from ._plan import Plan

__all__ = ["ShardLayout", "as_global", "resolve_mesh", "run_sharded"]


def resolve_mesh(mesh: Any) -> Mesh:
    """``mesh`` checked to be one-dimensional and ``AxisType.Auto``; by default a
    mesh over every device of every process."""
    if mesh is None:
        return jax.make_mesh((jax.device_count(),), ("devices",), axis_types=(AxisType.Auto,))
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"shard=True needs a one-dimensional mesh, got axes {mesh.axis_names} with shape "
            f"{dict(mesh.shape)}; make one with jax.make_mesh((n,), ('x',), "
            "axis_types=(jax.sharding.AxisType.Auto,))"
        )
    if tuple(mesh.axis_types) != (AxisType.Auto,):
        raise ValueError(
            f"shard=True needs the mesh axis to be AxisType.Auto, got {mesh.axis_types}; "
            "make the mesh with axis_types=(jax.sharding.AxisType.Auto,)"
        )
    return mesh


def as_global(x: Any, mesh: Mesh) -> jax.Array:
    """An array ``shard_map`` over ``mesh`` accepts.

    Arrays (and tracers) on ``Auto`` axes pass through; ``shard_map`` moves them.
    Arrays on ``Explicit`` axes are resharded to a replicated layout on ``mesh``
    (``shard_map`` cannot take them directly). Host values are replicated over
    ``mesh``, so every process of a multi-host run holds the same global array.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    if not isinstance(x, jax.Array):
        return jax.device_put(np.asarray(x), replicated)
    sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and AxisType.Explicit in sharding.mesh.axis_types:
        return jax.device_put(x, replicated)
    return x


@dataclass(frozen=True)
class ShardLayout:
    """How rows are spread over the mesh; ``local`` and ``remainder`` are the plans
    each device runs on its rows and the one run for the global remainder."""

    mesh: Mesh
    prefix: int
    local_rows: int
    global_remainder: int
    local: Plan | None
    remainder: Plan | None

    @property
    def devices(self) -> int:
        return self.mesh.size

    def __str__(self) -> str:
        text = f"{self.devices} devices on mesh axis {self.mesh.axis_names[0]!r}: "
        if self.local is not None:
            text += (
                f"prefix of {self.prefix} rows, {self.local_rows} per device ({_brief(self.local)})"
            )
        else:
            text += "no divisible prefix"
        if self.remainder is not None:
            text += f"; global remainder of {self.global_remainder} rows on the first device"
            text += f" ({_brief(self.remainder)})"
        return text


def _brief(plan: Plan) -> str:
    text = f"{plan.chunks} chunk(s) of {plan.rows} rows"
    if plan.masked:
        text += f", {plan.masked} masked"
    if plan.remainder:
        text += f", local remainder of {plan.remainder}"
    return text


def layout(mesh: Mesh, n: int, plan_rows: Callable[[int], Plan]) -> ShardLayout:
    """Split ``n`` rows over ``mesh``; ``plan_rows(rows)`` plans a local call."""
    d = mesh.size
    prefix, rest = n - n % d, n % d
    return ShardLayout(
        mesh=mesh,
        prefix=prefix,
        local_rows=prefix // d,
        global_remainder=rest,
        local=plan_rows(prefix // d) if prefix else None,
        remainder=plan_rows(rest) if rest else None,
    )


def _combine_across(plan: Plan, partial: Any, axis: str, reduction: Callable) -> Any:
    """Combine each device's reduced result; the output is the same on every device."""
    gathered = jax.tree.map(lambda p: lax.all_gather(p, axis), partial)
    if plan.monoid is not None:
        return jax.tree.map(lambda g: plan.monoid.monoid.reduce(g, axis=0), gathered)
    first = jax.tree.map(lambda g: g[0], gathered)
    rest = jax.tree.map(lambda g: g[1:], gathered)
    out, _ = lax.scan(lambda acc, p: (reduction(acc, p), None), first, rest)
    return out


def _on_first_device(run: Callable[[], Any], axis: str) -> Any:
    """Evaluate ``run()`` on the first device only; every device gets its result."""
    shape = jax.eval_shape(run)
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)
    out = lax.cond(lax.axis_index(axis) == 0, run, zeros)
    # all_gather(...)[0], not a psum: its transpose sends cotangents to device 0 only.
    return jax.tree.map(lambda y: lax.all_gather(y, axis)[0], out)


def run_sharded(
    plan: Plan,
    execute: Callable[[Any], Any],
    xs: Any,
    reduction: Callable | None,
) -> Any:
    """Run ``plan`` (with ``plan.shard`` set) over its mesh.

    ``execute(rows)`` plans and runs the unsharded engine on a device's rows. It
    plans again inside the per-device function (the plans in ``plan.shard`` are
    for explain()): ``fun`` is traced where it runs, so constants it closes over
    are captured by ``shard_map`` as usual.
    """
    lay = plan.shard
    mesh, axis = lay.mesh, lay.mesh.axis_names[0]
    head = jax.tree.map(lambda x: x[: lay.prefix], xs)
    tail = jax.tree.map(lambda x: x[lay.prefix :], xs)
    is_map = plan.kind == "map"

    def body(head: Any, tail: Any) -> Any:
        outs = []
        if lay.local is not None:
            local = execute(head)
            outs.append(local if is_map else _combine_across(plan, local, axis, reduction))
        if lay.remainder is not None:
            outs.append(_on_first_device(lambda: execute(tail), axis))
        return tuple(outs)

    sharded, replicated = PartitionSpec(axis), PartitionSpec()
    out_specs = []
    if lay.local is not None:
        out_specs.append(sharded if is_map else replicated)
    if lay.remainder is not None:
        out_specs.append(replicated)
    outs = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(sharded, replicated),
        out_specs=tuple(out_specs),
        check_vma=False,
    )(head, tail)
    if len(outs) == 1:
        return outs[0]
    if not is_map:
        if plan.monoid is not None:
            return plan.monoid.combine(*outs)
        return reduction(*outs)
    joined = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *outs)
    return jax.lax.with_sharding_constraint(joined, NamedSharding(mesh, replicated))
