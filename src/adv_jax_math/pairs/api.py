"""Pairwise reductions: ``out_i = reduce_j f(x_i, y_j)``, nothing N x M ever stored.

``pairwise(f, x, y, reduction)`` takes ``f`` written for one pair (KeOps' lazy
reductions, in JAX). The reduction over ``j`` has :func:`batch_map`'s semantics
for a Monoid object reducing the mapped axis (global ``j`` indices, ties and NaN
as plain JAX); it is computed in tiles of ``bi`` x rows by ``bj`` y rows (sized by
``pairs.tiles``), each x row's monoid state carried across the y tiles. The engines:

* ``pairwise tiles (xla)``, the default on CPU: the GPU tile kernel's loops in plain
  XLA (``kernels/pairwise_device.py``, layout ``"xla"``), where unrolling ``f``'s
  features pays (``pairs.kernel.layout_problem``); its reverse pass the kernel
  engine's below;
* ``pairwise scan`` (``pairs.scan``): x tiles in a chunked ``vmap``, y tiles in a
  chunked monoid reduction (:func:`batch_vmap` of :func:`batch_map`), each tile
  rematerialized in a gradient: O(bi * bj) memory forward and backward; every ``f``,
  and ``shard=True``;
* ``pairwise scan (y over devices)`` for ``shard="y"``: :func:`batch_map` over the y
  rows spread over the devices, each chunk the block of its y rows by every x row,
  the devices' monoid states merged;
* ``pairwise kernel (gpu)`` / ``(tpu)``: the tile kernel (``kernels/pairwise_device.py``,
  ``f``'s features unrolled so every value is 2-D), the default on GPU/TPU where it
  tiles ``f`` and compiles at its tiles; ``backend="interpret"`` runs it in interpret
  mode (``pairwise kernel (interpret)``; where it cannot tile ``f``, the interpret
  kernel of ``kernels/pairwise.py``). Reverse mode is pairwise sums on the same kernel
  (``pairs.grad``); forward mode takes the scan engine's tangent.

``columns=`` (a Monoid or pytree of them) adds the other marginal of the same
matrix, ``cols_j = reduce_i f(x_i, y_j)`` (Sinkhorn's two marginals): two passes over
the tiles, the second this same call with ``x`` and ``y`` swapped (``f`` evaluated
twice), planned as any other.

:func:`explain_pairwise` shows the plan: sizes, tiles, engine and why the others
were not taken, its gradient (and the column pass's plan, for ``columns=``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ..core import config as _config
from ..core.sharding import context_mesh, explicit, sharding_of, typed_mesh, whole
from ..kernels.pairwise_device import Layout
from ..monoids.base import Monoid, is_monoid_tree
from ..monoids.reduction import MonoidReduction
from ..plan.base import target_platform
from . import tiles as _tiles
from .backward_plan import described
from .choose import device_kernel, interpreted
from .grad import Pairs, fused
from .kernel import broadcast_pairs, first_row, layout_problem, recognized, rows_of
from .matmul import blocks, expanded, pair_width, top_k_folds
from .scan import scan, scan_y
from .spread import local_rows, spread

__all__ = ["PairwisePlan", "explain_pairwise", "pairwise"]

INTERPRET_LAYOUT = "gpu"  # the tile kernel backend="interpret" runs (tests set "tpu" too)


@dataclasses.dataclass(frozen=True)
class PairwisePlan:
    """What :func:`pairwise` runs: ``n`` x rows, ``m`` y rows, tiles of
    ``tiles = (bi, bj)`` rows, the engine and why, the engines not taken; with
    ``columns=``, the column pass's plan as ``columns`` (``y`` rows as its ``x``)."""

    n: int
    m: int
    tiles: tuple[int, int]
    reduction: str
    engine: str
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()
    columns: PairwisePlan | None = None  # the column pass (``columns=``): y rows, x rows
    backward: str = ""  # explain_pairwise's: how the derivatives run (pairs.backward_plan)
    memory: str = ""  # explain_pairwise's: what reverse mode holds (estimated)

    def __str__(self) -> str:
        bi, bj = self.tiles
        xt, yt = -(-self.n // bi) if bi else 0, -(-self.m // bj) if bj else 0
        rows = [
            ("rows (x, y)", f"{self.n} x {self.m}"),
            ("tiles", f"{bi} x {bj} rows: {xt} x tile(s), {yt} y tile(s) each"),
            ("reduction", f"{self.reduction} over the y rows, for each x row"),
            ("engine", f"{self.engine}: {self.reason}"),
            *((("gradient", self.backward),) if self.backward else ()),
            *((("grad memory", self.memory),) if self.memory else ()),
            *(("rejected", f"{name}: {why}") for name, why in self.rejected),
        ]
        if self.columns is not None:
            pass_ = "a second pass, over the x rows for each y row (below: x and y swapped)"
            rows.append(("columns", pass_))
        lines = [f"{label:<11}: {text}" for label, text in rows]
        if self.columns is not None:
            lines += [f"    {line}" for line in str(self.columns).splitlines()]
        return "\n".join(lines)


def pairwise(
    f: Callable,
    x: Any,
    y: Any,
    reduction: Monoid | Any,
    *,
    tiles: tuple[int, int] | str = "auto",
    shard: bool | str = False,
    mesh: jax.sharding.Mesh | None = None,
    columns: Monoid | Any | None = None,
) -> Any:
    """``reduction`` over ``j`` of ``f(x_i, y_j)``, for every ``i``, in tiles (and with
    ``columns=``, a reduction over ``i`` for every ``j`` too).

    Parameters
    ----------
    f : callable
        ``f(xi, yj)`` for one pair: ``xi`` one row of ``x`` (a pytree), ``yj`` one row
        of ``y``; returns a pytree. Values it closes over may be differentiated.
    x, y : pytree of arrays
        Rows along the leading axis of every leaf: ``N`` rows of ``x``, ``M`` of ``y``.
    reduction : Monoid or pytree of Monoid
        ``ADD``, ``MAX``, ``LOGSUMEXP``, ``ARGMIN``, ``top_k(k)``,
        ``SOFTMAX_WEIGHTED`` (``f`` returns ``(score, value)``), ``MEAN``, ``VAR``...,
        or one per subtree of ``f``'s output, as ``batch_map(..., reduction=)``.
    tiles : (int, int) or "auto"
        ``(bi, bj)``: rows of ``x`` and of ``y`` per tile. ``"auto"`` takes
        ``bj = min(M, 2048)`` and ``bi`` the power of two (or ``N``) that makes a tile
        of at most 2^18 pairs (a top-k on the CPU tiles: ``y`` split evenly into tiles
        of at most 8192 rows, at most 2^20 pairs); on GPU ``(64, 64)`` and on TPU
        ``(512, 256)`` for the tile kernel (GPU tiles are powers of two; on TPU
        multiples of 128).
    shard : bool or "x" or "y"
        ``True`` (or ``"x"``): spread the rows of ``x`` over the devices of ``mesh``
        (each device reduces its own x rows over all of ``y``), as
        ``batch_vmap(..., shard=True)``. ``"y"``: spread the rows of ``y`` (for a
        ``y`` too large for one device): each device reduces every x row over its own
        y rows, in chunks of ``bj`` y rows by all ``N`` x rows, and the devices'
        monoid states are merged.
    mesh : jax.sharding.Mesh or None
        The mesh for ``shard`` (default: the one of ``jax.set_mesh``, else all
        devices).
    columns : Monoid or pytree of Monoid or None
        Also reduce over ``i`` for every ``j`` (both marginals of the pairwise matrix,
        as a Sinkhorn solver needs): two passes over the tiles, ``f`` evaluated in each;
        the second is ``pairwise(lambda yj, xi: f(xi, yj), y, x, columns)`` with the
        same ``shard`` and ``mesh``, its tiles ``(bj, bi)`` (``"auto"`` stays
        ``"auto"``). The default ``None``: rows only.

    Returns
    -------
    pytree, or (pytree, pytree) with ``columns=``
        The reduction's result for each ``x`` row, stacked along a new leading axis
        of size ``N``: as ``jax.vmap`` over ``x`` of ``batch_map`` over ``y``. With
        ``columns=``, ``(rows, cols)``: ``rows`` that, ``cols`` the ``columns``
        reduction's result for each ``y`` row, over the ``x`` rows (leading axis ``M``).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> x, y = jnp.arange(3.0)[:, None], jnp.arange(5.0)[:, None]
    >>> gauss = lambda xi, yj: jnp.exp(-jnp.sum((xi - yj) ** 2))
    >>> [round(v, 3) for v in ajm.pairwise(gauss, x, y, ajm.ADD, tiles=(2, 2)).tolist()]
    [1.386, 1.754, 1.772]
    >>> ajm.pairwise(lambda xi, yj: jnp.sum((xi - yj) ** 2), x, y, ajm.ARGMIN)
    Array([0, 1, 2], dtype=int32)

    Both marginals of the kernel matrix: its row sums and its column sums.

    >>> rows, cols = ajm.pairwise(gauss, x, y, ajm.ADD, columns=ajm.ADD)
    >>> [round(v, 3) for v in rows.tolist()], [round(v, 3) for v in cols.tolist()]
    ([1.386, 1.754, 1.772], [1.386, 1.736, 1.386, 0.386, 0.018])
    """
    if columns is not None:
        _check_monoids(columns, "columns")
    rows = _pairwise(f, x, y, reduction, tiles, shard, mesh)
    if columns is None:
        return rows
    swapped = lambda yj, xi: f(xi, yj)  # the column pass: x and y swapped
    return rows, _pairwise(swapped, y, x, columns, _tiles.swapped(tiles), shard, mesh)


def _pairwise(
    f: Callable, x: Any, y: Any, reduction: Any, tiles: Any, shard: bool | str, mesh: Any
) -> Any:
    """One pass: ``reduction`` over ``j`` of ``f(x_i, y_j)``, for every ``i``."""
    f = broadcast_pairs(f, reduction)
    plan, red, layout = _plan(f, x, y, reduction, tiles, shard, mesh)
    if plan.engine == _SCAN_Y:  # every device reduces its y rows for every x row,
        # on the mesh x and y are typed on where none is given or set
        with typed_mesh(*([] if mesh else [x, y])):
            out = scan_y(f, jax.tree.map(whole, x), y, red, reduction, plan.tiles[1], mesh)
        return jax.tree.map(lambda o: _rows_like(o, x), out)
    if plan.engine == _SCAN:
        # (the mesh only where x is spread over it: ``chunked`` warns of one ignored)
        y = jax.tree.map(whole, y)
        return scan(f, x, y, reduction, plan.tiles, bool(shard), mesh if shard else None)
    # the kernel engine (``pairs.kernel``; its derivatives, and forward mode's tangent
    # on the scan engine: ``pairs.grad``); with shard=True on each device's x rows
    conv, consts = jax.closure_convert(f, first_row(x), first_row(y))
    by_scan = lambda c, x, y: scan(lambda xi, yj: conv(xi, yj, *c), x, y, reduction, plan.tiles)
    run = lambda c, x, y: fused(Pairs(conv, red, plan.tiles, by_scan, layout), c, x, y)
    if shard:
        out = spread(run, list(consts), x, y, mesh)
    else:
        out = run(list(consts), x, jax.tree.map(whole, y))
    return jax.tree.map(lambda o: _rows_like(o, x), out)


def explain_pairwise(
    f: Callable,
    x: Any,
    y: Any,
    reduction: Monoid | Any,
    *,
    tiles: tuple[int, int] | str = "auto",
    shard: bool | str = False,
    columns: Monoid | Any | None = None,
) -> PairwisePlan:
    """The plan :func:`pairwise` would run for these arguments (``x`` and ``y`` may
    hold ``jax.ShapeDtypeStruct``); with ``columns=``, the row pass's plan, the column
    pass's as its ``columns``."""
    if columns is not None:
        _check_monoids(columns, "columns")
    plan = _explained(f, x, y, reduction, tiles, shard)
    if columns is None:
        return plan
    swapped = lambda yj, xi: f(xi, yj)
    columns_plan = _explained(swapped, y, x, columns, _tiles.swapped(tiles), shard)
    return dataclasses.replace(plan, columns=columns_plan)


def _explained(f: Callable, x: Any, y: Any, reduction: Any, tiles: Any, shard: Any) -> PairwisePlan:
    f = broadcast_pairs(f, reduction)  # (as _pairwise runs it)
    return described(*_plan(f, x, y, reduction, tiles, shard), f, x, y, shard)


_SCAN, _KERNEL, _TILES = "pairwise scan", "pairwise kernel (interpret)", "pairwise tiles (xla)"
_SCAN_Y = "pairwise scan (y over devices)"
_MATMUL = "pairwise tiles (matmul)"


def _check_monoids(tree: Any, name: str) -> None:
    if not is_monoid_tree(tree):
        raise TypeError(
            f"pairwise: {name}={tree!r} is not a Monoid (or a pytree of them); pass "
            "ajm.ADD, ajm.LOGSUMEXP, ajm.ARGMIN, ajm.top_k(k), ..."
        )


def _rows_like(out: jax.Array, x: Any) -> jax.Array:
    """``out`` with its rows split as those of ``x`` are, where that is in the types."""
    sharding = sharding_of(jax.tree.leaves(x)[0])
    if not explicit(sharding) or not sharding.spec or sharding.spec[0] is None:
        return out
    return jax.sharding.reshard(out, NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0])))


def _plan(
    f: Callable,
    x: Any,
    y: Any,
    reduction: Any,
    tiles: Any,
    shard: bool | str,
    mesh: Any = None,
) -> tuple[PairwisePlan, MonoidReduction, Layout | None]:
    """The plan, the terms over ``j`` it recognized in ``reduction``, and the kernel's
    tile layout (None: the interpret kernel, or no kernel). With ``shard=True`` and
    no mesh set with ``jax.set_mesh``, the plan of a device's share of the x rows over
    all of ``y`` (``pairs.spread``); under ``jax.set_mesh``, the scan's own sharding."""
    if shard not in (False, True, "x", "y"):
        raise TypeError(f"pairwise: shard={shard!r}; pass False, True (or 'x'), or 'y'")
    _check_monoids(reduction, "reduction")
    n, m = rows_of(x, "x"), rows_of(y, "y")
    if shard in (True, "x") and n and m and context_mesh() is None:
        local = local_rows(n, mesh)
        share = lambda a: jax.ShapeDtypeStruct((local, *jnp.shape(a)[1:]), jnp.result_type(a))
        plan, red, layout = _plan(f, jax.tree.map(share, x), y, reduction, tiles, False)
        why = f"{plan.reason}; the x rows spread over the devices (shard=True), {local} on each"
        return dataclasses.replace(plan, n=n, reason=why), red, layout
    bi, bj = _tiles.rows(tiles, n, m)
    red = recognized(f, x, y, reduction, max(bj, 1))
    red.check_rows(m)
    what = ", ".join(dict.fromkeys(leaf.monoid.name for leaf in red.leaves))
    if shard == "y" and n and m:
        return _plan_y(n, m, tiles, what), red, None
    backend, platform = _config.current().backend, target_platform()
    tiles_why = None
    if not (n and m):
        kernel_why = "no rows to tile (N or M is 0)"
    elif shard:
        kernel_why = "shard=True under jax.set_mesh: the kernels do not spread over its devices"
    elif backend == "interpret":
        found, declined, kind = interpreted(f, x, y, red, tiles, (bi, bj), INTERPRET_LAYOUT)
        kernel = f"the {kind} tile kernel, interpreted"
        if found is None:
            kernel = f"the interpret kernel ({declined})"
        elif found.kind == "matmul":
            kernel = f"the {kind} matmul tile kernel, interpreted ({declined})"
        at = found.tiles if found is not None else (bi, bj)
        plan = PairwisePlan(n, m, at, what, _KERNEL, f"requested (backend='interpret'): {kernel}")
        return plan, red, found
    elif backend in ("auto", "pallas") and platform in ("gpu", "cuda", "rocm", "tpu"):
        found, kernel_why = device_kernel(f, x, y, red, tiles, platform)
        if found is not None:
            bi, bj = found.tiles
            on = found.on if found.kind == "matmul" else found.kind
            why = f"a program per {bi} x rows, looping over tiles of {bj} y rows"
            if on == "tpu":
                why = f"a grid of {bi} x rows (parallel) by {bj} y rows (arbitrary)"
            engine = f"pairwise kernel ({on})"
            # (on a GPU, the Pallas backends declined before this one)
            lost: tuple = (("pairwise kernel", kernel_why),) if kernel_why else ()
            if found.kind == "matmul":
                engine = f"pairwise kernel (matmul, {on})"
                why += ": f's dot products over a tile one matmul"
                if distances := expanded(f, x, y, red):
                    why += f"; {distances}"
                if (width := pair_width(f, x, y, red)) > 1:
                    why += f"; f makes {width} values per pair: a tile holds {bi * bj * width}"
                why += "; the reverse pass: " + (
                    "one kernel (over the tiles of the side with the more cotangents, the "
                    "other side's whole in VMEM)"
                    if on == "tpu"
                    else "two kernels (dx over the x tiles, dy over the y tiles)"
                )
                why += (
                    " at the largest of these tiles down to a quarter that compiles"
                    + (", first with no register spilled" if on == "gpu" else "")
                    + ", else XLA's loops"
                )
            return PairwisePlan(n, m, found.tiles, what, engine, why, lost), red, found
    else:
        kernel_why = f"not requested (backend={backend!r})"
    loops = bool(n and m) and backend == "auto" and not shard  # (the engines in XLA's loops)
    if loops and platform not in ("gpu", "cuda", "rocm", "tpu"):
        kernel_why = f"only on request on {platform} (backend='interpret')"
        bi, bj = _tiles.xla(tiles, n, m, red)
        tiled = Layout("xla", (bi, bj))
        problem = layout_problem(f, x, y, red, tiled)
        if problem is None:
            why = (
                f"a loop over tiles of {bi} x rows, each over tiles of {bj} y rows, f's "
                f"features unrolled: every value a {bj} x {bi} tile (default on {platform})"
            )
            if folds := top_k_folds(red):
                why += f"; {folds}"
            scan_why = "f on tiles of pairs with its features as the minor axis: slower"
            lost = (("pairwise kernel", kernel_why), (_SCAN, scan_why))
            return PairwisePlan(n, m, (bi, bj), what, _TILES, why, lost), red, tiled
        tiles_why = problem
    rejected: tuple[tuple[str, str], ...] = (("pairwise kernel", kernel_why),)
    if tiles_why is not None:
        rejected += ((_TILES, tiles_why),)
    if loops:
        per_y = blocks(f, x, y, red)
        if not isinstance(per_y, str):
            bi, bj = _tiles.xla(tiles, n, m, red)
            why = (
                f"a loop over tiles of {bi} x rows, each over tiles of {bj} y rows, each tile "
                f"one chunk of the reduction with the x rows as its items: f's dot products "
                f"over a tile one matmul"
            )
            if distances := expanded(f, x, y, red):
                why += f"; {distances}"
            if folds := top_k_folds(red):
                why += f"; {folds}"
            scan_why = "f mapped over one x row at a time: matrix-vector products"
            plan = PairwisePlan(n, m, (bi, bj), what, _MATMUL, why, (*rejected, (_SCAN, scan_why)))
            return plan, red, Layout("matmul", (bi, bj), per_y=per_y)
        rejected += ((_MATMUL, per_y),)
    why = "x tiles in a chunked vmap, y tiles in a chunked monoid reduction"
    if shard:
        why += "; the x rows spread over the devices (shard=True)"
    elif backend == "auto":
        why += f" (default on {platform})"
    return PairwisePlan(n, m, (bi, bj), what, _SCAN, why, rejected), red, None


def _plan_y(n: int, m: int, tiles: Any, what: str) -> PairwisePlan:
    """The plan for ``shard="y"``: chunks of ``bj`` y rows by every x row on each
    device (``tiles``' ``bj``; "auto": at most 2^18 pairs and a device's share)."""
    bj = _tiles.shard_y(tiles, n, m, jax.device_count())
    why = (
        f"the y rows spread over the devices (shard='y'): each reduces every x row over its "
        f"own y rows, in chunks of {bj} y rows by all {n} x rows; the devices' states merged"
    )
    lost = (("pairwise kernel", "shard='y': the kernel does not spread over devices yet"),)
    return PairwisePlan(n, m, (n, bj), what, _SCAN_Y, why, lost)
