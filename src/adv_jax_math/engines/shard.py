"""The shard layer: rows spread over the devices of a mesh.

Two ways in: ``shard=True`` (the rows are split over the call's mesh: the one
passed, else the one set with ``jax.set_mesh``, else all devices), or inputs whose
rows already live on several devices (their own mesh axes: computation follows
the data, as with ``jax.vmap``). The divisible prefix of the rows (``n - n % D``
for ``D`` devices) is split evenly; one plan, made for a device's share of rows
(``batch_size`` bounding its chunks), runs on all devices at once (``Plan.lanes``):
every array keeps a leading device axis sharded over the mesh (in its type on
Explicit axes, by a sharding constraint on Auto axes), each chunk of ``fun`` takes
the same rows of every device, and each device folds its own. The last ``n % D``
rows, the global remainder, are evaluated once, replicated. Reductions merge the
devices' states (row indices are global), so ties and selections across devices
are exact; a map's prefix stays sharded, and a map with a global remainder is
replicated.

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..analysis import tangent
from ..core.sharding import Lanes, explicit, on_context_mesh, sharding_of
from ..plan.base import Call, Kind, Plan, Policy, Rejection
from . import scan as _scan
from .registry import Engine

__all__ = ["PART", "ShardEngine", "as_global"]

PART = "a part of a sharded call"  # how an engine's rejection of a part begins


def as_global(x: Any, mesh: Any) -> Any:
    """``x`` where a program over ``mesh`` can take it.

    Arrays (and tracers) on ``mesh`` or on Auto axes pass through. Arrays typed on
    another mesh's Explicit axes, and host values, are put on ``mesh`` replicated,
    so every process of a multi-host run holds the same global array. Arrays on no
    mesh while ``mesh`` is the context mesh are typed on it (``on_context_mesh``), as
    ``batch_map`` does without ``shard`` (see ``engines.chunked._as_input``).
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    replicated = NamedSharding(mesh, PartitionSpec()) if isinstance(mesh, Mesh) else None
    if not isinstance(x, jax.Array):
        return jax.device_put(np.asarray(x), replicated) if replicated is not None else x
    sharding = sharding_of(x)
    abstract = mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh
    other = explicit(sharding) and sharding.mesh.abstract_mesh != abstract
    if other and replicated is not None:
        return jax.device_put(x, replicated)
    context = jax.sharding.get_abstract_mesh()
    return on_context_mesh(x) if context == abstract else x


def _other_mesh(plan: Plan, mesh: Any) -> str:
    """Why ``plan`` cannot run: ``fun`` closes over an array typed on the Explicit axes
    of another mesh than the one its rows are spread over (its trace holds that mesh's
    shardings: it cannot be moved, nor computed with rows on another mesh); else ""."""
    abstract = mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh
    for c in plan.consts():
        sharding = sharding_of(c)
        if explicit(sharding) and sharding.mesh.abstract_mesh != abstract:
            return (
                f"shard=True spreads the rows over the mesh {dict(mesh.shape)} (axes "
                f"{tuple(mesh.axis_names)}), but fun closes over an array {np.shape(c)} "
                f"typed on the Explicit axes of the mesh {dict(sharding.mesh.shape)} (axes "
                f"{tuple(sharding.mesh.axis_names)}): call under jax.set_mesh(that mesh), "
                "so that the rows are spread over it, or pass the array as an input"
            )
    return ""


class ShardEngine(Engine):
    """Rows spread over a mesh; each part (the devices' shares, a global remainder)
    runs on the engine its plan chose, ``engine_of(name)`` (the registry's)."""

    name = "shard"

    def __init__(self, engine_of: Callable[[str], Any]):
        self.engine_of = engine_of

    def accept(self, plan: Plan, call: Call) -> Plan | Rejection:
        if plan.policy is not Policy.SHARDED:
            return Rejection("shard=False")
        lay = plan.shard
        assert lay is not None  # a SHARDED plan carries its layout
        first = lay.local or lay.remainder
        assert first is not None  # n > 0 rows: a divisible prefix, a remainder or both
        parts = (("each device's share", lay.local), ("global remainder", lay.remainder))
        declined = tuple(
            f"{label}: {name} not used: {why}"
            for label, p in parts
            if p is not None
            for name, why in p.rejected
            if why.startswith(PART)
        )
        return dataclasses.replace(
            plan,
            engine=self.name,
            reason=f"rows over {lay.devices} devices, each share running {first.engine}",
            error=first.error or _other_mesh(plan, lay.mesh),
            notes=(*plan.notes, *declined),
        )

    def describe_reverse(self, plan: Plan, call: Call) -> Plan:
        """How reverse mode runs: where a part's engine is not the scan engine, its
        states have the scan engine's tangent, transposed (``analysis.tangent.reduce``); else
        JAX differentiates every part's chunk loop."""
        lay = plan.shard
        assert lay is not None
        engines = {p.engine for p in (lay.local, lay.remainder) if p is not None}
        if plan.kind is not Kind.MONOID or engines <= {"scan"}:
            return plan
        backward = (
            "the scan engine's chunks, transposed: the rows are spread over devices "
            f"({', '.join(sorted(engines))} giving the states; no backward kernel per device yet)"
        )
        return dataclasses.replace(plan, backward=backward)

    def states(self, plan: Plan, xs: Any, offset: int) -> list:
        """Each term's state over all parts (the devices' shares, the global remainder),
        merged: a sharded plan as a part of another call."""
        reduction = plan.reduction
        assert plan.kind is Kind.MONOID and reduction is not None
        merged: list | None = None
        for p, rows, first in self._parts(plan, xs):
            part = self.engine_of(p.engine).states(p, rows, offset + first)
            merged = reduction.merge_states(merged, part)
        assert merged is not None
        return merged

    def _parts(self, plan: Plan, xs: Any) -> list[tuple[Plan, Any, int]]:
        """(plan, rows, first row) of each part: the devices' shares, split over the
        mesh, and the global remainder, replicated."""
        lay = plan.shard
        assert lay is not None
        n = lay.prefix + lay.global_remainder
        lanes = Lanes(lay.devices, lay.mesh, lay.axes)
        cut = lambda x, a, b: x if (a, b) == (0, n) else x[a:b]
        parts = []
        if lay.local is not None:
            head = jax.tree.map(lambda x: lanes.constrain(cut(x, 0, lay.prefix)), xs)
            parts.append((lay.local, head, 0))
        if lay.remainder is not None:
            tail = jax.tree.map(lambda x: lanes.gather(cut(x, lay.prefix, n)), xs)
            parts.append((lay.remainder, tail, lay.prefix))
        return parts

    def run(self, plan: Plan, call: Call) -> Any:
        lay = plan.shard
        assert lay is not None
        lanes = Lanes(lay.devices, lay.mesh, lay.axes)
        parts = self._parts(plan, call.xs)
        if plan.kind is Kind.MONOID and parts[0][0].policy is not Policy.EMPTY:
            assert plan.reduction is not None
            states_of = lambda p, xs, offset: self.engine_of(p.engine).states(p, xs, offset)
            custom = any(p.engine != "scan" for p, _, _ in parts)
            return tangent.reduce(
                plan.reduction,
                parts,
                states_of,
                _scan.tangent_shares,
                custom=custom,
                differentiable_states_of=_scan.states if custom else None,
            )
        outs = [self.engine_of(p.engine).run(p, call.with_rows(xs)) for p, xs, _ in parts]
        if len(outs) == 1:
            return outs[0]
        if plan.kind is not Kind.MAP:
            assert call.reduction is not None  # Kind.GENERIC: the user's reduction
            return call.reduction(*outs)
        joined = jax.tree.map(
            lambda a, b: jnp.concatenate([lanes.gather(a), lanes.gather(b)]), *outs
        )
        return jax.tree.map(lanes.gather, joined)
