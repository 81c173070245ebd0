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

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._plan import Call, Kind, Plan, Policy, Rejection

__all__ = ["ShardEngine", "as_global"]


def as_global(x: Any, mesh: Mesh) -> jax.Array:
    """An array ``shard_map`` over ``mesh`` accepts.

    Arrays (and tracers) on ``Auto`` axes pass through; ``shard_map`` moves them.
    Arrays on ``Explicit`` axes are resharded to a replicated layout on ``mesh``
    (``shard_map`` cannot take them directly). Host values are replicated over
    ``mesh``, so every process of a multi-host run holds the same global array.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if not isinstance(x, jax.Array):
        return jax.device_put(np.asarray(x), replicated)
    sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and AxisType.Explicit in sharding.mesh.axis_types:
        return jax.device_put(x, replicated)
    return x


class ShardEngine:
    """``shard_map`` over the plan's mesh; each device runs its local plan.

    ``run_local(call)`` plans and runs an unsharded call (the registry's own
    entry point), so any engine can run on the devices.
    """

    name = "shard"

    def __init__(self, run_local: Callable[[Call], Any]):
        self.run_local = run_local

    def accept(self, plan: Plan, call: Call) -> Plan | Rejection:
        if plan.policy is not Policy.SHARDED:
            return Rejection("shard=False")
        lay = plan.shard
        first = lay.local or lay.remainder
        return dataclasses.replace(
            plan,
            engine=self.name,
            reason=f"shard_map over {lay.devices} devices, each running {first.engine}",
            error=first.error,
        )

    def run(self, plan: Plan, call: Call) -> Any:
        return _run_sharded(plan, lambda rows: self.run_local(call.with_rows(rows)), call)


def _combine_across(plan: Plan, partial: Any, axis: str, reduction: Callable) -> Any:
    """Combine each device's reduced result; the output is the same on every device."""
    gathered = jax.tree.map(lambda p: lax.all_gather(p, axis), partial)
    if plan.reduction is not None:
        flat = jax.tree.leaves(gathered)
        return plan.reduction.finish(
            [
                leaf.monoid.reduce(g, axis=0)
                for g, leaf in zip(flat, plan.reduction.leaves, strict=True)
            ]
        )
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


def _run_sharded(plan: Plan, execute: Callable[[Any], Any], call: Call) -> Any:
    """Run ``plan`` (with ``plan.shard`` set) over its mesh.

    ``execute(rows)`` plans and runs the unsharded engine on a device's rows. It
    plans again inside the per-device function (the plans in ``plan.shard`` are
    for explain()): ``fun`` is traced where it runs, so constants it closes over
    are captured by ``shard_map`` as usual.
    """
    lay, reduction = plan.shard, call.reduction
    mesh, axis = lay.mesh, lay.axis
    head = jax.tree.map(lambda x: x[: lay.prefix], call.xs)
    tail = jax.tree.map(lambda x: x[lay.prefix :], call.xs)
    is_map = plan.kind is Kind.MAP

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
        if plan.reduction is not None:
            return plan.reduction.finish(
                plan.reduction.combine(*(jax.tree.leaves(o) for o in outs))
            )
        return reduction(*outs)
    joined = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *outs)
    return jax.lax.with_sharding_constraint(joined, NamedSharding(mesh, replicated))
