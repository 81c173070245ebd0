"""The pairwise engine of :func:`batch_map`: a chunked monoid reduction that
``_pair_rows`` reads as a pairwise one (``fun`` closes over an array whose rows pair
with the chunk's rows, as N-body's targets do) runs on :func:`~._pairwise.pairwise`'s
CPU tiles, where ``f``'s small feature axes are unrolled into 2-D tiles instead of
the chunk's ``(rows, T, 3)`` arrays.

It runs where ``pairwise`` itself would take those tiles (``pairwise tiles (xla)``),
on CPU, with ``backend="auto"``; the tiles hold at most the pairs of one chunk
(``batch_size`` rows by all ``T`` rows of ``x``) unless a chunk holds more than an
"auto" tile. Gradients are ``pairwise``'s (recomputing ``f`` on tiles).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from . import _config
from ._pair_rows import Pairing, find, pair, results
from ._plan import Call, Kind, Plan, Policy, Rejection
from ._separable import _Refused

__all__ = ["PairEngine"]


def _args(plan: Plan, call: Call, found: Pairing) -> tuple:
    """``pairwise``'s ``f``, ``x``, ``y`` and reduction for ``plan``."""
    assert plan.traced is not None and plan.reduction is not None
    f = pair(plan.traced, plan.reduction, found)
    x = [plan.traced.consts[k] for k in found.consts]
    return f, x, jax.tree.leaves(call.xs), [leaf.monoid for leaf in plan.reduction.leaves]


def _tiles(plan: Plan, found: Pairing) -> tuple[int, int] | str:
    """A chunk's pairs (``batch_size`` rows by every x row) as one tile, when that is
    fewer than an "auto" tile's; else "auto". With ``batch_size="auto"``: "auto" (the
    autotuner sized the scan engine's chunks, whose memory grows with their rows; a
    tile of at most 2^18 pairs holds a few MiB, N-body's gradient 5 MiB)."""
    from ._pairwise import SORT_TILE_ELEMENTS, TILE_ELEMENTS

    assert plan.reduction is not None
    if plan.autotune is not None:
        return "auto"
    sorts = any(leaf.monoid.sorts for leaf in plan.reduction.leaves)
    limit = SORT_TILE_ELEMENTS if sorts else TILE_ELEMENTS
    return (found.n, plan.rows_per_chunk) if plan.rows_per_chunk * found.n < limit else "auto"


class PairEngine:
    """Chunked monoid reductions that are pairwise ones, on ``pairwise``'s CPU tiles."""

    name = "pairwise"

    def accept(self, plan: Plan, call: Call) -> Plan | Rejection:
        from ._pairwise import explain_pairwise

        backend = _config.current().backend
        if backend != "auto":
            return Rejection(f"not requested (backend={backend!r})")
        if plan.kind is not Kind.MONOID or plan.traced is None or plan.policy is Policy.EMPTY:
            return Rejection("only for monoid reductions over rows")
        if plan.shard is not None or plan.lanes is not None:
            return Rejection("not over a mesh")
        if plan.platform != "cpu":
            return Rejection(f"on CPU only (the fused kernel runs chunks on {plan.platform})")
        assert plan.reduction is not None
        found = find(plan.traced, plan.reduction)
        if isinstance(found, str):
            return Rejection(f"not shown to be a pairwise reduction: {found}")
        try:
            pp = explain_pairwise(*_args(plan, call, found), tiles=_tiles(plan, found))
        except _Refused as e:
            return Rejection(f"{found.describe(plan.traced)}, but {e}")
        if pp.engine != "pairwise tiles (xla)":
            why = dict(pp.rejected).get("pairwise tiles (xla)", pp.reason)
            return Rejection(f"{found.describe(plan.traced)}, but its tiles would not pay: {why}")
        bi, bj = pp.tiles
        reason = (
            f"{found.describe(plan.traced)}: pairwise tiles of {bi} x rows by {bj} rows, "
            "f's features unrolled into 2-D tiles"
        )
        note = "pairwise: the tiles replace the chunks above, holding at most a chunk's pairs"
        if _tiles(plan, found) == "auto":
            note = "pairwise: the tiles replace the chunks above (a chunk holds more pairs)"
        return dataclasses.replace(
            plan, engine=self.name, reason=reason, pairing=found, notes=(*plan.notes, note)
        )

    def run(self, plan: Plan, call: Call) -> Any:
        from ._pairwise import pairwise

        found = plan.pairing
        assert isinstance(found, Pairing) and plan.reduction is not None
        out = pairwise(*_args(plan, call, found), tiles=_tiles(plan, found))
        return results(plan.reduction, found, out)
