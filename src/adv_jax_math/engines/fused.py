"""The fused kernel as an engine of the registry (``engines.registry``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr
from jax.sharding import NamedSharding, PartitionSpec

from ..analysis import tangent
from ..core import config as _config
from ..core.sharding import Lanes, explicit_context, kernel_blocked
from ..core.targets import Target, target, triton_problem
from ..kernels.fused_reduce.backward import float_positions, plan_reverse, run_reverse
from ..kernels.fused_reduce.backward_mosaic_gpu import kernel_count
from ..kernels.fused_reduce.fused import Check, check, fused_states, reverse_blocks
from ..monoids.reduction import MonoidReduction
from ..plan import roofline
from ..plan.base import Call, Kind, Plan, Policy, Rejection
from . import scan as _scan
from .fused_model import backward_costs, forward_costs
from .registry import Engine

__all__ = ["FusedEngine"]


_SLOWER = "the roofline model says the scan engine is faster: {}"
_SPLIT = ", the inputs split into one vector of rows per feature in XLA first (another pass)"
_GROUPS = (
    ", in {} kernels, each folding a group of fun's output elements (one row per thread: "
    "a group's values of a row fit a thread's registers)"
)


def _features(xs: Any) -> bool:
    """Whether an input has more than one value per row."""
    return any(math.prod(x.shape[1:]) > 1 for x in jax.tree.leaves(xs))


class FusedEngine(Engine):
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
        if (plan.lanes is None or plan.lanes.count == 1) and (why := kernel_blocked()):
            return Rejection(f"no fused kernel: {why}", forced)
        platform = "cpu" if self.interpret else plan.platform
        reduction, max_rows = _monoid(plan)
        fun = reduction.prepare(call.fun)
        judged = not forced and _config.current().roofline

        def costs(v: Check) -> Any:
            d = None if self.interpret else roofline.device(v.device)
            return (
                None if d is None or v.kernel is None else forward_costs(plan, call.xs, v.kernel, d)
            )

        def judge(v: Check) -> str | None:  # (a GPU backend before the next one is tried)
            model = costs(v) if judged else None
            return None if model is None or model.kernel_wins else _SLOWER.format(model)

        verdict = check(
            fun,
            call.xs,
            reduction,
            platform=platform,
            max_rows=max_rows,
            traced=plan.traced,
            judge=judge,
        )
        if verdict.problem:
            return Rejection(
                f"fused kernel not used: {verdict.problem}", forced and not verdict.empty
            )
        model = costs(verdict)
        if model is not None and not model.kernel_wins and judged:
            return Rejection(_SLOWER.format(model))
        assert verdict.kernel is not None
        label = verdict.kernel.target.label
        if self.interpret:
            where = f"in interpret mode (requested; {label})"
        elif verdict.compiled:
            where = f"compiled for {verdict.device} ({label})"
        else:
            where = (
                f"lowered for {verdict.device} ({label}, not compiled: no {platform} compiler here)"
            )
        return dataclasses.replace(
            plan,
            engine=self.name,
            reason=f"fused Pallas kernel {where}, blocks of {verdict.rows} rows"
            + (f" (VMEM model: {verdict.vmem / 2**20:.1f} MiB)" if verdict.vmem else "")
            + (_SPLIT if verdict.backend == "mosaic_gpu" and _features(call.xs) else "")
            + (_GROUPS.format(verdict.groups) if verdict.groups > 1 else "")
            + "".join(f"; {why}" for why in verdict.declined),
            block_rows=verdict.rows,
            block_steps=verdict.steps,
            block_backend=verdict.backend,
            block_traced=verdict.traced,
            reverse_traced=reverse_blocks(fun, call.xs, reduction, verdict, platform, max_rows),
            roofline=(model,) if model else (),
        )

    def run(self, plan: Plan, call: Call) -> Any:
        reduction, _ = _monoid(plan)
        parts = [(plan, call.xs, 0)]
        # Each backward block trace's constants among the traces' constants
        # (``tangent.reduce`` numbers them so, once each).
        order = {id(c): i for i, c in enumerate({id(c): c for c in plan.consts()}.values())}
        where = [[order[id(c)] for c in b[0].consts] for b in _reverse_blocks(plan)]
        return tangent.reduce(
            reduction,
            parts,
            self.states,
            _scan.tangent_shares,
            custom=True,
            differentiable_states_of=_scan.states,
            transpose_of=lambda rev: self.reverse(rev, where),
        )

    def reverse_kernels(
        self, plan: Plan, xs: list, states: list, c_idx: list[list[int]], x_idx: list[int]
    ) -> tuple[Any, Any, int]:
        """The reverse pass's kernels (``backward.ReverseKernels``) at the largest of ``plan``'s
        backward blocks (``_reverse_blocks``) that compiles, or why reverse mode
        transposes the scan engine's chunks instead; the roofline model's verdict on
        them (None: none made); which block. ``c_idx``: per block, its trace's
        constants with a cotangent."""
        if plan.lanes is not None and plan.lanes.count > 1:
            return "the rows are spread over devices (no backward kernel per device yet)", None, 0
        if explicit_context() is not None:
            return "under a mesh with Explicit axes (no backward kernel in shard_map yet)", None, 0
        reduction, _ = _monoid(plan)
        targets = self._reverse_targets(plan)
        if isinstance(targets, str):
            return targets, None, 0
        reasons = []
        for tgt in targets:
            built, i = self._reverse_at(plan, xs, reduction, states, c_idx, x_idx, tgt)
            if not isinstance(built, str):
                break
            reasons.append(built if len(targets) == 1 else f"{tgt.label} not used: {built}")
        if isinstance(built, str):
            return "; ".join(reasons), None, i
        built = dataclasses.replace(built, declined=tuple(reasons))
        d = None if self.interpret else roofline.device(tgt.device_kind)
        if d is None:
            return built, None, i
        model = backward_costs(plan, xs, built, d)
        options = _config.current()
        if not model.kernel_wins and options.backend != self.name and options.roofline:
            return f"the roofline model says the scan engine is faster: {model}", model, i
        return built, model, i

    def _reverse_targets(self, plan: Plan) -> list[Target] | str:
        """The targets the backward kernel is tried for, in order: the forward's
        backend first (Mosaic GPU's, then Triton's on a GPU), or why none."""
        mosaic_gpu = plan.block_backend == "mosaic_gpu"
        if self.interpret:
            return [target("cpu", "mosaic_gpu" if mosaic_gpu else None)]
        if target(plan.platform).platform != "cuda":
            return [target(plan.platform)]
        out = [target(plan.platform, "mosaic_gpu")] if mosaic_gpu else []
        forced = _config.current().gpu_backend == "mosaic_gpu"
        why = "gpu_backend='mosaic_gpu'" if forced else triton_problem()
        if why is None:
            out.append(target(plan.platform, "triton"))
        return out or f"the backward kernel is Pallas Triton's: {why}"

    def _reverse_at(
        self,
        plan: Plan,
        xs: list,
        reduction: Any,
        states: list,
        c_idx: list,
        x_idx: list,
        tgt: Target,
    ) -> tuple[Any, int]:
        """The reverse pass's kernels for ``tgt`` at the largest of ``plan``'s backward
        blocks that compiles (or why none does), and which block. After a Mosaic GPU
        forward, Mosaic GPU's backward kernel runs at its block and Triton's at its own
        (``reverse_blocks``)."""
        blocks = _reverse_blocks(plan)
        tried = list(range(len(blocks)))
        if plan.block_backend == "mosaic_gpu" and tgt.platform == "cuda" and len(blocks) > 1:
            tried = tried[:1] if tgt.mosaic_gpu else tried[1:]
        reasons, lowered_only = [], False
        for i in tried:
            closed, out_shape, rows, steps = blocks[i]
            last = i == tried[-1]  # the VMEM model's block
            if lowered_only and not last:
                continue
            built = plan_reverse(
                closed,
                out_shape,
                xs,
                reduction,
                states,
                c_idx=c_idx[i],
                x_idx=x_idx,
                rows=rows,
                steps=steps,
                target=tgt,
                interpret=self.interpret,
                vmem_model=last,
            )
            if isinstance(built, str):
                reasons.append(built)
            elif last or built.compiled:
                return built, i
            else:  # no compiler for the target here: the model's block decides
                lowered_only = True
        return ("; ".join(reasons) if isinstance(built, str) else built), i

    def describe_reverse(self, plan: Plan, call: Call) -> Plan:
        """``plan`` with how reverse mode runs, with respect to every float input and
        constant (``Plan.backward``, and the model's verdict in ``Plan.roofline``)."""
        found: list = []
        c_idx = [float_positions(b[0].consts) for b in _reverse_blocks(plan)]

        def trace(xs: Any) -> list:
            states = self.states(plan, xs, 0)
            leaves = jax.tree.leaves(xs)
            found.append(self.reverse_kernels(plan, leaves, states, c_idx, float_positions(leaves)))
            return states

        jax.eval_shape(trace, call.xs)
        ((built, model, _),) = found
        if isinstance(built, str):
            text = f"the scan engine's chunks, transposed: {built}"
        else:
            k = built.kernel
            groups = kernel_count(k) if k.target.mosaic_gpu else 1
            if groups:
                text = f"backward kernel, blocks of {k.rows} rows, {k.steps} per program"
                text += f" ({k.target.label})"
                text += f", in {groups} kernels, one per group of fun's output elements" * (
                    groups > 1
                )
            else:
                text = f"no backward kernel ({k.target.label}): no result has a float cotangent"
            text += " (the tied rows tallied first)" if built.tally else ""
            text += "".join(f"; {why}" for why in built.declined)
        models = plan.roofline + ((model,) if model else ())
        return dataclasses.replace(plan, backward=text, roofline=models)

    def reverse(self, rev: tangent.Reverse, where: list[list[int]]) -> tuple:
        """The reverse pass (``tangent.Reverse``) as the backward kernels; ``where``:
        per backward block, its trace's constants' index among ``rev.values``."""
        plan, xs = rev.plans[0], jax.tree.leaves(rev.xss[0])
        lin_of = {v: j for j, v in enumerate(rev.c_pos)}
        c_idx = [[k for k, i in enumerate(w) if i in lin_of] for w in where]
        built, _, b = self.reverse_kernels(plan, xs, rev.states, c_idx, rev.x_pos[0])
        if isinstance(built, str):
            return rev.reference()
        dc, dx = run_reverse(built, _reverse_blocks(plan)[b][0], xs, rev.cts, rev.states)
        c_structs, _ = rev.lin
        ct_c = [jnp.zeros(s.shape, s.dtype) for s in c_structs]
        for k, d in zip(c_idx[b], dc, strict=True):
            j = lin_of[where[b][k]]
            ct_c[j] = ct_c[j] + d.astype(ct_c[j].dtype)
        return ct_c, [dx]

    def states(self, plan: Plan, xs: Any, offset: int) -> list:
        """Each term's state over ``plan``'s rows, from the kernel (its tangent: the
        scan engine's chunks, see ``analysis.tangent.reduce``). With the rows spread over
        devices (``plan.lanes``) every device runs the kernel on its own rows under
        ``shard_map``, and the devices' states are merged."""
        reduction, _ = _monoid(plan)
        assert plan.block_traced is not None  # set by accept()
        closed, out_shape = plan.block_traced
        run = lambda cs, rows, first: fused_states(
            (ClosedJaxpr(closed.jaxpr, cs), out_shape),
            rows,
            reduction,
            rows=plan.block_rows,
            steps=plan.block_steps,
            interpret=self.interpret,
            platform=plan.platform,
            backend=plan.block_backend,
            offset=first,
        )
        lanes = plan.lanes
        if lanes is None or lanes.count == 1:
            mesh = explicit_context()
            if mesh is None:
                return run(list(closed.consts), xs, offset)
            # A kernel runs with manual mesh axes only: under an Explicit context mesh,
            # on every device, replicated (rows spread over devices use lanes).
            lanes = Lanes(1, mesh, tuple(mesh.axis_names))
        m, spec = plan.n, lanes.spec() if lanes.count > 1 else PartitionSpec()
        assert m is not None

        def per_device(cs: list, rows: Any) -> list:
            first = offset + (lax.axis_index(lanes.axes) * m if lanes.count > 1 else 0)
            return jax.tree.map(lambda a: a[None], run(cs, rows, first))

        # The kernel's constants are arguments (replicated): shard_map takes no
        # closed-over values typed on Explicit axes.
        whole = NamedSharding(lanes.mesh, PartitionSpec())
        everywhere = lambda a: jax.sharding.reshard(jnp.asarray(a), whole)
        cs = [everywhere(c) for c in closed.consts]
        if lanes.count == 1:
            xs = jax.tree.map(everywhere, xs)
        states = jax.shard_map(
            per_device,
            mesh=lanes.mesh,
            in_specs=(PartitionSpec(), spec),
            out_specs=spec if lanes.count > 1 else PartitionSpec(),
            check_vma=False,
        )(cs, xs)
        if lanes.count == 1:
            return jax.tree.map(lambda a: a[0], states)
        return _scan.merge_all(reduction, states, lanes)


def _monoid(plan: Plan) -> tuple[MonoidReduction, int | None]:
    """A Kind.MONOID plan's reduction and batch_size. Only sharded plans (run by the
    shard engine) keep batch_size="auto"; every other plan has an int or None."""
    assert plan.reduction is not None and not isinstance(plan.batch_size, str)
    return plan.reduction, plan.batch_size


def _reverse_blocks(plan: Plan) -> list[tuple[Any, list, int, int]]:
    """The blocks the backward kernel may run at, largest first, each as ``fun``'s
    trace, its output avals, rows and steps: the forward's, then any smaller ones
    the planner traced (``reverse_blocks``)."""
    assert plan.block_traced is not None  # set by accept()
    return [(*plan.block_traced, plan.block_rows, plan.block_steps), *plan.reverse_traced]
