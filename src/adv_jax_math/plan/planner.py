"""The planner: :func:`make_plan` turns a validated call into a
:class:`~adv_jax_math.plan.base.Plan` (everything but the engine, which the registry
in ``engines.registry`` picks).

It counts the rows, splits them into chunks (:func:`split_rows`: overlapping chunks
or a remainder apart), traces ``fun`` once per chunk shape, recognizes the reduction
(``analysis.recognize``) or checks a generic one (``analysis.combine_check``), and,
when the rows are spread over devices, plans one device's share and a global
remainder, each device's share traced for all devices at once. A chunked map that
works row by row runs whole (``plan.whole``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from ..analysis.combine_check import check_combine
from ..analysis.recognize import recognize
from ..analysis.validate import check_monoid_rows, check_rowwise, mapped_rows
from ..core import config as _config
from ..core.call import Call
from ..core.sharding import Lanes, explicit, row_sharding, sharding_of, typed_mesh
from ..core.trace import Traced, rows_aval, trace
from ..monoids.base import identity, is_monoid_tree
from ..monoids.reduction import MonoidReduction
from . import autotune as _autotune
from .base import Kind, Plan, Policy, ShardLayout, target_platform
from .whole import runs_whole, whole_map, whole_note

__all__ = ["make_plan", "split_rows"]


def split_rows(n: int, batch_size: int, mode: str) -> tuple[int, str]:
    """Rows per chunk for ``n > batch_size`` rows, and whether the last rows
    ``"overlap"`` the chunk before or run ``"separate"`` (see ``config(remainder=)``).

    Overlapping chunks have ``batch_size`` rows, as the user asked, while the last
    chunk repeats at most ``n / 16`` rows (XLA:CPU measured a (1024, 256, 3) N-body
    chunk 10-40% faster than balanced 1001- or 1008-row chunks); otherwise they are
    balanced: ``k = ceil(n / batch_size)`` chunks of ``ceil(n / k)`` rows repeat
    fewer than ``k`` rows.
    """
    k = -(-n // batch_size)
    rows = -(-n // k)
    repeats = k * rows - n
    if mode == "separate" or (mode == "auto" and repeats * 8 > n):
        return batch_size, "separate"
    if k * batch_size - n <= n // 16:
        return batch_size, "overlap"
    return rows, "overlap"


def _rows_if_reduced(call: Call) -> int | None:
    """Unchunked reductions are planned like chunked ones (one chunk of all rows),
    so a recognized reduction runs the same way (e.g. leafwise on a pytree, or a
    Monoid passed as reduction reducing the mapped axis); None if not mappable."""
    if call.reduction is None:
        return None
    if is_monoid_tree(call.reduction) and call.chunk_reduction is identity:
        return mapped_rows(call.xs)
    try:
        return mapped_rows(jax.tree.map(jnp.asarray, call.xs))
    except (ValueError, TypeError):
        return None


def _kind(call: Call, reduction: MonoidReduction | None) -> Kind:
    if reduction is not None:
        return Kind.MONOID
    return Kind.MAP if call.reduction is None else Kind.GENERIC


def _recognized(call: Call, traced: Traced) -> tuple[MonoidReduction | None, str]:
    rec = recognize(call.reduction, call.chunk_reduction, traced.out_shape)
    if rec.leaves is None:
        return None, rec.how
    return MonoidReduction(rec.leaves, rec.out_tree, rec.prologue, rec.how), rec.how


def make_plan(call: Call, *, mapped: bool = False) -> Plan:
    """Plan a call (everything but the engine; see ``engines.registry.plan``).

    Rows are counted when something is split (``batch_size`` or ``shard``) or when
    ``mapped`` says the input's leading axis is mapped (a device's share of rows).
    ``fun`` is traced here, once per chunk shape (the chunks and a remainder);
    engines evaluate those traces and never call ``fun`` again.
    """
    b = call.batch_size
    decision = None
    if b == "auto":
        n: int | None = mapped_rows(call.xs)
        spread = _spread(call, n, mapped)
        if spread is not None and n:
            return _sharded_plan(call, n, *spread)  # each device's plan chooses for its rows
        if n:
            decision = runs_whole(call, n) or _autotune.choose(call, n, target_platform())
        b = decision.batch_size if decision else None
        call = dataclasses.replace(call, batch_size=b)
    assert not isinstance(b, str)  # "auto", the only str batch_size, was resolved above
    # A Monoid passed as reduction (default chunk_reduction) reduces the mapped axis.
    n = mapped_rows(call.xs) if b is not None or call.shard or mapped else _rows_if_reduced(call)
    spread = _spread(call, n, mapped)
    if spread is not None and n:
        return _sharded_plan(call, n, *spread)
    if n is None:  # nothing is split: one plain call, as the user wrote it
        return Plan(n, b, _kind(call, None), None, Policy.SINGLE, 1, 0, platform=target_platform())
    notes: list[str] = []
    if b is None or n <= b:
        policy, chunks, rows = (Policy.EMPTY, 0, 1) if n == 0 else (Policy.SINGLE, 1, n)
    else:
        mode = _config.current().remainder
        rows, split = split_rows(n, b, mode)
        policy, chunks = Policy.OVERLAP, -(-n // rows)
        if split == "separate":
            policy, chunks = Policy.REMAINDER, n // rows
        if n % b and (call.reduction is not None or call.chunk_reduction is identity):
            notes.append(_split_note(n, b, rows, split, mode))

    avals = rows_aval(call.xs, rows)
    raw = trace(call.fun, avals)
    if is_monoid_tree(call.reduction) and call.chunk_reduction is identity:
        check_monoid_rows(call.reduction, raw.out_shape, rows)
    reduction, how = _recognized(call, raw) if call.reduction is not None else (None, "")
    if reduction is not None and not mapped:  # (a device's share: checked on all rows)
        reduction.check_rows(n)
    kind = _kind(call, reduction)
    if policy is Policy.OVERLAP and kind is Kind.MAP and call.chunk_reduction is identity:
        check_rowwise(raw.out_shape, rows, "fun(chunk)")
    whole = whole_map(call, kind, policy, raw, rows, mapped)
    if whole is not None and not whole.chunked_derivatives:
        # Chunks would bound nothing larger than the inputs and outputs and serialize
        # it (XLA:CPU runs a loop body's fusion on one thread; the large map of
        # bench/report.py: 29.7 -> 14.9 ms); so would they its reverse mode.
        notes = [whole_note(n, b)]
        policy, chunks, rows, avals, raw = Policy.SINGLE, 1, n, rows_aval(call.xs, n), whole.traced
    if policy is Policy.OVERLAP and not (kind is Kind.MAP and call.chunk_reduction is identity):
        if kind is not Kind.MONOID:
            # Repeated rows cannot be left out of an unknown reduction or a chunk summary:
            # chunks of at most batch_size rows, then the remainder rows apart.
            policy, chunks = Policy.REMAINDER, n // rows
            notes = [note for note in notes if not note.startswith("remainder=")]
        elif chunks * rows != n and not all(
            s.shape[:1] == (rows,) for s in jax.tree.leaves(raw.out_shape)
        ):
            notes.append("fun's output has no row axis, so repeated rows cannot be left out")
            policy, chunks = Policy.REMAINDER, n // rows
    remainder = n - chunks * rows if policy is Policy.REMAINDER else 0
    if kind is Kind.GENERIC and chunks and (mapped or chunks + bool(remainder) > 1):
        assert call.reduction is not None  # GENERIC: the user's reduction combines results
        check_combine(call.reduction, call.chunk_reduction, raw.out_shape, loop=chunks > 1)
    tail = trace(call.fun, rows_aval(call.xs, remainder)) if remainder else None
    traced = raw
    if reduction is not None:
        # The prologue joins fun's jaxpr (evaluated, not traced again).
        traced = trace(reduction.prepare(raw), avals)
        tail = trace(reduction.prepare(tail), rows_aval(call.xs, remainder)) if tail else None
    plan = Plan(
        n=n,
        batch_size=b,
        kind=kind,
        reduction=reduction,
        recognition=how,
        policy=policy,
        chunks=chunks,
        rows_per_chunk=rows,
        masked=chunks * rows - n if policy is Policy.OVERLAP else 0,
        remainder=remainder,
        platform=target_platform(),
        notes=tuple(notes),
        autotune=decision,
        traced=traced,
        tail=tail,
        backward=whole.gradient(None) if whole and not whole.chunked_derivatives else "",
    )
    if whole is None or not whole.chunked_derivatives:
        return plan
    # Run whole forward; run whole, reverse mode would keep fun's intermediates for
    # all n rows (8 softmax layers, 2^16 rows of 256: 2 GiB where chunks keep 129 MiB),
    # so the derivatives run this plan's chunks.
    return dataclasses.replace(
        plan,
        policy=Policy.SINGLE,
        chunks=1,
        rows_per_chunk=n,
        masked=0,
        remainder=0,
        notes=(whole_note(n, b),),
        traced=whole.traced,
        tail=None,
        backward=whole.gradient(plan),
        derivatives=plan,
    )


def _spread(call: Call, n: int | None, mapped: bool) -> tuple[Any, tuple[str, ...], bool] | None:
    """``(mesh, axes, implicit)`` when the rows are spread over devices: ``shard=True``
    (the call's mesh, every axis), or an input whose rows already live on several
    devices (that input's mesh and row axes: each device processes its own rows, as
    ``jax.vmap`` would); None otherwise (a device's own share, ``mapped``, included)."""
    if not n or mapped:
        return None
    if call.shard:
        assert call.mesh is not None  # shard=True calls get a mesh (engines.chunked.prepare)
        return call.mesh, tuple(call.mesh.axis_names), False
    rows = row_sharding(call.xs)
    return None if rows is None else (rows.mesh, rows.axes, True)


def _split_note(n: int, b: int, rows: int, split: str, mode: str) -> str:
    k = -(-n // b)
    share = lambda repeats: f"{repeats} of {n} rows ({repeats / n:.1%})"
    if split == "overlap":
        kind = "chunks of batch_size" if rows == b else "balanced chunks"
        return (
            f"remainder={mode!r}: {k} {kind} ({rows} rows), the last repeating "
            f"{share(k * rows - n)}: one copy of fun, traced once"
        )
    if mode == "separate":
        return f"remainder='separate': the last {n % b} rows run apart (fun compiled twice)"
    return (
        f"remainder='auto': overlapping chunks would repeat {share(k * -(-n // k) - n)}, "
        f"over 1/8, so the last {n % b} rows run apart (fun compiled twice)"
    )


def _sharded_plan(call: Call, n: int, mesh: Any, axes: tuple[str, ...], implicit: bool) -> Plan:
    d = math.prod(mesh.shape[a] for a in axes)
    prefix, rest = n - n % d, n % d
    lanes = Lanes(d, mesh, axes)
    local = remainder = None
    if prefix:  # a device's share, planned on its rows, then traced for all devices at once
        local = make_plan(call.with_rows(rows_aval(call.xs, prefix // d)), mapped=True)
        local = _over_lanes(local, call, lanes)
    if rest:
        remainder = make_plan(call.with_rows(rows_aval(call.xs, rest)), mapped=True)
    lay = ShardLayout(
        mesh=mesh,
        axes=axes,
        prefix=prefix,
        local_rows=prefix // d,
        global_remainder=rest,
        local=local,
        remainder=remainder,
        implicit=implicit,
    )
    first = lay.local or lay.remainder
    assert first is not None  # n > 0 rows: a divisible prefix, a remainder or both
    if first.reduction is not None:
        first.reduction.check_rows(n)
    notes: tuple[str, ...] = ()
    if implicit:
        notes = (
            f"fun_input's rows are sharded over mesh axes {axes}: each device processes "
            "its own rows, batch_size bounding its chunks (as with shard=True)",
        )
    return Plan(
        n=n,
        batch_size=call.batch_size,
        kind=first.kind,
        reduction=first.reduction,
        recognition=first.recognition,
        policy=Policy.SHARDED,
        chunks=0,
        rows_per_chunk=0,
        platform=first.platform,
        notes=notes,
        shard=lay,
    )


def _typed(aval: jax.ShapeDtypeStruct, x: Any, lanes: Lanes) -> jax.ShapeDtypeStruct:
    """``aval`` with its rows split over the lanes' axes, as a chunk of ``x`` is, where
    ``x`` is typed on Explicit axes."""
    sharding = sharding_of(x)
    if not explicit(sharding):
        return aval
    split = jax.sharding.NamedSharding(sharding.mesh, lanes.spec())
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=split)


def _over_lanes(plan: Plan, call: Call, lanes: Lanes) -> Plan:
    """A device's plan run by all devices at once: each chunk of ``fun`` takes the
    same rows of every device's share (``lanes.count`` times the chunk's rows)."""
    if plan.policy is Policy.EMPTY or plan.traced is None:
        return plan
    if plan.kind is Kind.GENERIC:  # each device reduces its own rows (vmapped over them)
        return dataclasses.replace(plan, lanes=lanes)
    d = lanes.count

    def again(traced: Traced | None, rows: int) -> Traced | None:
        if traced is None:
            return None
        fun = call.fun if plan.reduction is None else plan.reduction.prepare(call.fun)
        avals = rows_aval(call.xs, d * rows)
        if explicit(sharding_of(jax.tree.leaves(call.xs)[0])):
            # rows typed as the chunks will be (split over the lanes' axes): derivative
            # rules traced into fun's jaxpr (jax.nn.relu's select, a fori_loop's carry)
            # then make tangents of the chunks' sharding, not unsharded ones
            avals = jax.tree.map(lambda a, x: _typed(a, x, lanes), avals, call.xs)
            with typed_mesh(*jax.tree.leaves(call.xs)):
                return trace(fun, avals)
        return trace(fun, avals)

    return dataclasses.replace(
        plan,
        lanes=lanes,
        traced=again(plan.traced, plan.rows_per_chunk),
        tail=again(plan.tail, plan.remainder),
    )
