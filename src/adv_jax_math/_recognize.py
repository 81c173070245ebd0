"""Recognize monoid reductions by what they compute (their jaxprs), not by identity.

``chunk_reduction`` is traced on one chunk of ``fun``'s output and each output
leaf is matched against ``[elementwise prologue] -> reduce -> [keepdims reshape]``;
``reduction`` is traced on two copies of the chunk result and each leaf must be
the matching binary ``add`` / ``max`` / ``min`` / ``logaddexp``. Calls (``jit``,
``custom_jvp_call``, ...) are inlined first, so ``jnp.add.reduce`` and
``jnp.logaddexp`` look like the primitives they run. Anything else is generic.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from ._monoid import ADD, LOGSUMEXP, MAX, MIN, LeafReduction, Monoid, identity

__all__ = ["LeafReduction", "Recognition", "recognize"]

_REDUCES = {"reduce_sum": ADD, "reduce_max": MAX, "reduce_min": MIN}
_COMBINES = {"add": ADD, "max": MAX, "min": MIN}
_INLINE = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"}
    | {"custom_vjp_call_jaxpr", "remat", "checkpoint"}
)
_KEEPDIMS = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims"})
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
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 256
_LOCK = threading.Lock()


class _Generic(Exception):
    """The reason a pair is not a monoid reduction (caught: the pair runs generically)."""


class _Node:
    """A value of a flattened jaxpr: ``in`` (input ``idx``), ``lit``/``const`` (``val``),
    or output ``idx`` of a primitive applied to ``args``; ``k`` is its creation index."""

    __slots__ = ("args", "aval", "deps", "idx", "k", "params", "prim", "val")

    def __init__(self, prim, aval, args=(), params=None, idx=0, val=None):
        self.prim, self.aval, self.args, self.params = prim, aval, tuple(args), params or {}
        self.idx, self.val, self.deps, self.k = idx, val, None, -1

    @property
    def name(self) -> str:
        return self.prim if isinstance(self.prim, str) else self.prim.name


def _graph(closed: ClosedJaxpr) -> tuple[list[_Node], list[_Node], list[_Node]]:
    """Flatten ``closed``, inlining call primitives: (inputs, outputs, all nodes)."""
    nodes: list[_Node] = []

    def new(node: _Node) -> _Node:
        node.k = len(nodes)
        nodes.append(node)
        return node

    def run(jaxpr: Jaxpr, consts: Any, args: list) -> list[_Node]:
        env = {
            v: new(_Node("const", v.aval, val=c))
            for v, c in zip(jaxpr.constvars, consts, strict=True)
        }
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(a):
            return new(_Node("lit", a.aval, val=a.val)) if isinstance(a, Literal) else env[a]

        for eqn in jaxpr.eqns:
            ins, sub, eo = [read(a) for a in eqn.invars], _subjaxpr(eqn), enumerate(eqn.outvars)
            if sub is not None:
                outs = run(sub.jaxpr, sub.consts, ins)
            else:
                outs = [new(_Node(eqn.primitive, v.aval, ins, eqn.params, k)) for k, v in eo]
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    inputs = [new(_Node("in", v.aval, idx=i)) for i, v in enumerate(closed.jaxpr.invars)]
    return inputs, run(closed.jaxpr, closed.consts, inputs), nodes


def _subjaxpr(eqn: Any) -> ClosedJaxpr | None:
    if eqn.primitive.name not in _INLINE:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, Jaxpr) and not sub.constvars:
            sub = ClosedJaxpr(sub, ())
        if isinstance(sub, ClosedJaxpr) and len(sub.jaxpr.invars) == len(eqn.invars):
            return sub if len(sub.jaxpr.outvars) == len(eqn.outvars) else None
    return None


def _deps(n: _Node) -> frozenset:
    """The indices of the inputs that ``n`` depends on."""
    if n.deps is None:
        n.deps = (
            frozenset({n.idx}) if n.name == "in" else frozenset().union(*(_deps(a) for a in n.args))
        )
    return n.deps


def _peel(n: _Node, narrow: bool = False) -> _Node:
    """Strip reshapes that only insert/remove size-1 dims and dtype-preserving converts
    (with ``narrow``, also float narrowing ones: ``jnp.sum`` of bfloat16 sums in float32)."""
    while n.args:
        src, dt = n.args[0].aval, np.dtype(n.aval.dtype)
        ones = [d for d in src.shape if d != 1] == [d for d in n.aval.shape if d != 1]
        floats = jnp.issubdtype(src.dtype, jnp.floating) and jnp.issubdtype(dt, jnp.floating)
        if (n.name in _KEEPDIMS and ones) or (
            n.name in ("convert_element_type", "copy", "copy_p")
            and (src.dtype == dt or (narrow and floats and dt.itemsize < src.dtype.itemsize))
        ):
            n = n.args[0]
        else:
            break
    return n


def _value(n: _Node) -> np.ndarray | None:
    try:
        return np.asarray(n.val) if n.name in ("lit", "const") else None
    except Exception:  # a traced constant
        return None


def _shift_root(n: _Node) -> _Node | None:
    """Follow the value-preserving ops of a logsumexp shift back to its ``reduce_max``."""
    while n.name != "reduce_max":
        if n.name in _KEEPDIMS or n.name in ("stop_gradient", "convert_element_type", "copy"):
            n = n.args[0]
        elif n.name in ("max", "select_n"):  # max(-inf, m); select_n(is_finite(m), 0, m)
            rest = [a for a in n.args[n.name == "select_n" :] if _deps(a)]
            if len(rest) != 1 or (n.name == "max" and len(n.args) != 2):
                return None
            n = rest[0]
        else:
            return None
    return n


def _match_lse(n: _Node) -> tuple[_Node, tuple[int, ...]] | None:
    """``(x, axes)`` if ``n`` is ``log(sum(exp(x - c), axes)) + c``, c from ``max(x, axes)``."""
    if n.name != "add" or any(a.aval.shape != n.aval.shape for a in n.args):
        return None
    for p, q in (n.args, n.args[::-1]):
        log = _peel(p)
        total = _peel(log.args[0], narrow=True) if log.name == "log" else log
        total = _peel(total.args[0], narrow=True) if total.name == "abs" else total
        if log.name != "log" or total.name != "reduce_sum":
            continue
        exp = total.args[0]
        exp = exp.args[0] if exp.name == "convert_element_type" else exp
        if exp.name != "exp" or exp.args[0].name != "sub":
            continue
        (x, shift), axes = exp.args[0].args, tuple(total.params["axes"])
        kept = [1 if i in axes else d for i, d in enumerate(x.aval.shape)]
        if shift.aval.shape != () and list(shift.aval.shape) != kept:
            continue
        same = _same(_peel(shift), _peel(q), {})  # the same c on both sides
        root = _shift_root(_peel(shift)) if same else None
        if root is not None and root.args[0] is x and tuple(root.params["axes"]) == axes:
            return x, axes
    return None


def _prologue(v: _Node) -> tuple[frozenset, set]:
    """Check that ``v`` is an elementwise map of one input leaf; return the ids of the
    constants broadcast along the rows and of the row-free operands feeding it."""
    if len(_deps(v)) != 1:
        raise _Generic(f"the reduced value mixes {len(_deps(v))} leaves of fun's output")
    full, bcasts, free, seen, stack = v.aval.shape, set(), set(), set(), [v]
    while stack:
        n = stack.pop()
        if n.k in seen or n.name == "in":
            continue
        seen.add(n.k)
        if n.name not in ELEMENTWISE or n.aval.shape != full:
            raise _Generic(f"prologue op {n.name} is not elementwise (it may mix rows)")
        for a in n.args:
            if _deps(a):
                if a.aval.shape != full:
                    raise _Generic(f"prologue op {n.name} broadcasts a {a.aval.shape} operand")
                stack.append(a)
            elif a.aval.shape == full and a.name == "broadcast_in_dim":
                if 0 in a.params["broadcast_dimensions"]:
                    raise _Generic("prologue uses a constant with the row axis in its shape")
                bcasts.add(a.k)
                free.add(a.args[0].k)
            elif a.aval.ndim == 0 or (a.aval.ndim == len(full) and a.aval.shape[0] == 1):
                free.add(a.k)
            else:
                raise _Generic(f"prologue uses a constant of shape {a.aval.shape} (row axis)")
    return frozenset(bcasts), free


def _describe(n: _Node) -> str:
    stack, seen = list(n.args), set()
    while stack:
        a = stack.pop()
        if a.name in _REDUCES:
            mean = " (a mean?)" if (n.name, a.name) == ("div", "reduce_sum") else ""
            return f"computes {n.name} after {a.name}{mean}: not a monoid"
        if a.k not in seen:
            seen.add(a.k)
            stack.extend(a.args)
    return "returns its input unreduced" if n.name == "in" else f"ends in {n.name}, no reduction"


def _analyze_chunk(chunk_reduction: Callable, out_shape: Any) -> tuple:
    """Trace ``chunk_reduction``: (leaves, out_tree, descriptions, prologues, has_tracers)."""
    leaves, tree = jax.tree.flatten(out_shape)
    if not leaves or any(len(s.shape) == 0 for s in leaves):
        raise _Generic("an output leaf of fun has no mapped (leading) axis")
    rows = max(int(leaves[0].shape[0]), 2)  # 1 row can't tell the row axis from keepdims

    def trace(r: int) -> tuple:
        avals = [jax.ShapeDtypeStruct((r, *s.shape[1:]), s.dtype) for s in leaves]
        try:
            return jax.make_jaxpr(chunk_reduction, return_shape=True)(
                jax.tree.unflatten(tree, avals)
            )
        except Exception as e:
            raise _Generic(f"tracing chunk_reduction failed: {type(e).__name__}: {e}") from e

    closed, shape = trace(rows)
    _, outs, nodes = _graph(closed)
    result, descr, prologues, free = [], [], [], set()
    for j, out in enumerate(outs):
        n = _peel(out, narrow=True)
        lse = _match_lse(n)
        if lse is not None:
            (v, axes), monoid, what = lse, LOGSUMEXP, "logsumexp"
        elif n.name in _REDUCES:
            v, axes, monoid, what = n.args[0], tuple(n.params["axes"]), _REDUCES[n.name], n.name
        else:
            raise _Generic(f"chunk_reduction output {j} {_describe(n)}")
        if sorted(axes) not in ([0], list(range(v.aval.ndim))):
            raise _Generic(
                f"chunk_reduction output {j} reduces axes {axes} of a {v.aval.ndim}-d leaf; "
                "only axis 0 or all axes chunk as a monoid"
            )
        axis = 0 if sorted(axes) == [0] else None
        bcasts, leaf_free = _prologue(v)
        free |= leaf_free
        prologues.append((v, bcasts) if v.name != "in" else None)
        (source,) = _deps(v)
        shape_j, dtype_j = tuple(out.aval.shape), np.dtype(out.aval.dtype)
        result.append(LeafReduction(source, monoid, axis, shape_j, dtype_j, v.name != "in"))
        pro = " of an elementwise prologue" if v.name != "in" else ""
        descr.append(f"{what}{pro} over {'axis 0' if axis == 0 else 'all axes'}")
    if free:  # the prologue's constants must not depend on the number of rows
        _, _, nodes2 = _graph(trace(rows + 1)[0])
        ok = len(nodes2) == len(nodes) and all(
            (a.name, a.idx) == (b.name, b.idx) and _same_val(a, b)
            for a, b in zip(nodes, nodes2, strict=True)
        )
        stack, seen = [nodes[k] for k in free], set()
        while ok and stack:  # and everything feeding a row-free operand keeps its shape
            n = stack.pop()
            if n.k not in seen:
                seen.add(n.k)
                ok = nodes2[n.k].aval.shape == n.aval.shape
                stack.extend(n.args)
        if not ok:
            raise _Generic(
                "chunk_reduction's prologue changes with the number of rows (or between traces)"
            )
    tracers = any(isinstance(n.val, jax.core.Tracer) for n in nodes)
    return tuple(result), jax.tree.structure(shape), descr, tuple(prologues), tracers


def _same_val(a: _Node, b: _Node) -> bool:
    if a.name not in ("lit", "const"):
        return True
    x, y = _value(a), _value(b)
    if x is None or y is None:
        return a.val is b.val
    return (x.dtype, x.shape) == (y.dtype, y.shape) and np.array_equal(x, y, equal_nan=True)


def _same(c: _Node, u: _Node, memo: dict) -> bool:
    """Structural equality of nodes ``c`` and ``u`` (``memo`` pre-binds ``c``'s inputs)."""
    if c is u or c.k in memo:
        return c is u or memo[c.k] is u
    if c.name in ("lit", "const"):
        ok = u.name in ("lit", "const") and _same_val(c, u)
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
            and all(_same(x, y, memo) for x, y in zip(c.args, u.args, strict=True))
        )
    memo[c.k] = u if ok else None
    return ok


@functools.lru_cache(maxsize=64)
def _canonical_logaddexp(shape: tuple, dtype: np.dtype) -> tuple[_Node, _Node, _Node]:
    s = jax.ShapeDtypeStruct(shape, dtype)
    (a, b), (out,), _ = _graph(jax.make_jaxpr(jnp.logaddexp)(s, s))
    return a, b, out


def _combine_monoid(out: _Node, a: _Node, b: _Node) -> tuple[Monoid | None, str]:
    """The monoid of ``out = combine(a, b)``, and what it computes."""
    n = _peel(out)
    if (out.aval.shape, out.aval.dtype) != (a.aval.shape, a.aval.dtype):
        return None, f"{n.name} to {out.aval.shape} {out.aval.dtype}"
    if n.name in _COMBINES and len(n.args) == 2:
        x, y = (_peel(arg) for arg in n.args)
        if (x is a and y is b) or (x is b and y is a):
            return _COMBINES[n.name], n.name
        return None, f"{n.name} of other values"
    ca, cb, cout = _canonical_logaddexp(tuple(a.aval.shape), np.dtype(a.aval.dtype))
    for p, q in ((a, b), (b, a)):
        if _same(cout, n, {ca.k: p, cb.k: q}):
            return LOGSUMEXP, "logaddexp"
    return None, n.name


def _analyze_reduction(reduction: Callable, leaves: tuple, tree: Any) -> list[str]:
    """Check that ``reduction`` combines each leaf with that leaf's monoid."""
    avals = jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves])
    try:
        closed, shape = jax.make_jaxpr(reduction, return_shape=True)(avals, avals)
    except Exception as e:
        raise _Generic(f"tracing reduction failed: {type(e).__name__}: {e}") from e
    if jax.tree.structure(shape) != tree:
        raise _Generic(f"reduction returns {jax.tree.structure(shape)}, not {tree}")
    ins, outs, _ = _graph(closed)
    names = []
    for j, (leaf, out) in enumerate(zip(leaves, outs, strict=True)):
        monoid, name = _combine_monoid(out, ins[j], ins[len(leaves) + j])
        if monoid is not leaf.monoid:
            raise _Generic(
                f"chunk_reduction reduces leaf {j} with {leaf.monoid.name} but reduction "
                f"combines it with {name}: not a monoid"
            )
        names.append(name)
    return names


@dataclass(frozen=True)
class Recognition:
    """The monoid per result leaf behind ``(reduction, chunk_reduction)``, or why not.

    ``leaves`` is None when the pair is not recognized (it runs generically);
    ``out_tree`` is the treedef of ``chunk_reduction``'s output; ``how`` one line.
    """

    leaves: tuple[LeafReduction, ...] | None
    out_tree: Any
    how: str
    _prologues: tuple[tuple[_Node, frozenset] | None, ...] = field(
        default=(), compare=False, repr=False
    )

    @property
    def prologue_captures_arrays(self) -> bool:
        """Whether a prologue closes over array constants (a Pallas kernel cannot
        capture them: pass them as kernel inputs or use another engine)."""
        stack, seen = [p[0] for p in self._prologues if p is not None], set()
        while stack:
            n = stack.pop()
            if n.name == "const":
                return True
            if n.k not in seen:
                seen.add(n.k)
                stack.extend(n.args)
        return False

    def prologue(self, ys: Any) -> list[jax.Array]:
        """Each result leaf's source leaf of ``ys`` with its elementwise prologue applied.

        Parameters
        ----------
        ys : pytree
            ``fun``'s output for a chunk of any number (>= 1) of rows; may be traced.

        Returns
        -------
        list of jax.Array
            One array per result leaf, ready for ``leaf.monoid.reduce(v, axis=leaf.axis)``.
        """
        if self.leaves is None:
            raise ValueError(f"not a recognized monoid reduction: {self.how}")
        ys = jax.tree.leaves(ys)
        pros = self._prologues or (None,) * len(self.leaves)
        return [
            ys[leaf.source] if pro is None else _evaluate(*pro, ys[leaf.source])
            for leaf, pro in zip(self.leaves, pros, strict=True)
        ]


def _evaluate(root: _Node, bcasts: frozenset, y: jax.Array) -> jax.Array:
    """Re-bind the prologue's primitives for the row count of ``y``."""
    memo: dict[int, Any] = {}

    def ev(n: _Node) -> Any:
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


def _generic(e: Exception) -> Recognition:
    why = str(e) if isinstance(e, _Generic) else f"not recognized ({type(e).__name__}: {e})"
    return Recognition(None, None, why.splitlines()[0][:300])


def _leafwise(reduction: Callable) -> Callable:
    def each(a: Any, b: Any) -> Any:
        try:
            return reduction(a, b)
        except TypeError:
            return jax.tree.map(reduction, a, b)

    return each


def _recognize(reduction: Any, chunk_reduction: Callable, out_shape: Any) -> tuple:
    """(Recognition, whether it holds tracers and must not be cached)."""
    leaves, tree = jax.tree.flatten(out_shape)
    if isinstance(reduction, Monoid) and chunk_reduction is identity:
        if not leaves or any(len(s.shape) == 0 for s in leaves):
            return Recognition(None, None, "an output leaf of fun has no mapped axis"), False
        result = []
        for i, s in enumerate(leaves):
            dtype = np.dtype(s.dtype)
            if reduction is LOGSUMEXP and not jnp.issubdtype(dtype, jnp.inexact):
                dtype = np.dtype(jnp.result_type(dtype, 1.0))
            result.append(LeafReduction(i, reduction, 0, tuple(s.shape[1:]), dtype, False))
        how = f"reduction={reduction!r}: {reduction.name} over axis 0 of every leaf"
        return Recognition(tuple(result), tree, how), False
    if chunk_reduction is identity:
        return Recognition(None, None, "chunk_reduction is the identity: no reduction"), False
    try:
        rec, tree, descr, prologues, tracers = _analyze_chunk(chunk_reduction, out_shape)
    except Exception as e:  # _Generic, or anything unexpected: run generically
        if not jax.tree_util.treedef_is_leaf(tree) and isinstance(e.__cause__ or e, TypeError):
            # jnp.sum(dict) raises: a known reduction applied to each leaf of a pytree
            # output (our documented extension; the call as written could not run).
            each = lambda t: jax.tree.map(chunk_reduction, t)
            pair = reduction if isinstance(reduction, Monoid) else _leafwise(reduction)
            rec_each, tracers = _recognize(pair, each, out_shape)
            if rec_each.leaves is not None:
                how = rec_each.how + " (chunk_reduction applied to each leaf)"
                return dataclasses.replace(rec_each, how=how), tracers
        return _generic(e), False
    try:
        names = (
            [reduction.name] * len(rec)
            if isinstance(reduction, Monoid)
            else (_analyze_reduction(reduction, rec, tree))
        )
    except Exception as e:
        return _generic(e), False
    for leaf in rec if isinstance(reduction, Monoid) else ():
        if leaf.monoid is not reduction:
            raise ValueError(
                f"reduction={reduction!r} does not match chunk_reduction={chunk_reduction!r}, "
                f"which is a {leaf.monoid.name} reduction; pass matching functions"
            )
    parts = [f"{d} + {c}" for d, c in zip(descr, names, strict=True)]
    how = parts[0] if len(parts) == 1 else "; ".join(f"leaf {j}: {p}" for j, p in enumerate(parts))
    return Recognition(rec, tree, "traced: " + how, prologues), tracers


def recognize(reduction: Callable | None, chunk_reduction: Callable, out_shape: Any) -> Recognition:
    """Recognize the monoid reduction that ``(reduction, chunk_reduction)`` computes.

    Parameters
    ----------
    reduction : callable or Monoid or None
        Combines two chunk results (None: a map, not a reduction).
    chunk_reduction : callable
        Reduces one chunk of ``fun``'s output (rows first).
    out_shape : pytree of jax.ShapeDtypeStruct
        ``fun``'s output for one chunk (leading axis = rows).

    Returns
    -------
    Recognition
        ``leaves`` is None when not recognized; ``how`` says how, or why not.

    Raises
    ------
    ValueError
        If ``reduction`` is a :class:`Monoid` and ``chunk_reduction`` another monoid.
    """
    if reduction is None:
        return Recognition(None, None, "no reduction")
    leaves, tree = jax.tree.flatten(out_shape)
    key: Any = (reduction, chunk_reduction, tree, *((tuple(s.shape), s.dtype) for s in leaves))
    try:
        hash(key)
    except TypeError:  # an unhashable callable: not cached
        key = None
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    rec, tracers = _recognize(reduction, chunk_reduction, out_shape)
    if key is not None and not tracers:
        with _LOCK:
            _CACHE[key] = rec
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return rec
