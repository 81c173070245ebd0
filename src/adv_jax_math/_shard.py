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

from . import _tangent as tangent
from ._monoid import ADD
from ._plan import Call, Kind, Plan, Policy, Rejection
from ._trace import rows_aval

__all__ = ["ShardEngine", "as_global"]


def as_global(x: Any, mesh: Mesh) -> jax.Array | jax.ShapeDtypeStruct:
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

    def __init__(self, run_local: Callable[[Call], Any], run_call: Callable[[Call], Any]):
        self.run_local = run_local
        self.run_call = run_call

    def accept(self, plan: Plan, call: Call) -> Plan | Rejection:
        if plan.policy is not Policy.SHARDED:
            return Rejection("shard=False")
        lay = plan.shard
        assert lay is not None  # a SHARDED plan carries its layout
        first = lay.local or lay.remainder
        assert first is not None  # n > 0 rows: a divisible prefix, a remainder or both
        return dataclasses.replace(
            plan,
            engine=self.name,
            reason=f"shard_map over {lay.devices} devices, each running {first.engine}",
            error=first.error,
        )

    def run(self, plan: Plan, call: Call) -> Any:
        leaves = plan.reduction.leaves if plan.reduction is not None else ()
        if tangent.SUPPORTED and any(leaf.monoid.selects for leaf in leaves):
            return self._even_ties(plan, call)
        return _run_sharded(plan, lambda rows: self.run_local(call.with_rows(rows)), call)

    def _even_ties(self, plan: Plan, call: Call) -> Any:
        """Max/min across devices with every tied row, on any device, sharing the
        derivative evenly (as ``jax.grad(jnp.max)``): the forward pass as usual; the
        tangent from a sharded sum whose JVP is the tangent of each leaf's monoid
        (max/min: the tied rows' tangents over their global count; add: the sum;
        logsumexp: the softmax-weighted sum). ``fun``'s closed-over tracers become
        explicit arguments, so their tangents are not lost."""
        reduction = plan.reduction
        assert reduction is not None  # run() found max/min leaves in it
        consts = _closed_over(call.fun, call.xs)

        def with_consts(cs: Any, xs: Any) -> Call:
            return dataclasses.replace(call, fun=_with_values(call.fun, consts, cs), xs=xs)

        @jax.custom_jvp
        def run(cs: Any, xs: Any) -> Any:
            sub = with_consts(cs, xs)
            return _run_sharded(plan, lambda rows: self.run_local(sub.with_rows(rows)), sub)

        def run_jvp(primals: Any, tangents: Any) -> Any:
            out = run(*primals)
            totals = [lax.stop_gradient(t) for t in jax.tree.leaves(out)]

            def terms(fun_rows: Callable) -> Callable:
                def chunk(rows: Any) -> list:
                    parts = []
                    ys = reduction.prepare(fun_rows)(rows)
                    for y, leaf, t in zip(ys, reduction.leaves, totals, strict=True):
                        t = t.reshape(y.shape[1:] if leaf.axis == 0 else ()).astype(y.dtype)
                        if leaf.monoid.selects:
                            hit = y == t
                            parts += [jnp.where(hit, y, 0), hit.astype(y.dtype)]
                        elif leaf.monoid.name == "logsumexp":
                            parts += [jnp.exp(y - t)]
                        else:
                            parts += [y]
                    return parts

                return chunk

            axes = [a for leaf in reduction.leaves for a in [leaf.axis] * (1 + leaf.monoid.selects)]
            sums = lambda parts: [jnp.sum(v, axis=a) for v, a in zip(parts, axes, strict=True)]

            def surrogate(cs: Any, xs: Any) -> list:
                sub = with_consts(cs, xs)
                return self.run_call(
                    dataclasses.replace(
                        sub, fun=terms(sub.fun), reduction=ADD, chunk_reduction=sums
                    )
                )

            parts, dparts = jax.jvp(surrogate, primals, tangents)
            dout, i = [], 0
            for leaf, t in zip(reduction.leaves, totals, strict=True):
                d = (
                    dparts[i] / lax.stop_gradient(parts[i + 1])
                    if leaf.monoid.selects
                    else dparts[i]
                )
                i += 1 + leaf.monoid.selects
                dout.append(d.reshape(t.shape).astype(t.dtype))
            return out, jax.tree.unflatten(jax.tree.structure(out), dout)

        run.defjvp(run_jvp)
        return run(consts, call.xs)


def _closed_over(fun: Callable, xs: Any) -> list:
    """The tracers ``fun`` closes over (outer transformations' values)."""
    return list(jax.closure_convert(fun, rows_aval(xs, jax.tree.leaves(xs)[0].shape[0]))[1])


def _with_values(fun: Callable, consts: list, values: list) -> Callable:
    """``fun`` with the tracers it closes over (``consts``) replaced by ``values``, at
    any number of rows (``jax.closure_convert`` is specific to one input shape)."""

    def call(rows: Any) -> Any:
        converted, hoisted = jax.closure_convert(
            fun, rows_aval(rows, jax.tree.leaves(rows)[0].shape[0])
        )
        index = {id(c): i for i, c in enumerate(consts)}
        return converted(rows, *(values[index[id(c)]] if id(c) in index else c for c in hoisted))

    return call


def _combine_across(plan: Plan, partial: Any, axis: str, reduction: Callable | None) -> Any:
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
    assert reduction is not None  # Kind.GENERIC: the user's reduction
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
    assert lay is not None
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
        assert reduction is not None  # Kind.GENERIC: the user's reduction
        return reduction(*outs)
    joined = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *outs)
    return jax.lax.with_sharding_constraint(joined, NamedSharding(mesh, replicated))
