"""The pairwise kernel engine's front: ``f`` traced on a tile, the kernel run on it.

:func:`kernel_states` traces ``f`` (closure-converted: ``conv(xi, yj, *consts)``)
on one ``bi`` x ``bj`` tile, followed by the reduction's prologue, and runs
``kernels/pairwise.py`` on it: each term's monoid state for every x row.
:func:`kernel_sums` is the same for a pairwise sum of any ``g(xi, yj)``, finalized,
with chosen outputs summed over the x rows too: the reverse pass is made of these
(``_pairwise_grad``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ._monoid import MonoidReduction, identity, merge_stacked
from ._monoids_sums import ADD
from ._recognize import recognize
from ._sharding import explicit, sharding_of, typed_mesh
from ._trace import rows_aval
from .kernels.pairwise import states

__all__ = ["Prepared", "first_row", "kernel_states", "kernel_sums", "like", "recognized"]


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
    """``f`` on a tile, traced: ``jaxpr(*consts, *x_leaves, *y_leaves)`` gives each
    term's source arrays ``(bi, bj, ...)``; ``reduction`` the terms over ``j``;
    ``m`` the rows of ``y``."""

    jaxpr: Any  # ClosedJaxpr of the tile function
    reduction: MonoidReduction
    m: int


def first_row(tree: Any) -> Any:
    """One row's avals (closure conversion's example; slicing a row of rows split over
    devices is not allowed)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), tree)


def _struct(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))


def recognized(f: Callable, x: Any, y: Any, reduction: Any, bj: int) -> MonoidReduction:
    """The terms over ``j`` of one x row's outputs on ``bj`` y rows."""
    x_row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], a.dtype), x)
    row_out = jax.eval_shape(lambda xi, yc: jax.vmap(f, (None, 0))(xi, yc), x_row, rows_aval(y, bj))
    rec = recognize(reduction, identity, row_out)
    if rec.leaves is None:
        raise ValueError(f"pairwise: reduction={reduction!r} is not recognized: {rec.how}")
    return MonoidReduction(rec.leaves, rec.out_tree, rec.prologue, rec.how)


def kernel_states(
    conv: Callable,
    consts: Sequence[Any],
    red: MonoidReduction,
    x: Any,
    y: Any,
    tiles: tuple[int, int],
    summed: Sequence[int] = (),
) -> tuple[list, list]:
    """Each term of ``red`` (over the outputs of ``conv(xi, yj, *consts)``): its state
    for every x row, or for the terms in ``summed`` (sums) one per x tile; and its
    items (``LeafReduction.items``: one row's avals as the monoid reads them)."""
    bi, bj = tiles

    def tile(c: list, xt: Any, yt: Any) -> list:
        pair = lambda xi, yj: conv(xi, yj, *c)
        return jax.vmap(lambda xi: red.prologue(jax.vmap(pair, (None, 0))(xi, yt)))(xt)

    jaxpr, out = jax.make_jaxpr(tile, return_shape=True)(
        [_struct(c) for c in consts], rows_aval(x, bi), rows_aval(y, bj)
    )
    rows = [jax.ShapeDtypeStruct(s.shape[1:], s.dtype) for s in out]  # one x row's
    items = [leaf.items(red.reads(rows, leaf)) for leaf in red.leaves]
    prepared = Prepared(jaxpr, red, jax.tree.leaves(y)[0].shape[0])
    run = lambda ref: lambda c, xs, ys: states(prepared, tiles, c, xs, ys, summed, ref)
    # A Pallas call has no derivative of its own: differentiated (a derivative of the
    # reverse pass, from the second order on), the states are the same computation's
    # in plain JAX.
    kernel = jax.custom_jvp(run(False))
    kernel.defjvp(lambda primals, tangents: jax.jvp(run(True), primals, tangents))
    # the tile jaxpr's own constants are arguments too (shard_map takes no closed-over
    # values typed on Explicit axes)
    args = ([*jaxpr.consts, *consts], jax.tree.leaves(x), jax.tree.leaves(y))
    with typed_mesh(args):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
            return kernel(*args), items
        # A kernel runs with manual mesh axes only: under an Explicit context mesh, on
        # every device, its arguments replicated (as the 1-D kernel does).
        whole = NamedSharding(mesh, PartitionSpec())
        args = jax.tree.map(lambda a: jax.sharding.reshard(jnp.asarray(a), whole), args)
        everywhere = jax.shard_map(
            kernel, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=False
        )
        return everywhere(*args), items


def like(ct: Any, primal: Any) -> Any:
    """A cotangent with its primal's sharding, where that is in its type."""
    sharding = sharding_of(primal)
    return jax.sharding.reshard(ct, sharding) if explicit(sharding) else ct


def kernel_sums(
    g: Callable, x: Any, y: Any, tiles: tuple[int, int], summed: Sequence[int] = ()
) -> list:
    """``sum_j g(x_i, y_j)`` for every x row, one array per output leaf of ``g`` (as
    ``jnp.sum``: compensated); the leaves numbered in ``summed`` summed over ``i`` too."""
    conv, consts = jax.closure_convert(g, first_row(x), first_row(y))
    red = recognized(lambda xi, yj: conv(xi, yj, *consts), x, y, ADD, tiles[1])
    per_term, items = kernel_states(conv, consts, red, x, y, tiles, summed)
    out = []
    for t, (leaf, state, it) in enumerate(zip(red.leaves, per_term, items, strict=True)):
        if t in summed:
            out.append(leaf.result(merge_stacked(leaf.monoid.merge, state), it))
        else:
            out.append(jax.vmap(lambda s, leaf=leaf, it=it: leaf.result(s, it))(state))
    return out
