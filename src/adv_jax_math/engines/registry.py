"""The engine registry: one ordered list of engines; the first that accepts a plan
runs it, and every engine tried before it records why it could not.

An engine (:class:`Engine`) has a ``name``, ``accept(plan, call)`` returning the plan
completed with its choices (or a :class:`~..plan.base.Rejection`), ``run(plan,
call)``, ``states(plan, xs, offset)`` (a monoid's states, which the shard layer merges
across the parts of a sharded call), ``describe_reverse(plan, call)`` (for
``explain``) and ``auto_draft(call)`` (a ``batch_size="auto"`` plan it sizes itself).
An engine that cannot give the states of a part of a sharded call (``call.share``)
declines it in ``accept``, saying why.

This module imports no engine: the engines are installed, in their order, by the
layer above all of them (``batch.route``). Order: the shard layer (``shard=True``;
each device then runs a plan of its own), the fused Pallas kernel compiled for the
target, the kernel in interpret mode (on request), the pairwise tiles (a reduction
``analysis.pair_rows`` shows to be a pairwise one, on CPU), and the ``lax.scan``
engine, which runs everything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from ..core import config as _config
from ..core.sharding import follow_layout, typed_mesh
from ..core.trace import rows_aval
from ..plan.base import Call, Plan, Rejection
from ..plan.planner import make_plan

__all__ = ["Engine", "by_name", "engines", "explain", "install", "plan", "run"]


class Engine(Protocol):
    """What the registry, the shard layer and :func:`explain` call on an engine."""

    name: str

    def accept(self, plan: Plan, call: Call) -> Plan | Rejection:
        """``plan`` completed with this engine's choices, or why it cannot run it (a
        part of a sharded call, ``call.share``, only where :meth:`states` serves it)."""
        ...

    def run(self, plan: Plan, call: Call) -> Any:
        """The call's result (``plan`` accepted by this engine)."""
        ...

    def states(self, plan: Plan, xs: Any, offset: int) -> list:
        """A monoid plan's state per term over the rows ``xs`` (global row indices
        from ``offset``), to be merged with other parts' (the shard layer)."""
        ...

    def describe_reverse(self, plan: Plan, call: Call) -> Plan:
        """``plan`` with how reverse mode runs it (``Plan.backward``), for ``explain``."""
        ...

    def auto_draft(self, call: Call) -> Plan | None:
        """A plan for a ``batch_size="auto"`` call that this engine sizes itself (not
        autotuned), or None (the default of the engines that subclass this protocol):
        the call is then planned and autotuned as usual."""
        return None


_ENGINES: list[Engine] = []


def install(*engines: Engine) -> None:
    """Set the engines, in the order they are tried (the last must accept every plan)."""
    names = [engine.name for engine in engines]
    if len(set(names)) != len(names):
        raise ValueError(f"engine names must be unique, got {names}")
    _ENGINES[:] = engines


def engines() -> tuple[Engine, ...]:
    """The installed engines, in order."""
    if not _ENGINES:
        raise RuntimeError("no engines installed: import adv_jax_math (batch.route installs them)")
    return tuple(_ENGINES)


def by_name(name: str) -> Engine:
    """The installed engine called ``name``."""
    for engine in engines():
        if engine.name == name:
            return engine
    raise KeyError(f"no engine named {name!r}; installed: {[e.name for e in engines()]}")


def select(draft: Plan, call: Call) -> Plan:
    """Complete ``draft`` (from ``make_plan``) with the first engine that accepts it."""
    lay = draft.shard
    if lay is not None:
        local = lambda p, n: select(p, call.with_rows(rows_aval(call.xs, n))) if p else None
        local_plan = local(lay.local, lay.local_rows)
        remainder = local(lay.remainder, lay.global_remainder)
        draft = dataclasses.replace(
            draft, shard=dataclasses.replace(lay, local=local_plan, remainder=remainder)
        )
    requested = _config.current().backend
    rejected: list[tuple[str, Rejection]] = []
    for engine in engines():
        out = engine.accept(draft, call)
        if isinstance(out, Plan):
            break
        rejected.append((engine.name, out))
    assert isinstance(out, Plan)  # the last engine, scan, accepts every plan
    errors = [r.reason for name, r in rejected if r.error and name == requested]
    return dataclasses.replace(
        out,
        reason=_why_not(rejected, requested) if out.engine == "scan" else out.reason,
        rejected=tuple((name, r.reason) for name, r in rejected if name != "shard"),
        error=out.error
        or (f"backend={requested!r} was requested but cannot run: {errors[0]}" if errors else ""),
    )


def _why_not(rejected: list[tuple[str, Rejection]], requested: str) -> str:
    """Why the scan engine runs: the requested kernel's rejection, else the compiled one's."""
    if requested == "scan":
        return "requested (backend='scan')"
    wanted = requested if requested in ("pallas", "interpret") else "pallas"
    return next((r.reason for name, r in rejected if name == wanted), "lax.scan over chunks")


def plan(call: Call, *, mapped: bool = False) -> Plan:
    """The full plan for ``call``: chunks, reduction and engine. A ``batch_size="auto"``
    call that an engine sizes itself is not autotuned (``Engine.auto_draft``)."""
    if call.batch_size == "auto" and not mapped:
        for engine in engines():
            draft = engine.auto_draft(call)
            if draft is not None:
                chosen = select(draft, call)
                if chosen.engine == engine.name:
                    return chosen
    return select(make_plan(call, mapped=mapped), call)


def explain(call: Call) -> Plan:
    """:func:`plan`, with how its reverse mode would run where the engine says
    (``describe_reverse``: building the backward kernels as a gradient would)."""
    out = plan(call)
    return out if out.error else by_name(out.engine).describe_reverse(out, call)


def run(plan: Plan, call: Call) -> Any:
    """Execute ``plan`` on its engine.

    A call with mapped rows runs as one ``jax.jit`` program (inside an enclosing
    ``jit`` it is inlined), under the mesh of inputs typed on Explicit axes when no
    mesh is set (see ``core.sharding.typed_mesh``), so that values JAX and the engines
    build to match them, in the forward pass and in its derivatives, carry their
    sharding.
    """
    if plan.error:
        raise NotImplementedError(plan.error)
    engine = by_name(plan.engine)
    if plan.n is None:  # nothing mapped: the call as written, not traced again
        return engine.run(plan, call)
    consts = list({id(c): c for c in plan.consts()}.values())

    def program(xs: Any, values: list) -> Any:
        xs, values = follow_layout((xs, values))
        local = plan.with_consts({id(c): v for c, v in zip(consts, values, strict=True)})
        return engine.run(local, dataclasses.replace(call, xs=xs))

    # fun's constants are arguments of the program, as they are values of an eager
    # call (not folded into the program: XLA:CPU in jaxlib 0.12.0.1 miscompiles a dot
    # with a splat constant fused into a reduction, see tests/test_engines.py).
    with typed_mesh(call.xs, consts):
        return jax.jit(program)(call.xs, consts)
