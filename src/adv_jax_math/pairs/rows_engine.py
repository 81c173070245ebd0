"""The pairwise engine of :func:`batch_map`: a chunked monoid reduction that
``analysis.pair_rows`` reads as a pairwise one (``fun`` closes over an array whose rows pair
with the chunk's rows, as N-body's targets do) runs on :func:`~adv_jax_math.pairs.api.pairwise`'s
CPU tiles, where ``f``'s small feature axes are unrolled into 2-D tiles instead of
the chunk's ``(rows, T, 3)`` arrays.

It runs where ``pairwise`` itself would take those tiles (``pairwise tiles (xla)``),
on CPU, with ``backend="auto"``; the tiles hold at most the pairs of one chunk
(``batch_size`` rows by all ``T`` rows of ``x``) unless a chunk holds more than an
"auto" tile. Gradients are ``pairwise``'s (recomputing ``f`` on tiles).

With ``batch_size="auto"`` the tiles take their own "auto" size, so the autotuner,
which sizes the scan engine's chunks, is not run for a call the tiles take
(:meth:`PairEngine.auto_draft`): it compiled and timed chunk programs that never ran (N-body's
energy gradient in ``bench/bench_autotune.py``: 1.1-1.8 s of planning).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from ..analysis.pair_rows import Pairing, find, pair, results
from ..analysis.separable import _Refused
from ..analysis.validate import mapped_rows
from ..core import config as _config
from ..engines import scan as _scan
from ..engines.shard import PART
from ..plan import autotune as _autotune
from ..plan.base import Call, Kind, Plan, Policy, Rejection, target_platform
from ..plan.measure import budget_in_force
from ..plan.planner import make_plan
from . import tiles as _tile_policy
from .api import explain_pairwise, pairwise

__all__ = ["PairEngine"]

DRAFT_ROWS = 1024  # the chunk size a batch_size="auto" call is drafted at for the tiles
SHARE = (
    f"{PART}: the shard layer merges the parts' monoid states, and the tiles give each x "
    "row's result, not a state"
)


def _args(plan: Plan, call: Call, found: Pairing) -> tuple:
    """``pairwise``'s ``f``, ``x``, ``y`` and reduction for ``plan``."""
    assert plan.traced is not None and plan.reduction is not None
    f = pair(plan.traced, plan.reduction, found)
    x = [plan.traced.consts[k] for k in found.consts]
    return f, x, jax.tree.leaves(call.xs), [leaf.monoid for leaf in plan.reduction.leaves]


def _tiles(plan: Plan, found: Pairing) -> tuple[int, int] | str:
    """``pairwise``'s tiles for ``plan``'s chunks (``pairs.tiles.chunk``)."""
    assert plan.reduction is not None
    return _tile_policy.chunk(found.n, plan.rows_per_chunk, plan.reduction, bool(plan.autotune))


class PairEngine:
    """Chunked monoid reductions that are pairwise ones, on ``pairwise``'s CPU tiles."""

    name = "pairwise"

    def accept(self, plan: Plan, call: Call) -> Plan | Rejection:
        backend = _config.current().backend
        if backend != "auto":
            return Rejection(f"not requested (backend={backend!r})")
        if plan.kind is not Kind.MONOID or plan.traced is None or plan.policy is Policy.EMPTY:
            return Rejection("only for monoid reductions over rows")
        if plan.shard is not None or plan.lanes is not None:
            return Rejection("not over a mesh")
        if call.share:  # the global remainder of a sharded call (its share has lanes)
            return Rejection(SHARE)
        if plan.platform != "cpu":
            return Rejection(f"on CPU only (the fused kernel runs chunks on {plan.platform})")
        assert plan.reduction is not None
        found = find(plan.traced, plan.reduction, plan.tail)
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
        if plan.autotune is not None:
            note = "pairwise: the tiles replace the chunks above, at their own size"
        elif _tiles(plan, found) == "auto":
            note = "pairwise: the tiles replace the chunks above (a chunk holds more pairs)"
        return dataclasses.replace(
            plan, engine=self.name, reason=reason, pairing=found, notes=(*plan.notes, note)
        )

    def run(self, plan: Plan, call: Call) -> Any:
        found = plan.pairing
        assert isinstance(found, Pairing) and plan.reduction is not None
        out = pairwise(*_args(plan, call, found), tiles=_tiles(plan, found))
        return results(plan.reduction, found, out)

    def states(self, plan: Plan, xs: Any, offset: int) -> list:
        """Each term's state over ``plan``'s rows: the scan engine's, over the chunks of
        the plan the tiles replace. The tiles reduce to each x row's result, not to a
        state, so :meth:`accept` declines the parts of a sharded call, whose states the
        shard layer merges; these states are for a caller holding such a plan."""
        return _scan.states(plan, xs, offset)

    def describe_reverse(self, plan: Plan, call: Call) -> Plan:
        """Reverse mode is ``pairwise``'s: pairwise sums on the same tiles."""
        backward = (
            "pairwise's reverse pass: sums over the pairs on the same tiles, recomputing f "
            "and its VJP per tile (nothing N x M stored)"
        )
        return dataclasses.replace(plan, backward=backward)

    def auto_draft(self, call: Call) -> Plan | None:
        """A ``batch_size="auto"`` call planned at ``DRAFT_ROWS`` rows per chunk, its
        ``autotune`` saying that the tiles size themselves, where this engine could take
        it (CPU, ``backend="auto"``, a reduction over unsharded rows); else None. The
        engines then decide: a plan no engine before the tiles takes is planned and
        autotuned as usual (``engines.registry.plan``)."""
        opts = _config.current()
        cpu = opts.backend == "auto" and target_platform() == "cpu"
        if not cpu or call.reduction is None or call.shard or not (n := mapped_rows(call.xs)):
            return None
        start = time.perf_counter()
        rows = min(n, DRAFT_ROWS)
        draft = make_plan(dataclasses.replace(call, batch_size=rows))
        if draft.shard is not None or draft.kind is not Kind.MONOID:
            return None
        budget, source = budget_in_force(opts, "cpu")
        why = (
            "the pairwise tiles size themselves (at most 2^18 pairs a tile, not fitted to the "
            "budget); no chunk program compiled or timed"
        )
        seconds = time.perf_counter() - start
        decision = _autotune.Decision(rows, n, budget, source, 0, 0.0, (), "", why, seconds)
        return dataclasses.replace(draft, autotune=decision)
