"""A linear map with a transpose of our own: the tangent of a fused reduction.

``linear_call(impl, transpose, lin, res)`` computes ``impl(lin, res)`` (linear in
``lin``, any function of the residuals ``res``) as one primitive of JAX's: forward
mode evaluates ``impl`` (and differentiates it for higher orders), ``vmap`` maps
it, and reverse mode calls ``transpose(cts, res)`` for the cotangents of ``lin``
instead of transposing ``impl``. This is how the fused kernel's reverse pass runs
as backward kernels while ``jax.jvp``/``jax.jacfwd``/``jax.hessian`` keep working:
``impl`` is the chunked tangent, ``transpose`` the backward kernels (whose own
derivative, from the second order on, is that of ``impl``'s transpose).

Only public entry points are used: ``jax.extend.core.Primitive`` and the rule tables
of ``jax.interpreters.ad``, ``jax.interpreters.batching`` and ``jax.interpreters.mlir``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["cotangent_for", "linear_call"]


class _Spec:
    """The static part of one linear map (compared by identity: a primitive
    parameter must be hashable)."""

    def __init__(
        self, impl: Callable, transpose: Callable, lin_tree: Any, res_tree: Any, n_lin: int
    ):
        self.impl, self.transpose = impl, transpose
        self.lin_tree, self.res_tree, self.n_lin = lin_tree, res_tree, n_lin
        self.out_tree: Any = None
        self.out_avals: list | None = None  # given by the caller, or from impl's trace

    def split(self, flat: list) -> tuple[Any, Any]:
        lin = jax.tree.unflatten(self.lin_tree, flat[: self.n_lin])
        return lin, jax.tree.unflatten(self.res_tree, flat[self.n_lin :])

    def outs(self, *flat: Any) -> list:
        """The result's avals for these arguments (values or avals)."""
        return self.out_avals if self.out_avals is not None else jax.eval_shape(self.call, *flat)

    def call(self, *flat: Any) -> list:
        out = self.impl(*self.split(list(flat)))
        leaves, tree = jax.tree.flatten(out)
        self.out_tree = tree
        return leaves


_linear = Primitive("adv_jax_math_linear")
_linear.multiple_results = True


def linear_call(impl: Callable, transpose: Callable, lin: Any, res: Any, out: Any = None) -> Any:
    """``impl(lin, res)``, linear in ``lin``, whose transpose is ``transpose(cts, res)``
    (returning the cotangents of ``lin``, same structure). ``out``: the result's
    structure (``ShapeDtypeStruct`` leaves), if known: then ``impl`` is traced only
    where forward mode evaluates it."""
    lin_flat, lin_tree = jax.tree.flatten(lin)
    res_flat, res_tree = jax.tree.flatten(res)
    spec = _Spec(impl, transpose, lin_tree, res_tree, len(lin_flat))
    if out is None:
        jax.eval_shape(spec.call, *lin_flat, *res_flat)  # the output structure
    else:
        spec.out_avals, spec.out_tree = jax.tree.flatten(out)
    out = _linear.bind(*lin_flat, *res_flat, spec=spec)
    return jax.tree.unflatten(spec.out_tree, out)


def _impl(*flat: Any, spec: _Spec) -> list:
    return spec.call(*flat)


def _abstract_eval(*avals: Any, spec: _Spec) -> list:
    out = spec.outs(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    return [jax.core.ShapedArray(o.shape, o.dtype) for o in out]


def _zeros(t: Any, x: Any) -> Any:
    if type(t) is ad.Zero:  # float0 for an integer residual (a row index, a count)
        return cotangent_for(jax.core.ShapedArray(jnp.shape(x), jnp.result_type(x)))
    return t


def _jvp(primals: list, tangents: list, *, spec: _Spec) -> tuple:
    zeros = tuple(_zeros(t, x) for t, x in zip(tangents, primals, strict=True))
    return jax.jvp(lambda *f: spec.call(*f), tuple(primals), zeros)


def _transpose(cts: list, *args: Any, spec: _Spec) -> list:
    lin, res_flat = args[: spec.n_lin], list(args[spec.n_lin :])
    assert not any(ad.is_undefined_primal(r) for r in res_flat)  # linear in `lin` only
    struct = lambda x: jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype)
    lin_structs = [struct(x) if ad.is_undefined_primal(x) else x for x in lin]
    outs = spec.outs(*lin_structs, *res_flat)
    cts = [
        jnp.zeros(o.shape, o.dtype) if type(c) is ad.Zero else c
        for c, o in zip(cts, outs, strict=True)
    ]
    res = jax.tree.unflatten(spec.res_tree, res_flat)
    lin_cts = jax.tree.leaves(spec.transpose(jax.tree.unflatten(spec.out_tree, cts), res))
    lin_cts = [c if ad.is_undefined_primal(x) else None for c, x in zip(lin_cts, lin, strict=True)]
    return [*lin_cts, *([None] * len(res_flat))]


def _batch(args: list, dims: list, *, spec: _Spec) -> tuple:
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    moved = [
        jnp.broadcast_to(a, (size, *jnp.shape(a))) if d is None else jnp.moveaxis(a, d, 0)
        for a, d in zip(args, dims, strict=True)
    ]
    out = jax.vmap(lambda *f: spec.call(*f))(*moved)
    return out, [0] * len(out)


_linear.def_impl(_impl)
_linear.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[_linear] = _jvp
ad.primitive_transposes[_linear] = _transpose
batching.primitive_batchers[_linear] = _batch
mlir.register_lowering(_linear, mlir.lower_fun(_impl, multiple_results=True))


def cotangent_for(value: Any, ct: Any = None) -> Any:
    """``value``'s cotangent for ``jax.vjp`` (``value`` an array or its aval): ``ct``
    in its dtype, zeros where no cotangent was given (None), float0 for an integer
    value."""
    if not jnp.issubdtype(value.dtype, jnp.inexact):
        return np.zeros(value.shape, jax.dtypes.float0)
    return jnp.zeros(value.shape, value.dtype) if ct is None else ct.astype(value.dtype)
