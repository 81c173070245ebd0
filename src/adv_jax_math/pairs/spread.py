"""``shard=True`` on the tile engines: the x rows spread over a mesh's devices.

Every x row's result reads that row and every y row, so each device runs the engine
(the matmul tiles, the tile loops, a Pallas kernel) on its share of the x rows with
``y`` whole, under ``jax.shard_map``: the kernels run unbatched on local rows, as
planned and compiled for them. The rows are padded to a multiple of the devices with
copies of the last one, dropped after; in reverse mode ``shard_map``'s transpose sums
the devices' ``y`` (and constants') cotangents.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ..analysis.validate import resolve_mesh
from ..engines.shard import as_global
from ..kernels.pairwise import _pad_rows

__all__ = ["local_rows", "spread"]


def local_rows(n: int, mesh: Any) -> int:
    """A device's share of ``n`` x rows over ``mesh`` (None: ``shard=True``'s)."""
    return -(-n // resolve_mesh(mesh).size)


def spread(run: Callable, c: list, x: Any, y: Any, mesh: Any) -> Any:
    """``run(c, x, y)`` (per x row results) with the x rows split over ``mesh``'s
    devices (None: ``shard=True``'s mesh), ``c`` and ``y`` on every device."""
    mesh = resolve_mesh(mesh)
    n = jax.tree.leaves(x)[0].shape[0]
    rows, axes = -(-n // mesh.size) * mesh.size, tuple(mesh.axis_names)
    split, every = PartitionSpec(axes), PartitionSpec()

    def put(a: Any, spec: PartitionSpec) -> Any:
        a = as_global(a, mesh)
        if AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())):
            a = jax.sharding.reshard(a, NamedSharding(mesh, spec))
        return a

    xs = jax.tree.map(lambda a: put(_pad_rows(a, rows), split), x)
    c, y = jax.tree.map(lambda a: put(a, every), (c, y))
    out = jax.shard_map(
        run, mesh=mesh, in_specs=(every, split, every), out_specs=split, check_vma=False
    )(c, xs, y)
    return jax.tree.map(lambda o: o[:n], out)
