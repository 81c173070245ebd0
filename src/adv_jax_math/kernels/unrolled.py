"""A per-pair jaxpr evaluated on a tile of pairs with its own small axes unrolled.

``f(xi, yj)`` sees one row of ``x`` and one of ``y`` (a few features each); the
compiled pairwise kernel evaluates it on ``bi x bj`` pairs at once. Stacking the
pairs as leading axes (``vmap(vmap(f))``) gives arrays ``(bi, bj, D)`` with a small
trailing axis (``D = 3``), which Triton refuses (every size a power of two) and
Mosaic lays out badly (``D`` on the 128 lanes). Here every per-pair array of shape
``S`` is instead a numpy object array of shape ``S`` whose elements are 2-D values:
``(bi, 1)`` for what depends on ``x`` only, ``(1, bj)`` for ``y`` only, ``(bi, bj)``
for both, scalars for constants. Each primitive of the jaxpr acts on the elements:
elementwise ones element by element (broadcast to a common shape), structural ones
(``reshape``, ``slice``, ``broadcast_in_dim``, ``transpose``, ``concatenate``,
``split``, ``unstack``) on the object array, reductions and ``dot_general`` as sums of elements.
KeOps unrolls its formulas over the feature dimension the same way.

:func:`evaluate` raises :class:`NotUnrolled` naming the first primitive it cannot
unroll; the planner then keeps another engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

from ..analysis.jaxpr_graph import ELEMENTWISE, IDENTITY, subjaxpr, walk
from ..monoids.extrema import _extreme

__all__ = ["NotUnrolled", "evaluate", "is_product", "objects", "size", "stack", "unstack"]

_REDUCE: dict[str, Callable[[Any, Any], Any]] = {
    "reduce_sum": lax.add,
    "reduce_max": lax.max,
    "reduce_min": lax.min,
    "reduce_prod": lax.mul,
    "reduce_and": lax.bitwise_and,
    "reduce_or": lax.bitwise_or,
}
MAX_ELEMENTS = 4096  # per-pair arrays larger than this are not unrolled


class NotUnrolled(Exception):
    """The jaxpr holds a primitive (or a size) :func:`evaluate` does not unroll."""


def _built(shape: Sequence[int], element: Callable[[tuple], Any]) -> np.ndarray:
    """An object array of ``shape`` whose element at ``idx`` is ``element(idx)``, in
    C order (values and tracers stored as they are, never converted)."""
    out = np.empty(tuple(shape), dtype=object)
    for idx in np.ndindex(*out.shape):
        out[idx] = element(idx)
    return out


def objects(values: Sequence[Any], shape: Sequence[int]) -> np.ndarray:
    """An object array of ``shape`` holding ``values`` (flat, in C order)."""
    it = iter(values)
    return _built(shape, lambda _: next(it))


def unstack(value: Any, shape: Sequence[int]) -> np.ndarray:
    """An object array of ``shape`` from a value whose last axes are ``shape``
    (``(..., *shape)``): its elements ``value[..., idx]``."""
    lead = (slice(None),) * (np.ndim(value) - len(shape))
    return _built(shape, lambda idx: value[lead + idx])


def stack(obj: np.ndarray, shape: Sequence[int]) -> Any:
    """The elements of ``obj`` broadcast to ``shape`` and stacked on trailing axes."""
    items = [jnp.broadcast_to(jnp.asarray(e), tuple(shape)) for e in obj.reshape(-1)]
    if obj.ndim == 0:
        return items[0]
    return jnp.stack(items, axis=-1).reshape(*shape, *obj.shape)


def _common(elems: Sequence[Any]) -> list[Any]:
    """Elements broadcast to their common shape (scalars stay scalars)."""
    shape = np.broadcast_shapes(*(np.shape(e) for e in elems))
    return [e if np.shape(e) == shape else jnp.broadcast_to(e, shape) for e in elems]


def _elementwise(eqn: Any, args: list[np.ndarray]) -> list[np.ndarray]:
    shape = np.broadcast_shapes(*(a.shape for a in args))
    args = [np.broadcast_to(a, shape) for a in args]
    bind = lambda idx: eqn.primitive.bind(*_common([a[idx] for a in args]), **eqn.params)
    return [_built(shape, bind)]


def _reduce(name: str, a: np.ndarray, axes: Sequence[int], dtype: Any) -> np.ndarray:
    """A reduction of the elements along ``axes``; over none (a zero-size axis: ``f``
    on rows of no features) its identity, as ``jnp.sum`` of an empty array gives."""
    keep = [d for d in range(a.ndim) if d not in axes]
    shape = tuple(a.shape[d] for d in keep)
    width = int(np.prod([a.shape[d] for d in axes], dtype=np.int64))
    moved = np.transpose(a, (*keep, *axes)).reshape(*shape, width)
    combine = lambda u, v: _REDUCE[name](*_common([u, v]))
    reduced = lambda idx: functools.reduce(combine, moved[idx]) if width else _identity(name, dtype)
    return _built(shape, reduced)


def _identity(name: str, dtype: Any) -> np.ndarray:
    """The identity of reduction ``name`` in ``dtype`` (a 0-d constant)."""
    dtype = np.dtype(dtype)
    if name in ("reduce_max", "reduce_min"):
        return np.asarray(_extreme(dtype, lowest=name == "reduce_max"), dtype)
    if name == "reduce_and":
        return np.asarray(True if dtype == np.bool_ else -1, dtype)
    return np.asarray(1 if name == "reduce_prod" else 0, dtype)


def _dot(eqn: Any, lhs: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if lb or rb:
        raise NotUnrolled("dot_general with batch dimensions")
    prods = np.tensordot(lhs, rhs, axes=(tuple(lc), tuple(rc)))  # object arithmetic
    dtype = eqn.params.get("preferred_element_type") or eqn.outvars[0].aval.dtype
    return _built(prods.shape, lambda idx: jnp.asarray(prods[idx]).astype(dtype))


def _structural(name: str, eqn: Any, args: list[np.ndarray], rows: int | None) -> np.ndarray | None:
    p = eqn.params
    collapsed = lambda shape: _collapsed(tuple(shape), rows)
    if name == "iota":  # constants: the indices along one axis
        return _built(p["shape"], lambda idx: np.asarray(idx[p["dimension"]], p["dtype"]))
    if not args:
        return None
    a = args[0]
    if name == "pad":
        return _pad(a, args[1][()], p["padding_config"])
    if name == "broadcast_in_dim":
        shape, dims = collapsed(p["shape"]), tuple(p["broadcast_dimensions"])
        expanded = a.reshape(
            [a.shape[dims.index(d)] if d in dims else 1 for d in range(len(shape))]
        )
        return np.broadcast_to(expanded, shape)
    if name == "reshape":
        return a.reshape(collapsed(p["new_sizes"]))
    if name == "squeeze":
        return np.squeeze(a, axis=tuple(p["dimensions"]))
    if name == "expand_dims":
        return np.expand_dims(a, tuple(p["dimensions"]))
    if name == "transpose":
        return np.transpose(a, tuple(p["permutation"]))
    if name == "slice":
        strides = p["strides"] or (1,) * a.ndim
        index = tuple(
            slice(s, e, k)
            for s, e, k in zip(p["start_indices"], p["limit_indices"], strides, strict=True)
        )
        return a[index]
    if name == "concatenate":
        return np.concatenate(args, axis=p["dimension"])
    if name == "stack":
        return np.stack(args, axis=p["axis"])
    if name == "rev":
        return np.flip(a, axis=tuple(p["dimensions"]))
    return None


def _collapsed(shape: tuple[int, ...], rows: int | None) -> tuple[int, ...]:
    """``shape`` with a leading block of ``rows`` rows as one (see :func:`evaluate`)."""
    return (1, *shape[1:]) if rows is not None and shape[:1] == (rows,) else shape


def _pad(a: np.ndarray, fill: Any, config: Sequence[tuple[int, int, int]]) -> np.ndarray:
    if any(lo < 0 or hi < 0 for lo, hi, _ in config):
        raise NotUnrolled("pad with negative padding")
    shape = [
        lo + hi + n + max(n - 1, 0) * k for (lo, hi, k), n in zip(config, a.shape, strict=True)
    ]
    out = _built(shape, lambda _: fill)
    stop = lambda lo, n, k: lo + (n - 1) * (k + 1) + 1 if n else lo
    spots = tuple(
        slice(lo, stop(lo, n, k), k + 1) for (lo, _, k), n in zip(config, a.shape, strict=True)
    )
    out[spots] = a
    return out


def size(jaxpr: Any) -> tuple[int, int]:
    """What unrolling ``jaxpr`` makes: the number of per-pair values its live equations
    produce (each one operation on a tile; dead ones XLA drops), and the widest
    contraction of its ``dot_general``s and sums of a product of two vectors
    (``jnp.sum(a * b)``; 1 without one)."""
    values, widest = 0, 1
    live = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    made = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    for eqn in reversed(jaxpr.eqns):
        if not eqn.effects and live.isdisjoint(eqn.outvars):
            continue
        live.update(v for v in eqn.invars if not isinstance(v, Literal))
        if (body := subjaxpr(eqn)) is not None:
            inner, wide = size(body.jaxpr)
            values, widest = values + inner, max(widest, wide)
            continue
        values += sum(int(np.prod(v.aval.shape, dtype=np.int64)) for v in eqn.outvars)
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            shape = eqn.invars[0].aval.shape
            widest = max(widest, int(np.prod([shape[d] for d in lc], dtype=np.int64)))
        if (summed := product_sum(eqn, made)) is not None:
            shape = summed.invars[0].aval.shape
            width = np.prod([shape[d] for d in eqn.params["axes"]], dtype=np.int64)
            widest = max(widest, int(width))
    return values, widest


def product_sum(eqn: Any, made: dict) -> Any:
    """The ``mul`` of two different vectors that ``eqn`` sums (``jnp.sum(a * b)``, a
    dot product written out; through a widening of half floats), or None (``made``:
    each variable's equation)."""
    if eqn.primitive.name != "reduce_sum" or isinstance(eqn.invars[0], Literal):
        return None
    mul = made.get(eqn.invars[0])
    if mul is not None and mul.primitive.name == "convert_element_type":
        mul = None if isinstance(mul.invars[0], Literal) else made.get(mul.invars[0])
    return mul if mul is not None and is_product(mul) else None


def is_product(eqn: Any) -> bool:
    """Whether ``eqn`` multiplies two different float vectors of one shape (the terms of
    a dot product written out)."""
    if eqn.primitive.name != "mul" or not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
        return False
    a, b = eqn.invars
    literal = isinstance(a, Literal) or isinstance(b, Literal)
    return not literal and a is not b and a.aval.shape == b.aval.shape


def _barrier(objs: Sequence[np.ndarray]) -> list:
    """Object arrays whose elements pass one ``optimization_barrier``: each value
    computed once, as written (XLA fuses a value into each of its readers, where a
    multiply may be contracted into an add of the reader's: another rounding)."""
    held = iter(lax.optimization_barrier([e for o in objs for e in o.reshape(-1)]))
    return [_built(o.shape, lambda _: next(held)) for o in objs]


def _fits(eqn: Any, rows: int | None) -> Any:
    """``subjaxpr(eqn)`` (calls are unrolled through) if ``eqn``'s outputs are small."""
    for v in eqn.outvars:
        if int(np.prod(_collapsed(v.aval.shape, rows), dtype=np.int64)) > MAX_ELEMENTS:
            raise NotUnrolled(
                f"{eqn.primitive.name} makes a per-pair array of shape {v.aval.shape}"
            )
    return subjaxpr(eqn)


def evaluate(
    jaxpr: Any,
    consts: Sequence[np.ndarray],
    args: Sequence[np.ndarray],
    barriers: bool = False,
    rows: int | None = None,
) -> list:
    """``jaxpr`` on object arrays (see the module docstring); returns object arrays.
    ``barriers``: an ``optimization_barrier`` holds its elements (plain XLA, interpret
    mode; a compiled kernel cannot lower one, and computes each value once anyway),
    else it is dropped. ``rows``: ``jaxpr`` is a row-local function traced on a block
    of ``rows`` rows (``analysis.jaxpr_graph.row_local``) whose values of shape
    ``(rows, *s)`` are object arrays of shape ``(1, *s)`` holding vectors of the
    block's rows (the fused kernel on Mosaic GPU, ``fused_reduce.mosaic_gpu``)."""

    def rule(eqn: Any, invals: list) -> list:
        name = eqn.primitive.name
        if name == "optimization_barrier" and barriers:
            return _barrier(invals)
        if name in IDENTITY:
            return invals
        if name in ELEMENTWISE or name == "add_any":  # add_any: sums of cotangents
            return _elementwise(eqn, invals)
        if name in _REDUCE:
            return [_reduce(name, invals[0], eqn.params["axes"], eqn.outvars[0].aval.dtype)]
        if name == "dot_general":
            return [_dot(eqn, *invals)]
        if name == "unstack":  # (of a cotangent's rows: softmax-weighted sums)
            a, axis = invals[0], eqn.params["axis"]
            return [np.squeeze(s, axis) for s in np.split(a, a.shape[axis], axis)]
        if name == "split":  # (a softmax-weighted sum's reverse pass)
            at = np.cumsum(eqn.params["sizes"])[:-1]
            return np.split(invals[0], at, eqn.params["axis"])
        if (out := _structural(name, eqn, invals, rows)) is not None:
            return [out]
        raise NotUnrolled(f"{name} is not unrolled over the per-pair axes")

    def literal(v: Literal) -> np.ndarray:  # in its own dtype (a bfloat16 literal stays one)
        value = np.asarray(v.val, dtype=getattr(v.aval, "dtype", None))
        return unstack(value, value.shape)

    const = lambda v, c: unstack(c, np.shape(c))
    enter = lambda eqn, ins: _fits(eqn, rows)
    return walk(jaxpr, consts, args, rule, literal=literal, const=const, enter=enter)
