"""The roofline model (``plan.roofline``) of the fused engine's passes and of the scan
engine's for the same call: what the planner compares before it picks a kernel."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.trace import rows_aval
from ..kernels.fused_reduce.backward import ReverseKernels
from ..kernels.fused_reduce.backward_kernel import _block_vjp
from ..kernels.fused_reduce.interpreter import evaluate
from ..kernels.fused_reduce.kernel import Kernel
from ..kernels.fused_reduce.mosaic_gpu import Features
from ..plan import roofline as rl

__all__ = ["Verdict", "backward_costs", "forward_costs"]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One pass as the model sees it: the kernel's cost and the scan engine's."""

    name: str  # "forward" or "backward"
    kernel: rl.Cost
    scan: rl.Cost
    device: rl.Device

    @property
    def kernel_wins(self) -> bool:
        return self.kernel.seconds(self.device) <= self.scan.seconds(self.device)

    def __str__(self) -> str:
        d = self.device
        return f"kernel {self.kernel.brief(d)} vs scan {self.scan.brief(d)} on {d.name}"


def _struct(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))


def _floats(avals: list) -> list[int]:
    return [i for i, a in enumerate(avals) if jnp.issubdtype(a.dtype, jnp.inexact)]


def _block(avals: Any, rows: int) -> list:
    return [jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype) for a in avals]


def _fun_flops(jaxpr: Any, consts: list, xs: list) -> float:
    return rl.flops(lambda c, x: evaluate(jaxpr, c, x, upcast=False), consts, xs)


def _chunk(plan: Any, xs: Any) -> tuple[list, list, int]:
    """The scan engine's chunk: its rows' avals, fun's constants' avals, trips."""
    chunk = jax.tree.leaves(rows_aval(xs, plan.rows_per_chunk))
    consts = [_struct(c) for c in plan.traced.consts]
    return chunk, consts, plan.chunks + (1 if plan.remainder else 0)


def _states_pass(k: Kernel, d: rl.Device) -> rl.Cost:
    """A kernel ``k`` giving the monoid states (the forward's, a max/min's tally). On
    Mosaic GPU, one kernel per element group, each reading the features it needs."""
    flops = k.grid * k.steps * _fun_flops(k.jaxpr, list(k.const_avals), _block(k.in_avals, k.rows))
    states, reads, launches = k.state_avals(), list(k.in_avals), 2
    if k.target.mosaic_gpu:
        f = Features(k)
        groups = f.grouped()[-1]
        if not isinstance(groups, int):
            every = f.feature_avals()
            reads = [every[j] for g in groups for j in g.features]
            launches = 1 + len(groups)
    cost = rl.kernel_pass(
        d, inputs=reads, consts=k.const_avals, partials=states, grid=k.grid, flops=flops
    )
    return dataclasses.replace(cost, launches=launches)


def forward_costs(plan: Any, xs: Any, k: Kernel, d: rl.Device) -> Verdict:
    """The forward kernel ``k`` against the scan engine's loop for ``plan``."""
    kernel = _states_pass(k, d)
    chunk, consts, trips = _chunk(plan, xs)
    scan = rl.scan_pass(
        d,
        chunks=trips,
        inputs=chunk,
        jaxpr=plan.traced.jaxpr.jaxpr,
        carry=k.state_avals(),
        flops=_fun_flops(plan.traced.jaxpr.jaxpr, consts, chunk),
    )
    return Verdict("forward", kernel, scan, d)


def backward_costs(plan: Any, xs: Any, r: ReverseKernels, d: rl.Device) -> Verdict:
    """The reverse kernels ``r`` against the scan engine's chunks transposed: each
    chunk's VJP (fun recomputed), the constants' cotangents carried; a max/min also
    recomputes fun for its tied rows first, in both engines."""
    k = r.kernel
    blocks = k.grid * k.steps
    vjp_flops = rl.flops(
        lambda c, x: _block_vjp(k, c, x), list(k.const_avals), _block(k.in_avals, k.rows)
    )
    kernel = rl.kernel_pass(
        d,
        inputs=k.in_avals,
        consts=k.const_avals,
        partials=k.sums(),
        grid=k.grid,
        flops=blocks * vjp_flops,
        outputs=[k.in_avals[i] for i in k.x_idx],
    )
    chunk, consts, trips = _chunk(plan, xs)
    jaxpr = plan.traced.jaxpr.jaxpr
    fun_flops = _fun_flops(jaxpr, consts, chunk)
    if r.tally is not None:
        kernel = kernel + _states_pass(r.tally[0], d)
    c_idx, x_idx = _floats(consts), _floats(chunk)

    def chunk_vjp(cs: list, rows: list) -> list:
        f = lambda c_nz, x_nz: evaluate(
            jaxpr, _put(cs, c_idx, c_nz), _put(rows, x_idx, x_nz), upcast=False
        )
        ys, vjp = jax.vjp(f, [cs[i] for i in c_idx], [rows[i] for i in x_idx])
        return jax.tree.leaves(vjp([_ones(y) for y in ys]))

    vjp_jaxpr = jax.make_jaxpr(chunk_vjp)(consts, chunk).jaxpr
    scan = rl.scan_pass(
        d,
        chunks=trips,
        inputs=chunk,
        jaxpr=vjp_jaxpr,
        carry=[consts[i] for i in c_idx],
        flops=rl.flops(chunk_vjp, consts, chunk),
        outputs=[chunk[i] for i in x_idx],
    )
    if r.tally is not None:
        scan = scan + rl.scan_pass(
            d, chunks=trips, inputs=chunk, jaxpr=jaxpr, carry=[], flops=fun_flops
        )
    return Verdict("backward", kernel, scan, d)


def _ones(y: Any) -> Any:
    if jnp.issubdtype(y.dtype, jnp.inexact):
        return jnp.ones(y.shape, y.dtype)
    return np.zeros(y.shape, jax.dtypes.float0)


def _put(values: list, where: list[int], new: list) -> list:
    out = list(values)
    for i, v in zip(where, new, strict=True):
        out[i] = v
    return out
