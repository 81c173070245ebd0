"""The pairwise scan route: ``pairwise`` on the chunked engines (``engines.chunked``),
every ``f``, nothing N x M stored.

* :func:`scan` (``pairwise scan``): x tiles in a chunked ``vmap``, y tiles in a
  chunked monoid reduction, each tile rematerialized in a gradient; also the kernel
  engine's forward-mode tangent and ``shard=True`` (the x rows over the devices);
* :func:`scan_y` (``pairwise scan (y over devices)``, ``shard="y"``): the y rows
  spread over the devices, each chunk the block of its y rows by every x row, the
  devices' monoid states merged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..analysis.validate import resolve_mesh
from ..core import config as _config
from ..engines.chunked import chunked
from ..engines.shard import as_global
from ..monoids.reduction import MonoidReduction
from ..monoids.softmax import SoftmaxWeighted
from ..plan.base import target_platform

__all__ = ["scan", "scan_y"]


def scan(
    f: Callable,
    x: Any,
    y: Any,
    reduction: Any,
    tiles: tuple[int, int],
    shard: bool = False,
    mesh: Any = None,
) -> Any:
    """``pairwise scan``: the ``bi`` x rows of a tile in a chunked ``vmap`` (spread
    over ``mesh``'s devices with ``shard``), each reducing its ``bj`` y rows at a time
    in a chunked monoid reduction."""
    bi, bj = tiles

    def per_x(xi: Any) -> Any:
        pairs = lambda yc: jax.vmap(f, (None, 0))(xi, yc)
        return chunked(pairs, y, bj, reduction=reduction)

    if shard:  # y replicated on the mesh, as the rows of x are spread over it
        y = jax.tree.map(lambda a: as_global(a, resolve_mesh(mesh)), y)
    run = lambda: chunked(jax.vmap(per_x), x, bi, shard=shard, mesh=mesh)
    if target_platform() == "cpu" or _config.current().backend not in ("auto", "pallas"):
        return run()
    # not the 1-D kernel over y: it would run vmapped over the x rows, its blocks
    # batched beyond what its compile probe checked (Mosaic refused them on TPU)
    with _config.config(backend="scan"):
        return run()


def scan_y(
    f: Callable, x: Any, y: Any, red: MonoidReduction, reduction: Any, bj: int, mesh: Any
) -> Any:
    """``shard="y"``: :func:`batch_map` over the y rows spread over the devices (each
    device's monoid states merged across them), each chunk the block of its ``bj`` y
    rows by every x row, x rows on the minor axis. A result with the monoid's own
    axes first (top-k's ``(k, N)``) is turned to have the x rows first."""
    if any(isinstance(leaf.monoid, SoftmaxWeighted) for leaf in red.leaves):
        # its values are weighed by their own x row's scores only: each x row its own
        # reduction (vmapped; the x rows then on the major axis)
        per_x = lambda xi: jax.vmap(lambda yj: f(xi, yj))
        run = lambda xi: chunked(per_x(xi), y, bj, reduction=reduction, shard=True, mesh=mesh)
        return jax.vmap(run)(x)
    block = lambda yc: jax.vmap(lambda yj: jax.vmap(lambda xi: f(xi, yj))(x))(yc)
    out = chunked(block, y, bj, reduction=reduction, shard=True, mesh=mesh)
    n = jax.tree.leaves(x)[0].shape[0]
    per_row = [jax.tree.leaves(leaf.out) for leaf in red.leaves]
    flat = [
        o if o.shape == (n, *w.shape) else jnp.moveaxis(o, 1, 0)
        for o, w in zip(jax.tree.leaves(out), [w for ws in per_row for w in ws], strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(out), flat)
