"""The fused kernel as an engine of the registry (``_engines``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ... import _config
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
        verdict = check(
            plan.reduction.prepare(call.fun),
            call.xs,
            plan.reduction,
            platform=platform,
            max_rows=plan.batch_size,
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
        )

    def run(self, plan: Plan, call: Call) -> Any:
        return fused_reduce(
            plan.reduction.prepare(call.fun),
            call.xs,
            plan.reduction,
            rows=plan.block_rows,
            steps=plan.block_steps,
            max_rows=plan.batch_size,
            interpret=self.interpret,
            platform=plan.platform,
        )
