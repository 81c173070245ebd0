"""The fused kernel as an engine of the registry (``_engines``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ... import _config
from ... import _tangent as tangent
from ..._monoid import MonoidReduction
from ..._plan import Call, Kind, Plan, Policy, Rejection
from . import check, fused_reduce

__all__ = ["FusedEngine"]


class FusedEngine:
    """The fused Pallas kernel, compiled (``"pallas"``) or interpreted (``"interpret"``)."""

    def __init__(self, interpret: bool):
        self.interpret = interpret
        self.name = "interpret" if interpret else "pallas"

    def accept(self, plan: Plan, call: Call) -> Plan | Rejection:
        requested = _config.current().backend
        if requested not in ("auto", self.name):
            return Rejection(f"not requested (backend={requested!r})")
        if self.interpret and requested != "interpret":
            return Rejection("only on request (backend='interpret'): slow, for testing")
        if not tangent.SUPPORTED:
            return Rejection(f"the fused kernel needs jax >= 0.10.0: {tangent.UNSUPPORTED}")
        if plan.kind is not Kind.MONOID:
            return Rejection("no fused kernel: the reduction is not a recognized monoid")
        if plan.policy is Policy.EMPTY:
            return Rejection("empty input: the result is the monoid identity")
        if plan.n is None:
            return Rejection("nothing mapped (batch_size=None): one plain call of fun")
        forced = requested == self.name
        if not self.interpret and plan.platform == "cpu":
            if forced:
                return Rejection(
                    "Pallas has no compiled CPU lowering; use backend='interpret' on CPU", True
                )
            return Rejection(
                "on CPU the fused kernel only runs in interpret mode (slow); "
                "backend='interpret' forces it"
            )
        platform = "cpu" if self.interpret else plan.platform
        reduction, max_rows = _monoid(plan)
        verdict = check(
            reduction.prepare(call.fun),
            call.xs,
            reduction,
            platform=platform,
            max_rows=max_rows,
            traced=plan.traced,
        )
        if verdict.problem:
            return Rejection(f"fused kernel not used: {verdict.problem}", forced)
        if self.interpret:
            where = "in interpret mode (requested)"
        elif verdict.compiled:
            where = f"compiled for {verdict.device}"
        else:
            where = f"lowered for {verdict.device} (not compiled: no {platform} compiler here)"
        return dataclasses.replace(
            plan,
            engine=self.name,
            reason=f"fused Pallas kernel {where}, blocks of {verdict.rows} rows"
            + (f" (VMEM model: {verdict.vmem / 2**20:.1f} MiB)" if verdict.vmem else ""),
            block_rows=verdict.rows,
            block_steps=verdict.steps,
            block_traced=verdict.traced,
        )

    def run(self, plan: Plan, call: Call) -> Any:
        reduction, max_rows = _monoid(plan)
        return fused_reduce(
            reduction.prepare(call.fun),
            call.xs,
            reduction,
            rows=plan.block_rows,
            steps=plan.block_steps,
            max_rows=max_rows,
            interpret=self.interpret,
            platform=plan.platform,
            traced=plan.block_traced,
        )


def _monoid(plan: Plan) -> tuple[MonoidReduction, int | None]:
    """A Kind.MONOID plan's reduction and batch_size. Only sharded plans (run by the
    shard engine) keep batch_size="auto"; every other plan has an int or None."""
    assert plan.reduction is not None and not isinstance(plan.batch_size, str)
    return plan.reduction, plan.batch_size
