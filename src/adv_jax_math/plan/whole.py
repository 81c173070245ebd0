"""A chunked map that runs whole: ``fun`` works row by row with nothing larger than
its inputs and outputs, so chunks would bound nothing and only serialize it
(:func:`whole_map`); :class:`Whole` says whether its reverse mode still needs the
chunks (what it keeps of ``fun``'s intermediates per row), and :func:`runs_whole`
is ``batch_size="auto"``'s decision when neither pass needs them. Used by
``plan.planner``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

from ..analysis import tangent
from ..analysis.jaxpr_graph import row_local, subjaxpr
from ..analysis.pair_rows import evaluate, row_tags
from ..analysis.validate import mapped_rows
from ..core import config as _config
from ..core.call import Call
from ..core.trace import Traced, rows_aval, trace
from ..monoids.base import identity
from .autotune import SMALLEST
from .base import Kind, Plan, Policy, target_platform
from .decision import Decision
from .measure import budget_in_force, fmt_bytes

__all__ = ["Whole", "runs_whole", "whole_map", "whole_note"]


@dataclasses.dataclass(frozen=True)
class Whole:
    """A map's jaxpr on all rows; ``kept``: the bytes per row of ``fun``'s intermediates
    its reverse mode keeps (:func:`_kept_per_row`); ``ends``: the bytes per row of its
    inputs and outputs."""

    traced: Traced
    kept: float
    ends: float

    @property
    def chunked_derivatives(self) -> bool:
        """Whether the derivatives run in chunks: reverse mode run whole would keep more
        per row than the rows' inputs and outputs, which is what a chunked map's reverse
        mode holds besides its chunk (its cotangents: 8 softmax layers, 2^16 rows of 256
        floats, 129 MiB chunked, 2 GiB whole)."""
        return self.kept > self.ends

    def gradient(self, chunked: Plan | None) -> str:
        """The plan's gradient line; ``chunked``: the plan in chunks its derivatives run."""
        kept = f"{fmt_bytes(self.kept)} of fun's intermediates per row"
        ends = f"the rows' inputs and outputs ({fmt_bytes(self.ends)})"
        if not self.kept:
            return (
                "whole too: reverse mode keeps none of fun's intermediates (none is computed "
                "from a reduction; XLA recomputes elementwise ones in the backward pass)"
            )
        if not self.chunked_derivatives:
            return f"whole too: reverse mode keeps {kept}, no more than {ends}"
        assert chunked is not None and chunked.n is not None
        n = chunked.n
        parts = f"{chunked.chunks} chunks of {chunked.rows_per_chunk} rows"
        if chunked.remainder:
            parts += f" and a remainder of {chunked.remainder}"
        return (
            f"in {parts} (jax.jvp per chunk; reverse mode recomputes each, holding one "
            f"chunk's intermediates): run whole, it would keep {kept}, "
            f"{fmt_bytes(self.kept * n)} for the {n} rows, more than {ends}"
        )


def whole_map(
    call: Call, kind: Kind, policy: Policy, raw: Traced, rows: int, mapped: bool
) -> Whole | None:
    """A chunked map (results stacked) of a ``fun`` that works row by row with nothing
    larger than its inputs and outputs (``analysis.jaxpr_graph.row_local``: elementwise
    operations, reshapes, broadcasts, reductions over feature axes) on all rows at once:
    XLA fuses it with no intermediate array larger than those, on every platform. Its
    jaxpr is evaluated again on all rows (``fun`` is not traced again); None where this
    does not apply or cannot be done. A device's share (``mapped``) keeps its chunks,
    and so does a map whose derivatives need chunks where this jax cannot
    differentiate a ``custom_jvp`` whose tangent is a scan."""
    chunked = policy in (Policy.OVERLAP, Policy.REMAINDER)
    if not chunked or kind is not Kind.MAP or call.chunk_reduction is not identity or mapped:
        return None
    if rows < 2 or not row_local(raw.jaxpr, rows):  # (one row: rows look like broadcasts)
        return None
    n = mapped_rows(call.xs)
    closed = raw.jaxpr
    tags = [row_tags(v, "j") for v in closed.jaxpr.invars]
    ends = _row_bytes({*closed.jaxpr.invars, *closed.jaxpr.outvars}, rows)

    def again(xs: Any) -> Any:
        outs, found = evaluate(
            closed.jaxpr, closed.consts, jax.tree.leaves(xs), None, tags, {"j": n}
        )
        if any(t[:1] != ("j",) for t in found):  # e.g. full_like(x, x.shape[0]): not row by row
            raise ValueError("an output is not read from the rows")
        return jax.tree.unflatten(jax.tree.structure(raw.out_shape), outs)

    try:  # (no user code runs here: a failure only means the chunks stay)
        whole = Whole(trace(again, rows_aval(call.xs, n)), _kept_per_row(closed, rows), ends)
    except Exception:
        return None
    return None if whole.chunked_derivatives and not tangent.SUPPORTED else whole


def _kept_per_row(closed: ClosedJaxpr, rows: int) -> float:
    """Bytes per row that reverse mode keeps of ``closed``'s intermediates (traced on
    ``rows`` rows): its residuals with a row axis, other than its inputs and outputs
    (which the call holds anyway), computed from a reduction over features. XLA
    recomputes elementwise ones in the backward pass's fusions (measured on XLA:CPU:
    no temporaries for 8 tanh layers, nor for bench/cases/workloads.py's 360-equation
    fun), but keeps those behind a reduction (a softmax layer: 1.5 times the rows'
    inputs and outputs, eight layers 12 times)."""
    structs = [jax.ShapeDtypeStruct(*_type(v)) for v in closed.jaxpr.invars]

    def residuals(*xs: Any) -> tuple[list, list]:
        out, pull = jax.vjp(jaxpr_as_fun(closed), *xs)
        return out, jax.tree.leaves(pull)

    jaxpr = jax.make_jaxpr(residuals)(*structs).jaxpr
    reduced: set = set()  # values computed from a reduction
    for eqn in jaxpr.eqns:
        if _reduces(eqn) or any(v in reduced for v in eqn.invars if not isinstance(v, Literal)):
            reduced.update(eqn.outvars)
    n_out = len(closed.jaxpr.outvars)
    free = {v for v in (*jaxpr.invars, *jaxpr.outvars[:n_out]) if not isinstance(v, Literal)}
    return _row_bytes({v for v in jaxpr.outvars[n_out:] if v in reduced and v not in free}, rows)


def _type(v: Any) -> tuple[tuple[int, ...], Any]:
    return tuple(v.aval.shape), v.aval.dtype


def _row_bytes(values: set, rows: int) -> float:
    """Bytes per row of the values (jaxpr variables) with a leading axis of ``rows``."""
    types = [_type(v) for v in values if not isinstance(v, Literal)]
    return sum(math.prod(s) * d.itemsize for s, d in types if s[:1] == (rows,)) / rows


def _reduces(eqn: Any) -> bool:
    """Whether an equation (or one inside it) makes an output element from several
    input elements: an output smaller than an input."""
    sub = subjaxpr(eqn)
    if sub is not None:
        return any(_reduces(e) for e in sub.jaxpr.eqns)
    size = lambda v: v.aval.size if hasattr(v.aval, "size") else 1
    return any(size(o) < max(map(size, eqn.invars), default=0) for o in eqn.outvars)


def whole_note(n: int, b: int | None) -> str:
    return (
        f"fun works row by row with nothing larger than its inputs and outputs: its "
        f"jaxpr runs on all {n} rows at once (chunks of {b} rows would only serialize it)"
    )


def runs_whole(call: Call, n: int) -> Decision | None:
    """``batch_size="auto"`` for a map that runs whole, and so does its reverse mode
    (:func:`whole_map`, traced on a few rows): one call on all rows, nothing to choose
    (measuring a chunk program here made the map's outputs count against the budget:
    a BudgetError where the plan needs no temporary memory)."""
    start, rows = time.perf_counter(), SMALLEST
    if call.reduction is not None or call.chunk_reduction is not identity or n <= rows:
        return None
    raw = trace(call.fun, rows_aval(call.xs, rows))
    whole = whole_map(call, Kind.MAP, Policy.OVERLAP, raw, rows, False)
    if whole is None or whole.chunked_derivatives:
        return None
    why = (
        f"one call on all {n} rows: fun works row by row with nothing larger than its inputs "
        "and outputs, and its reverse mode keeps no more than those: chunks would bound "
        "nothing; nothing compiled or timed"
    )
    budget, source = budget_in_force(_config.current(), target_platform())
    seconds = time.perf_counter() - start
    return Decision(n, n, budget, source, 0, 0.0, (), "not measured", why, seconds)
