"""Dot products as the matrix units take them (``pairs.dots``' tiles): half floats
accumulated in float32 (:func:`half_dot`), and float32 above the default precision
on a TPU keeping its infinities (:func:`keeping_inf`; in the reverse kernel in its
cotangents too: :func:`keeping_inf_reverse`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..analysis.jaxpr_graph import bind

__all__ = ["Dot", "Keeping", "half_dot", "keeping_inf", "keeping_inf_reverse", "split"]

_ONE_PASS = {"precision": (lax.Precision.DEFAULT, lax.Precision.DEFAULT)}


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def half_dot(eqn: Any, dims: Any, a: Any, b: Any) -> list:
    """``eqn``, a dot product of half floats (at ``dims``, None: its own dimension
    numbers), accumulated in float32 and rounded. Its tangent (and so its cotangents)
    are dot products of float32 operands: JAX's transpose of the half one mixes a
    float32 cotangent with a half operand, which Triton's dot refuses."""
    return [_wide_dot(eqn, dims, a, b).astype(eqn.outvars[0].aval.dtype)]


def _wide_dot(eqn: Any, dims: Any, a: Any, b: Any) -> Any:
    wide = {**eqn.params, "preferred_element_type": np.dtype(np.float32)}
    return bind(eqn, [a, b], wide if dims is None else {**wide, "dimension_numbers": dims})[0]


@half_dot.defjvp
def _half_dot_jvp(eqn: Any, dims: Any, primals: tuple, tangents: tuple) -> tuple:
    (a, b), (da, db) = primals, tangents
    f32 = lambda v: v.astype(jnp.float32)
    t = _wide_dot(eqn, dims, f32(da), f32(b)) + _wide_dot(eqn, dims, f32(a), f32(db))
    return half_dot(eqn, dims, a, b), [t.astype(eqn.outvars[0].aval.dtype)]


def split(precision: Any) -> bool:
    """Whether a dot product of float32 at ``precision`` (a ``dot_general``'s, None:
    ``jax_default_matmul_precision``'s) runs as several bfloat16 passes on a TPU."""
    given = precision if isinstance(precision, tuple) else (precision, precision)
    if all(p is None for p in given):
        config = getattr(jax.config, "jax_default_matmul_precision", None)
        return str(config).lower() not in ("none", "default", "bfloat16", "fastest")
    return any(p not in (None, lax.Precision.DEFAULT) for p in given)


Dot = Callable[[dict, jax.Array, jax.Array], jax.Array]
Keeping = Callable[..., jax.Array]  # keeping_inf or keeping_inf_reverse: (dot, a, b)


def _either(full: jax.Array, one: jax.Array) -> jax.Array:
    return jnp.where(jnp.isnan(full), one, full)


def keeping_inf(dot: Dot, a: jax.Array, b: jax.Array) -> jax.Array:
    """``dot({}, a, b)``, or where it is NaN ``dot`` at the default precision (one
    bfloat16 pass). Mosaic's float32 dot product in bfloat16 passes
    (Precision.HIGHEST) is NaN for ``[1, inf] . [1, 1]``, XLA's is inf (measured on a
    TPU v5e, jax 0.10.2): a split ``inf - bf16(inf)``. One pass keeps the infinities;
    a finite result has no NaN to replace. It costs a pass more than the dot (six at
    HIGHEST). Differentiable in every mode, as JAX differentiates its two dots."""
    return _either(dot({}, a, b), dot(_ONE_PASS, a, b))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def keeping_inf_reverse(dot: Dot, a: jax.Array, b: jax.Array) -> jax.Array:
    """:func:`keeping_inf` whose cotangents are made the same way: JAX's transposes of
    the dot (at its precision, in the reverse kernel on a TPU) lose the infinities as
    the dot does (NaN gradients of ``tests/test_accelerator_pairwise.py``'s special
    values on a TPU v5e). Reverse mode only: for the reverse kernel's tiles
    (``pairs.sides``), which nothing differentiates in forward mode (the forward
    kernel's states are, under ``jax.jvp`` of a gradient)."""
    return keeping_inf(dot, a, b)


def _keeping_inf_fwd(dot: Dot, a: jax.Array, b: jax.Array) -> tuple:
    return keeping_inf(dot, a, b), (a, b)


def _keeping_inf_bwd(dot: Dot, res: tuple, ct: jax.Array) -> tuple:
    full = jax.vjp(functools.partial(dot, {}), *res)[1](ct)
    one = jax.vjp(functools.partial(dot, _ONE_PASS), *res)[1](ct)
    return tuple(map(_either, full, one))


keeping_inf_reverse.defvjp(_keeping_inf_fwd, _keeping_inf_bwd)
