"""The dtypes ``batch_jacfwd`` and ``batch_jacrev`` differentiate, as ``jax.jacfwd`` and
``jax.jacrev`` do: real floating inputs (and, for ``batch_jacrev``, outputs), complex
ones with ``holomorphic=True``, and integer or bool inputs of ``batch_jacrev`` with
``allow_int=True``. Checked on the flat leaves before any work, with errors that say
what to do instead."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "check_jacfwd_inputs",
    "check_jacfwd_outputs",
    "check_jacrev_inputs",
    "check_jacrev_outputs",
]


def check_jacfwd_inputs(leaves: list[jax.Array], holomorphic: bool) -> None:
    for x in leaves:
        if holomorphic:
            _complex(x, "batch_jacfwd", "inputs")
        elif _is_extended(x.dtype) or not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"batch_jacfwd needs real floating inputs, got {x.dtype} (shape {x.shape}). "
                "For holomorphic functions of complex inputs pass holomorphic=True; for "
                "integer inputs or non-holomorphic complex functions use jax.jvp directly"
            )


def check_jacfwd_outputs(leaves: list[jax.Array], holomorphic: bool) -> None:
    """Any dtype without ``holomorphic`` (an integer or bool output's blocks are zeros)."""
    for y in leaves:
        if holomorphic:
            _complex(y, "batch_jacfwd", "outputs")


def check_jacrev_inputs(leaves: list[jax.Array], holomorphic: bool, allow_int: bool) -> None:
    for x in leaves:
        if _is_extended(x.dtype):
            raise TypeError(
                "batch_jacrev cannot differentiate with respect to an input of dtype "
                f"{x.dtype}; pass that argument outside argnums"
            )
        if holomorphic:
            _complex(x, "batch_jacrev", "inputs")
        if jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.bool_):
            if not allow_int:
                raise TypeError(
                    f"batch_jacrev needs real or complex inputs, got {x.dtype} "
                    f"(shape {x.shape}); pass allow_int=True to get zero Jacobian blocks for "
                    "integer/bool inputs, or cast the input to a float dtype"
                )
        elif not jnp.issubdtype(x.dtype, jnp.inexact):
            raise TypeError(f"batch_jacrev needs numerical inputs, got {x.dtype} (shape {x.shape})")


def check_jacrev_outputs(leaves: list[jax.Array], holomorphic: bool) -> None:
    for y in leaves:
        if holomorphic:
            _complex(y, "batch_jacrev", "outputs")
        elif _is_extended(y.dtype) or not jnp.issubdtype(y.dtype, jnp.floating):
            raise TypeError(
                f"batch_jacrev needs real floating outputs, got {y.dtype} (shape {y.shape}). "
                "For holomorphic functions pass holomorphic=True; for complex or integer "
                "outputs of non-holomorphic functions use jax.vjp directly"
            )


def _complex(x: jax.Array, name: str, where: str) -> None:
    """With ``holomorphic=True``: ``x``, one of ``name``'s ``where`` (inputs or
    outputs), is complex."""
    if not jnp.issubdtype(x.dtype, jnp.complexfloating):
        fix = "cast the input to a complex dtype" if where == "inputs" else "return complex values"
        raise TypeError(
            f"{name} with holomorphic=True needs complex {where}, got {x.dtype} "
            f"(shape {x.shape}); {fix} or drop holomorphic"
        )


def _is_extended(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.extended)
