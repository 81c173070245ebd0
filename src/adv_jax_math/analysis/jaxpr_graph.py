"""Jaxprs as graphs of values, for reading what a traced function computes.

:data:`INLINE` is the one list of call primitives whose bodies the package's readers
and evaluators of jaxprs enter in place of the call (the cost models and effect checks
read every jaxpr inside an equation instead: ``core.trace.sub_jaxprs``), and
:func:`walk` the one equation walker the evaluators plug their rules into (the abstract
interpretations of ``analysis.separable`` and ``analysis.pair_rows``, the kernels'
``fused_reduce.interpreter`` and ``unrolled``).
:func:`graph` flattens a closed jaxpr with it into :class:`Node` values; helpers peel
casts and reshapes, read literal values, compare two graphs by structure, evaluate an
elementwise subgraph again at another number of rows, and tell whether a function is
elementwise. Used by ``analysis.recognize`` and the scan engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

__all__ = [
    "CUSTOM_DERIVATIVES",
    "ELEMENTWISE",
    "IDENTITY",
    "INLINE",
    "KEEPDIMS",
    "Node",
    "bind",
    "deps",
    "elementwise",
    "evaluate",
    "graph",
    "node_value",
    "peel",
    "row_local",
    "same_structure",
    "same_value",
    "subjaxpr",
    "upstream",
    "walk",
]

# Call-like primitives: one body, the equation's operands in and its results out. The
# names across jax versions (``remat2`` is ``jax.checkpoint``'s primitive).
INLINE = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"}
    | {"custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint"}
)
# Those whose body is only the primal: entered for values, but a rewrite of the body
# (``analysis.pair_rows`` resizing its rows) leaves their derivative rules behind.
CUSTOM_DERIVATIVES = frozenset(name for name in INLINE if name.startswith("custom_"))
KEEPDIMS = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims"})
# primitives returning their operands' values (as far as values go)
IDENTITY = ("copy", "copy_p", "reshard", "sharding_constraint", "optimization_barrier")
# fmt: off
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt",
    "ceil", "clamp", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma",
    "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag",
    "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "pow", "real", "reduce_precision", "rem",
    "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub",
    "tan", "tanh", "xor",
})
# fmt: on


class Node:
    """A value of a flattened jaxpr: ``in`` (input ``idx``), ``lit``/``const`` (``val``),
    or output ``idx`` of a primitive applied to ``args``; ``k`` is its creation index."""

    __slots__ = ("args", "aval", "deps", "idx", "k", "params", "prim", "val")

    def __init__(self, prim, aval, args=(), params=None, idx=0, val=None):
        self.prim, self.aval, self.args, self.params = prim, aval, tuple(args), params or {}
        self.idx, self.val, self.deps, self.k = idx, val, None, -1

    @property
    def name(self) -> str:
        return self.prim if isinstance(self.prim, str) else self.prim.name


def walk(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    rule: Callable[[Any, list], Sequence[Any]],
    *,
    literal: Callable[[Literal], Any] = lambda v: v.val,
    const: Callable[[Any, Any], Any] = lambda v, c: c,
    enter: Callable[[Any, list], ClosedJaxpr | None] = lambda eqn, ins: subjaxpr(eqn),
) -> list:
    """Evaluate ``jaxpr`` on values of the caller's kind (arrays, tags, graph nodes):
    its constants ``consts`` and inputs ``args``; a literal's value is ``literal(v)``.
    Each equation's outputs are ``rule(eqn, ins)`` (``ins``: its operands' values),
    but a call (``enter(eqn, ins)``, by default :func:`subjaxpr`: the body of an
    :data:`INLINE` call) is walked in its place with the same rule, the body's
    constants' values ``const(var, value)``. Returns the values of the outputs."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: literal(v) if isinstance(v, Literal) else env[v]
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        body = enter(eqn, ins)
        if body is None:
            outs = rule(eqn, ins)
        else:
            inner = [const(v, c) for v, c in zip(body.jaxpr.constvars, body.consts, strict=True)]
            outs = walk(body.jaxpr, inner, ins, rule, literal=literal, const=const, enter=enter)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def bind(eqn: Any, args: Sequence[Any], params: dict[str, Any] | None = None) -> list:
    """``eqn``'s primitive (a call or loop too) on ``args``, with ``params`` (default:
    its own), bound in the current context: never in the one it was traced in, which
    ``jax.core.eval_jaxpr`` re-enters (its abstract mesh, outside a ``shard_map``)."""
    bound = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    subfuns, kwargs = bound if isinstance(bound, tuple) else ((), bound)  # before jax 0.11
    out = eqn.primitive.bind(*subfuns, *args, **kwargs)
    return list(out) if eqn.primitive.multiple_results else [out]


def graph(closed: ClosedJaxpr) -> tuple[list[Node], list[Node], list[Node]]:
    """Flatten ``closed``, inlining call primitives: (inputs, outputs, all nodes)."""
    nodes: list[Node] = []

    def new(node: Node) -> Node:
        node.k = len(nodes)
        nodes.append(node)
        return node

    rule = lambda eqn, ins: [
        new(Node(eqn.primitive, v.aval, ins, eqn.params, k)) for k, v in enumerate(eqn.outvars)
    ]

    inputs = [new(Node("in", v.aval, idx=i)) for i, v in enumerate(closed.jaxpr.invars)]
    const = lambda v, c: new(Node("const", v.aval, val=c))
    consts = [const(v, c) for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)]
    literal = lambda a: new(Node("lit", a.aval, val=a.val))
    return inputs, walk(closed.jaxpr, consts, inputs, rule, literal=literal, const=const), nodes


def elementwise(closed: ClosedJaxpr) -> bool:
    """Whether every operation of ``closed`` (calls inlined) is elementwise or a
    reshape or broadcast, with no effects (a callback, a print): nothing that reads
    several elements to make one, or that may not run twice."""

    def pure(jaxpr: Jaxpr) -> bool:
        return not jaxpr.effects and all(
            eqn.primitive.name in ELEMENTWISE | KEEPDIMS
            or ((sub := subjaxpr(eqn)) is not None and pure(sub.jaxpr))
            for eqn in jaxpr.eqns
        )

    return pure(closed.jaxpr)


_ROW_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min"})


def row_local(closed: ClosedJaxpr, rows: int, bounded: bool = True) -> bool:
    """Whether ``closed``, traced on ``rows`` rows (calls inlined, no effects), works row
    by row: elementwise operations, reshapes and broadcasts, sums, maxima or minima
    over other axes than the rows (``norm(r, axis=-1)``), products of the rows by a
    matrix made of constants only (``x @ w``), and anything of constants only (what
    depends on no input); ``bounded``: with no value larger per row than its largest
    input or output."""
    shape = lambda v: tuple(v.aval.shape)
    per_row = lambda v: int(np.prod(shape(v)[1:] if shape(v)[:1] == (rows,) else shape(v)))
    ends = [v for v in (*closed.jaxpr.invars, *closed.jaxpr.outvars) if not isinstance(v, Literal)]
    bound = max((per_row(v) for v in ends), default=0)

    def ok(jaxpr: Jaxpr) -> bool:
        rowed = set(jaxpr.invars)  # what depends on an input (a call's: all of its own)
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            of_rows = [not isinstance(v, Literal) and v in rowed for v in eqn.invars]
            if not any(of_rows):
                continue  # (of constants only: the same for every row)
            rowed.update(eqn.outvars)
            if (sub := subjaxpr(eqn)) is not None:
                inner = ok(sub.jaxpr)
            elif name in _ROW_REDUCE:
                inner = 0 not in eqn.params["axes"]
            elif name == "dot_general":  # rows (leading, not contracted) times constants
                (lc, _), (lb, _) = eqn.params["dimension_numbers"]
                lead = shape(eqn.invars[0])[:1] == (rows,) and 0 not in lc
                inner = of_rows == [True, False] and not lb and lead
            else:
                inner = name in ELEMENTWISE | KEEPDIMS
            if not inner or (bounded and any(per_row(v) > bound for v in eqn.outvars)):
                return False
        return not jaxpr.effects

    return ok(closed.jaxpr)


def subjaxpr(eqn: Any) -> ClosedJaxpr | None:
    if eqn.primitive.name not in INLINE:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, Jaxpr) and not sub.constvars:
            sub = ClosedJaxpr(sub, ())
        if isinstance(sub, ClosedJaxpr) and len(sub.jaxpr.invars) == len(eqn.invars):
            return sub if len(sub.jaxpr.outvars) == len(eqn.outvars) else None
    return None


def deps(n: Node) -> frozenset:
    """The indices of the inputs that ``n`` depends on."""
    if n.deps is None:
        n.deps = (
            frozenset({n.idx}) if n.name == "in" else frozenset().union(*(deps(a) for a in n.args))
        )
    return n.deps


def upstream(roots: Iterable[Node]) -> Iterator[Node]:
    """``roots`` and the nodes they are computed from, each once (depth first)."""
    stack, seen = list(roots), set()
    while stack:
        n = stack.pop()
        if n.k not in seen:
            seen.add(n.k)
            yield n
            stack.extend(n.args)


def peel(n: Node, narrow: bool = False) -> Node:
    """Strip reshapes that only insert/remove size-1 dims and dtype-preserving converts
    (with ``narrow``, also float narrowing ones: ``jnp.sum`` of bfloat16 sums in float32)."""
    while n.args:
        src, dt = n.args[0].aval, np.dtype(n.aval.dtype)
        ones = [d for d in src.shape if d != 1] == [d for d in n.aval.shape if d != 1]
        floats = jnp.issubdtype(src.dtype, jnp.floating) and jnp.issubdtype(dt, jnp.floating)
        if (n.name in KEEPDIMS and ones) or (
            n.name in ("convert_element_type", "copy", "copy_p")
            and (src.dtype == dt or (narrow and floats and dt.itemsize < src.dtype.itemsize))
        ):
            n = n.args[0]
        else:
            break
    return n


def node_value(n: Node) -> np.ndarray | None:
    try:
        return np.asarray(n.val) if n.name in ("lit", "const") else None
    except Exception:  # a traced constant
        return None


def same_value(a: Node, b: Node) -> bool:
    if a.name not in ("lit", "const"):
        return True
    x, y = node_value(a), node_value(b)
    if x is None or y is None:
        return a.val is b.val
    return (x.dtype, x.shape) == (y.dtype, y.shape) and np.array_equal(x, y, equal_nan=True)


def same_structure(c: Node, u: Node, memo: dict) -> bool:
    """Structural equality of nodes ``c`` and ``u`` (``memo`` pre-binds ``c``'s inputs)."""
    if c is u or c.k in memo:
        return c is u or memo[c.k] is u
    if c.name in ("lit", "const"):
        ok = u.name in ("lit", "const") and same_value(c, u)
    else:
        try:
            params = bool(c.params == u.params)
        except Exception:
            params = repr(c.params) == repr(u.params)
        ok = (
            (c.name, c.idx, c.aval.shape, c.aval.dtype, len(c.args))
            == (u.name, u.idx, u.aval.shape, u.aval.dtype, len(u.args))
            and c.name != "in"
            and params
            and all(same_structure(x, y, memo) for x, y in zip(c.args, u.args, strict=True))
        )
    memo[c.k] = u if ok else None
    return ok


def evaluate(root: Node, bcasts: frozenset, y: jax.Array) -> jax.Array:
    """Re-bind the prologue's primitives for the row count of ``y``."""
    memo: dict[int, Any] = {}

    def ev(n: Node) -> Any:
        if n.k not in memo:
            if n.name == "in":
                memo[n.k] = y
            elif n.name in ("lit", "const"):
                memo[n.k] = n.val if isinstance(n.val, jax.Array) else np.asarray(n.val)
            else:
                params = n.params
                if n.k in bcasts:  # a constant broadcast along the rows
                    params = {**params, "shape": (y.shape[0], *n.aval.shape[1:])}
                res = n.prim.bind(*(ev(a) for a in n.args), **params)
                memo[n.k] = res[n.idx] if n.prim.multiple_results else res
        return memo[n.k]

    return ev(root)
