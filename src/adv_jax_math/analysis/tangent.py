"""The result of a monoid reduction, and its derivative as a sum over rows.

:func:`reduce` finalizes the states of every part of a call (a device's share and
a global remainder are parts) into the result. Where differentiating the forward
pass itself would not give the plain-JAX derivative (a reduction that selects
rows: ties must share it evenly, as ``jax.grad(jnp.max)``), or cannot (a Pallas
kernel has no transpose), the result is a :func:`jax.custom_jvp` whose tangent is
``Monoid.tangent`` summed over the rows, chunk by chunk with ``jax.jvp(fun)``.
Forward mode uses it as is; reverse mode transposes it, recomputing every chunk,
so gradient memory is O(rows per chunk).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ..core.linear import linear_call
from ..monoids.reduction import MonoidReduction

__all__ = ["SUPPORTED", "UNSUPPORTED", "Reverse", "nonzero", "reduce"]

SUPPORTED = jax.__version_info__ >= (0, 10, 0)
"""Whether this jax can differentiate a ``custom_jvp`` whose tangent runs a scan."""
UNSUPPORTED = (
    f"jax {jax.__version__} fails to differentiate a custom_jvp whose tangent is a scan "
    "(fixed in jax 0.10.0)"
)

Part = tuple[Any, Any, int]  # (plan, inputs, global index of its first row)


def nonzero(t: Any) -> bool:
    """A tangent that is neither a symbolic zero nor float0."""
    return not isinstance(t, SymbolicZero) and getattr(t, "dtype", None) != jax.dtypes.float0


def _leaves(tree: Any) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda t: isinstance(t, SymbolicZero))


def _float_tangent(t: Any, s: jax.ShapeDtypeStruct) -> Any:
    """A float leaf's tangent in its result's shape and dtype; None for integers."""
    if not jax.numpy.issubdtype(s.dtype, jax.numpy.inexact):
        return None
    if t is None or getattr(t, "dtype", None) == jax.dtypes.float0:
        return jax.numpy.zeros(s.shape, s.dtype)
    return jax.numpy.asarray(t).astype(s.dtype).reshape(s.shape)


def _int_tangent(t: Any, s: jax.ShapeDtypeStruct) -> Any:
    """float0 for an integer leaf's tangent (no float value crosses the linear map)."""
    return np.zeros(s.shape, jax.dtypes.float0) if t is None else t


def reduce(
    reduction: MonoidReduction,
    parts: Sequence[Part],
    states_of: Callable[[Any, Any, int], list],
    shares_of: Callable[..., list] | None = None,
    *,
    custom: bool = False,
    differentiable_states_of: Callable[[Any, Any, int], list] | None = None,
    transpose_of: Callable[..., Any] | None = None,
) -> Any:
    """``reduction``'s result over the rows of ``parts``.

    ``states_of(plan, xs, offset)`` gives each term's state over a part;
    ``shares_of(plan, dconsts, xs, dxs, final, offset)`` each term's share of the
    tangent (``engines.scan.tangent_shares``). The result is a ``custom_jvp`` with those
    shares when a term selects rows or ``custom`` is set (the fused kernel); the
    constants of the parts' traces are its explicit arguments, so the tangents of
    values ``fun`` closes over are kept. When ``states_of`` cannot be differentiated
    (a kernel), ``differentiable_states_of`` (the scan engine's) gives the states'
    own tangents, needed from the second order on (the rule's states are
    differentiated by the outer transformation). ``transpose_of(reverse)``, when
    given, computes the reverse pass (a :class:`Reverse`: the fused backward
    kernels, or ``reverse.reference()``): the tangent then is one linear primitive
    (``core.linear``) that reverse mode transposes with it, while forward mode
    evaluates it chunk by chunk. Differentiated again, the reverse pass has the
    derivative of ``reverse.reference()``.
    """
    first = parts[0][0]
    items = [
        leaf.items(reduction.reads(jax.tree.leaves(first.traced.out_shape), leaf))
        for leaf in reduction.leaves
    ]
    consts = list({id(c): c for p, _, _ in parts for c in p.consts()}.values())

    def rebound(values: list) -> list:
        mapping = {id(c): v for c, v in zip(consts, values, strict=True)}
        return [p.with_consts(mapping) for p, _, _ in parts]

    def forward(plans: list, xss: list, states_of: Callable = states_of) -> list:
        """Each term's state over all parts, merged in the order of the rows."""
        out = None
        for plan, xs, (_, _, offset) in zip(plans, xss, parts, strict=True):
            out = reduction.merge_states(out, states_of(plan, xs, offset))
        assert out is not None
        return out

    def finish(states: list) -> Any:
        return reduction.finish(
            [
                leaf.result(s, it)
                for leaf, s, it in zip(reduction.leaves, states, items, strict=True)
            ]
        )

    xss = [xs for _, xs, _ in parts]
    if not SUPPORTED or not (custom or reduction.selects):
        return finish(forward([p for p, _, _ in parts], xss))
    assert shares_of is not None

    def all_states(values: list, xss: list) -> list:
        return forward(rebound(values), xss)

    if differentiable_states_of is not None:
        opaque = all_states
        all_states = jax.custom_jvp(lambda values, xss: opaque(values, xss))

        def states_rule(primals: tuple, tangents: tuple) -> tuple:
            again = lambda v, x: forward(rebound(v), x, differentiable_states_of)
            return jax.jvp(again, primals, tangents)

        all_states.defjvp(states_rule)

    @jax.custom_jvp
    def run(values: list, xss: list) -> Any:
        return finish(all_states(values, xss))

    def rule(primals: tuple, tangents: tuple) -> tuple:
        (values, xss), (dvalues, dxss) = primals, tangents
        states = all_states(values, xss)
        c_pos = [i for i, t in enumerate(dvalues) if nonzero(t)]
        x_pos = [[j for j, t in enumerate(_leaves(dxs)) if nonzero(t)] for dxs in dxss]
        lin = (
            [dvalues[i] for i in c_pos],
            [[_leaves(d)[j] for j in pos] for d, pos in zip(dxss, x_pos, strict=True)],
        )

        def tangent(lin: tuple, res: tuple) -> list:
            """Each term's tangent (its float leaves; None for integer ones), linear in
            ``lin`` (the nonzero tangents of the constants and inputs)."""
            (dvals, dxs_nz), (values, xss, states) = lin, res
            dmap = {id(values[i]): t for i, t in zip(c_pos, dvals, strict=True)}
            plans = rebound(values)
            raw: list = [None] * len(reduction.leaves)
            for plan, xs, pos, d, (_, _, offset) in zip(
                plans, xss, x_pos, dxs_nz, parts, strict=True
            ):
                dxs = [SymbolicZero(jax.typeof(x)) for x in jax.tree.leaves(xs)]
                for j, t in zip(pos, d, strict=True):
                    dxs[j] = t
                share = shares_of(
                    plan, dmap, xs, jax.tree.unflatten(jax.tree.structure(xs), dxs), states, offset
                )
                raw = [
                    s if r is None else r if s is None else leaf.monoid.tangent_merge(r, s)
                    for leaf, r, s in zip(reduction.leaves, raw, share, strict=True)
                ]
            out = []
            for leaf, r, state, it in zip(reduction.leaves, raw, states, items, strict=True):
                d = None if r is None else leaf.monoid.tangent_finish(r, state, it)
                d = jax.tree.map(lambda s: None, leaf.out) if d is None else d
                out.append(jax.tree.map(_float_tangent, d, leaf.out, is_leaf=lambda x: x is None))
            return out

        res = (values, xss, states)
        if transpose_of is None:
            douts = tangent(lin, res)
        else:
            structs = jax.tree.map(_struct, lin)

            def reverse(cts: Any, res: tuple) -> Any:
                values, xss, states = res
                return Reverse(
                    cts, values, xss, states, c_pos, x_pos, rebound(values), structs, tangent
                )

            @jax.custom_jvp
            def transpose(cts: Any, res: tuple) -> Any:
                return transpose_of(reverse(cts, res))

            transpose.defjvp(lambda p, t: jax.jvp(lambda c, r: reverse(c, r).reference(), p, t))
            douts = linear_call(tangent, transpose, lin, res)
        douts = [
            jax.tree.map(_int_tangent, d, leaf.out, is_leaf=lambda x: x is None)
            for leaf, d in zip(reduction.leaves, douts, strict=True)
        ]
        return finish(states), reduction.finish(douts)

    run.defjvp(rule, symbolic_zeros=True)
    return run(consts, xss)


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    """``x``'s type, its sharding included: the transpose builds its cotangent so, and
    a cotangent typed apart from the tangent (rows sharded on an Explicit mesh, the
    struct replicated) fails JAX's sharding checks."""
    return jax.ShapeDtypeStruct(
        jax.numpy.shape(x), jax.numpy.result_type(x), sharding=jax.typeof(x).sharding
    )


@dataclasses.dataclass(frozen=True)
class Reverse:
    """One reverse pass of :func:`reduce`: the cotangents of its result, to those of
    the nonzero tangents (``lin``) of the parts' constants and inputs."""

    cts: list  # per term: the result's cotangents (float leaves; None for integer ones)
    values: list  # the constants of every part's traces
    xss: list  # each part's inputs
    states: list  # each term's final state
    c_pos: list[int]  # the constants (indices into values) with a cotangent
    x_pos: list[list[int]]  # per part: the input leaves with a cotangent
    plans: list  # the parts' plans on ``values``
    lin: tuple  # the structure of the result: ShapeDtypeStructs like the tangents
    tangent: Callable  # tangent(lin, (values, xss, states)): the linear map transposed

    def reference(self) -> tuple:
        """The reverse pass as JAX's transpose of the chunked tangent (a loop over
        chunks; memory O(rows per chunk))."""
        res = (self.values, self.xss, self.states)
        linear = lambda lin: self.tangent(lin, res)
        return jax.linear_transpose(linear, self.lin)(self.cts)[0]
