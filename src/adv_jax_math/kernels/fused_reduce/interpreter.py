"""Evaluate ``fun``'s jaxpr inside the kernel, rewriting what a target cannot compile.

Pallas Triton has libdevice versions of ``tanh``, ``log1p``, ``expm1`` (and others)
for float32/float64 only: on bfloat16/float16 they lower, then fail to compile
(``failed to legalize operation 'math.tanh'``). On Triton targets those operations
run in float32 and are cast back, as XLA's own float normalization does. Calls
(``analysis.jaxpr_graph.INLINE``: ``jit``, custom derivative wrappers, ``remat``) are
evaluated through by ``analysis.jaxpr_graph.walk``, so the rewrite reaches operations
inside them; the kernel's forward pass needs no custom derivative rules (its tangent
is computed outside, see ``analysis.tangent``). A call whose body has constants is
bound as it is: a kernel captures no constants.

Pallas Mosaic GPU (jax 0.12) lowers neither ``is_finite`` nor ``log1p`` (so neither
``jnp.logaddexp``) nor ``expm1`` nor ``stop_gradient`` nor ``add_any``, nor ``integer_pow``
below 2 but for -1: with ``portable``, they are computed from operations it has
(:data:`PORTABLE`, :func:`small_power`), in ``fun`` and, through :func:`portable`, in
the monoids' folds.

Each operation binds in the context it is evaluated in, never in the one it was
traced in (``jax.core.eval_jaxpr`` re-enters each equation's recorded context,
its abstract mesh among them): ``fun`` is traced once where the call is planned
(under ``jax.set_mesh`` of an Explicit mesh, say) and evaluated inside the kernel,
which runs inside ``shard_map``, where the mesh axes are Manual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...analysis.jaxpr_graph import bind, subjaxpr, walk

__all__ = ["PORTABLE", "UPCAST_ON_TRITON", "evaluate", "portable", "small_power"]

UPCAST_ON_TRITON = frozenset(
    {"tanh", "log1p", "expm1", "logistic", "div", "pow", "erf", "erf_inv", "tan", "atan2"}
)
# Placements a trace under a mesh records (a constant typed on an Explicit mesh): a
# kernel's values have none, and under shard_map a placed value is a closed-over one.
_PLACEMENTS = ("reshard", "sharding_constraint")


def _is_half(x: Any) -> bool:
    dtype = np.dtype(getattr(x, "dtype", np.float32))
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def _log1p(x: Any) -> Any:
    """``log(1 + x)`` to a few ulps where ``1 + x`` rounds (Goldberg's ``x log(u) / (u - 1)``)."""
    u = 1 + x
    return jnp.where((u == 1) | (u == jnp.inf), jnp.where(u == 1, x, u), jnp.log(u) * (x / (u - 1)))


def _expm1(x: Any) -> Any:
    """``exp(x) - 1`` to a few ulps near 0 (Kahan's ``(u - 1) x / log(u)``)."""
    u = jnp.exp(x)
    near = (u - 1) * (x / jnp.log(u))
    return jnp.where(u == 1, x, jnp.where((u - 1 == -1) | (u == jnp.inf), u - 1, near))


# What Mosaic GPU cannot lower, as operations it can (each: operands -> result).
PORTABLE: dict[str, Callable[..., Any]] = {
    "is_finite": lambda x: jnp.abs(x) < jnp.inf,
    "log1p": _log1p,
    "expm1": _expm1,
    "stop_gradient": lambda x: x,  # the kernel is never differentiated
    "add_any": jnp.add,  # (a VJP's sums of cotangents, in the backward kernel)
}


def small_power(x: Any, y: int) -> Any:
    """``x ** y`` for an integer ``y < 2``, which Mosaic GPU lowers only at -1 (a
    derivative's ``x ** 1``, a field's ``r ** -3``): from products and a division."""
    if y == 1:
        return x
    if y == 0:
        return jnp.ones_like(x)
    return 1 / (x if y == -1 else lax.integer_pow(x, -y))


def evaluate(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], *, upcast: bool, portable: bool = False
) -> list:
    """``jax.core.eval_jaxpr(jaxpr, consts, *args)`` in the current context (the
    abstract mesh of the caller, not of the trace), with 16-bit float operands of
    :data:`UPCAST_ON_TRITON` operations computed in float32 when ``upcast``, and the
    operations of :data:`PORTABLE` rewritten when ``portable``."""

    def rule(eqn: Any, invals: list) -> list:
        name = eqn.primitive.name
        if name in _PLACEMENTS:
            return invals
        if portable and name in PORTABLE:
            return [PORTABLE[name](*invals)]
        if portable and name == "integer_pow" and eqn.params["y"] < 2:
            return [small_power(invals[0], eqn.params["y"])]
        if upcast and name in UPCAST_ON_TRITON and any(map(_is_half, invals)):
            wide = [x.astype(jnp.float32) if _is_half(x) else x for x in invals]
            return [bind(eqn, wide)[0].astype(eqn.outvars[0].aval.dtype)]
        return bind(eqn, invals)

    enter = lambda eqn, ins: None if (b := subjaxpr(eqn)) is None or len(b.consts) else b
    return walk(jaxpr, consts, args, rule, enter=enter)


def portable(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, traced and evaluated with the operations of :data:`PORTABLE`
    rewritten (a monoid's fold or merge inside a Mosaic GPU kernel)."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), upcast=False, portable=True)
    return jax.tree.unflatten(jax.tree.structure(shape), out)
