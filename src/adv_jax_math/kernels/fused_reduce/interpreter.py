"""Evaluate ``fun``'s jaxpr inside the kernel, rewriting what a target cannot compile.

Pallas Triton has libdevice versions of ``tanh``, ``log1p``, ``expm1`` (and others)
for float32/float64 only: on bfloat16/float16 they lower, then fail to compile
(``failed to legalize operation 'math.tanh'``). On Triton targets those operations
run in float32 and are cast back, as XLA's own float normalization does. Calls
(``pjit``, ``closed_call``, custom derivative wrappers) are evaluated through, so
the rewrite reaches operations inside them; the kernel's forward pass needs no
custom derivative rules (its tangent is computed outside, see ``analysis.tangent``).

Each operation binds in the context it is evaluated in, never in the one it was
traced in (``jax.core.eval_jaxpr`` re-enters each equation's recorded context,
its abstract mesh among them): ``fun`` is traced once where the call is planned
(under ``jax.set_mesh`` of an Explicit mesh, say) and evaluated inside the kernel,
which runs inside ``shard_map``, where the mesh axes are Manual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

__all__ = ["UPCAST_ON_TRITON", "evaluate"]

UPCAST_ON_TRITON = frozenset(
    {"tanh", "log1p", "expm1", "logistic", "div", "pow", "erf", "erf_inv", "tan", "atan2"}
)
_CALLS = ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call")
_BODIES = ("jaxpr", "call_jaxpr", "fun_jaxpr")  # params holding the body of a call
# Placements a trace under a mesh records (a constant typed on an Explicit mesh): a
# kernel's values have none, and under shard_map a placed value is a closed-over one.
_PLACEMENTS = ("reshard", "sharding_constraint")


def _is_half(x: Any) -> bool:
    dtype = np.dtype(getattr(x, "dtype", np.float32))
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def _body(eqn: Any) -> ClosedJaxpr | None:
    """The body of a call equation (:data:`_CALLS`); None for any other, and for a
    body with constants (a kernel captures none: the call is bound as it is)."""
    if eqn.primitive.name not in _CALLS:
        return None
    for name in _BODIES:
        sub = eqn.params.get(name)
        if isinstance(sub, ClosedJaxpr):
            return None if sub.consts else sub
    return None


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], *, upcast: bool) -> list:
    """``jax.core.eval_jaxpr(jaxpr, consts, *args)`` in the current context (the
    abstract mesh of the caller, not of the trace), with 16-bit float operands of
    :data:`UPCAST_ON_TRITON` operations computed in float32 when ``upcast``."""
    env: dict[Any, Any] = {}
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        body = _body(eqn)
        if body is not None:
            outs = evaluate(
                body.jaxpr, body.consts, invals[-len(body.jaxpr.invars) :], upcast=upcast
            )
        elif eqn.primitive.name in _PLACEMENTS:
            outs = invals
        elif upcast and eqn.primitive.name in UPCAST_ON_TRITON and any(map(_is_half, invals)):
            wide = [x.astype(jnp.float32) if _is_half(x) else x for x in invals]
            out = eqn.primitive.bind(*wide, **eqn.params)
            outs = [out.astype(eqn.outvars[0].aval.dtype)]
        else:
            bound = eqn.primitive.get_bind_params(eqn.params)  # (subfuns, params) before jax 0.11
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
            out = eqn.primitive.bind(*subfuns, *invals, **params)
            outs = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]
