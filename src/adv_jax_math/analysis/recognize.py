"""Recognize monoid reductions by what they compute (their jaxprs), not by identity.

``chunk_reduction`` is traced on one chunk of ``fun``'s output and each output
leaf is matched against ``[elementwise prologue] -> reduce -> [keepdims reshape]``;
``reduction`` is traced on two copies of the chunk result and each leaf must be
the matching binary ``add`` / ``max`` / ``min`` / ``logaddexp``. Calls (``jit``,
``custom_jvp_call``, ...) are inlined first, so ``jnp.add.reduce`` and
``jnp.logaddexp`` look like the primitives they run. Anything else is generic
(``analysis.combine_check`` rejects the generic reductions that certainly cannot combine
chunk results).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.trace import fresh_jaxpr
from ..monoids.base import Monoid, identity, is_monoid_tree
from ..monoids.catalog import ADD, LOGSUMEXP, MAX, MIN
from ..monoids.reduction import LeafReduction
from ..monoids.scaled import Scaled
from .jaxpr_graph import (
    ELEMENTWISE,
    KEEPDIMS,
    Node,
    deps,
    evaluate,
    graph,
    node_value,
    peel,
    same_structure,
    same_value,
)

__all__ = ["LeafReduction", "Recognition", "recognize"]

_REDUCES = {"reduce_sum": ADD, "reduce_max": MAX, "reduce_min": MIN}
_COMBINES = {"add": ADD, "max": MAX, "min": MIN}


class _Generic(Exception):
    """The reason a pair is not a monoid reduction (caught: the pair runs generically)."""


def _shift_root(n: Node) -> Node | None:
    """Follow the value-preserving ops of a logsumexp shift back to its ``reduce_max``."""
    while n.name != "reduce_max":
        if n.name in KEEPDIMS or n.name in ("stop_gradient", "convert_element_type", "copy"):
            n = n.args[0]
        elif n.name in ("max", "select_n"):  # max(-inf, m); select_n(is_finite(m), 0, m)
            rest = [a for a in n.args[n.name == "select_n" :] if deps(a)]
            if len(rest) != 1 or (n.name == "max" and len(n.args) != 2):
                return None
            n = rest[0]
        else:
            return None
    return n


def _match_lse(n: Node) -> tuple[Node, tuple[int, ...]] | None:
    """``(x, axes)`` if ``n`` is ``log(sum(exp(x - c), axes)) + c``, c from ``max(x, axes)``."""
    if n.name != "add" or any(a.aval.shape != n.aval.shape for a in n.args):
        return None
    for p, q in (n.args, n.args[::-1]):
        log = peel(p)
        total = peel(log.args[0], narrow=True) if log.name == "log" else log
        total = peel(total.args[0], narrow=True) if total.name == "abs" else total
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
        same = same_structure(peel(shift), peel(q), {})  # the same c on both sides
        root = _shift_root(peel(shift)) if same else None
        if root is not None and root.args[0] is x and tuple(root.params["axes"]) == axes:
            return x, axes
    return None


def _scale(n: Node) -> tuple[float | None, Node]:
    """``(c, r)`` if ``n`` is ``c * r`` or ``r / c`` for a concrete float scalar ``c``
    (a temperature applied to a reduction's result), else ``(None, n)``."""
    if n.name not in ("mul", "div") or len(n.args) != 2:
        return None, n
    for c, r in (n.args, n.args[::-1]) if n.name == "mul" else (n.args[::-1],):
        value = node_value(c)
        if value is None or value.shape != () or r.aval.shape != n.aval.shape:
            continue
        if jnp.issubdtype(value.dtype, jnp.floating) and np.isfinite(value) and value:
            return (float(value) if n.name == "mul" else 1 / float(value)), r
    return None, n


def _prologue(v: Node) -> tuple[frozenset, set]:
    """Check that ``v`` is an elementwise map of one input leaf; return the ids of the
    constants broadcast along the rows and of the row-free operands feeding it."""
    if len(deps(v)) != 1:
        raise _Generic(f"the reduced value mixes {len(deps(v))} leaves of fun's output")
    full, bcasts, free, seen, stack = v.aval.shape, set(), set(), set(), [v]
    while stack:
        n = stack.pop()
        if n.k in seen or n.name == "in":
            continue
        seen.add(n.k)
        if n.name not in ELEMENTWISE or n.aval.shape != full:
            raise _Generic(f"prologue op {n.name} is not elementwise (it may mix rows)")
        for a in n.args:
            if deps(a):
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


# Reductions a monoid object computes, written by hand: what explain() suggests.
_LOOKALIKES = {
    "argmin": "ARGMIN (its indices are global rows; a chunk's argmin is chunk-local)",
    "argmax": "ARGMAX (its indices are global rows; a chunk's argmax is chunk-local)",
    "top_k": "top_k(k) (global row indices, no row reported twice)",
}


def _describe(n: Node) -> str:
    if n.name in _LOOKALIKES:
        return f"computes {n.name}: not a monoid; use reduction=adv_jax_math.{_LOOKALIKES[n.name]}"
    stack, seen = list(n.args), set()
    while stack:
        a = stack.pop()
        if a.name in _LOOKALIKES:
            return f"computes {a.name}: not a monoid; use adv_jax_math.{_LOOKALIKES[a.name]}"
        if a.name in _REDUCES:
            mean = (
                " (a mean? use reduction=adv_jax_math.MEAN: averaging chunk means weights "
                "chunks unequally)"
                if (n.name, a.name) == ("div", "reduce_sum")
                else ""
            )
            return f"computes {n.name} after {a.name}{mean}: not a monoid"
        if a.k not in seen:
            seen.add(a.k)
            stack.extend(a.args)
    return "returns its input unreduced" if n.name == "in" else f"ends in {n.name}, no reduction"


def _analyze_chunk(chunk_reduction: Callable, out_shape: Any) -> tuple:
    """Trace ``chunk_reduction``: (leaves, out_tree, descriptions, prologues)."""
    leaves, tree = jax.tree.flatten(out_shape)
    if not leaves or any(len(s.shape) == 0 for s in leaves):
        raise _Generic("an output leaf of fun has no mapped (leading) axis")
    rows = max(int(leaves[0].shape[0]), 2)  # 1 row can't tell the row axis from keepdims

    def trace(r: int) -> tuple:
        avals = [jax.ShapeDtypeStruct((r, *s.shape[1:]), s.dtype) for s in leaves]
        try:
            return fresh_jaxpr(chunk_reduction, jax.tree.unflatten(tree, avals), return_shape=True)
        except Exception as e:
            raise _Generic(f"tracing chunk_reduction failed: {type(e).__name__}: {e}") from e

    closed, shape = trace(rows)
    _, outs, nodes = graph(closed)
    result, descr, prologues, sources, free = [], [], [], [], set()
    monoid: Monoid
    for j, out in enumerate(outs):
        n = peel(out, narrow=True)
        scale, inner = _scale(n)
        lse = _match_lse(peel(inner, narrow=True)) if scale is not None else _match_lse(n)
        if lse is not None:
            (v, axes), monoid, what = lse, LOGSUMEXP, "logsumexp"
            if scale is not None:  # a temperature: eps * logsumexp(s / eps)
                monoid, what = Scaled(LOGSUMEXP, scale), f"{scale:g} * logsumexp"
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
        (source,) = deps(v)
        sources.append(source)
        out_j = jax.ShapeDtypeStruct(tuple(out.aval.shape), np.dtype(out.aval.dtype))
        result.append(LeafReduction((j,), monoid, axis, out_j, v.name != "in"))
        pro = " of an elementwise prologue" if v.name != "in" else ""
        descr.append(f"{what}{pro} over {'axis 0' if axis == 0 else 'all axes'}")
    if free:  # the prologue's constants must not depend on the number of rows
        _, _, nodes2 = graph(trace(rows + 1)[0])
        ok = len(nodes2) == len(nodes) and all(
            (a.name, a.idx) == (b.name, b.idx) and same_value(a, b)
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
    return tuple(result), jax.tree.structure(shape), descr, tuple(prologues), tuple(sources)


@functools.lru_cache(maxsize=64)
def _canonical_logaddexp(
    shape: tuple, dtype: np.dtype, scale: float | None = None
) -> tuple[Node, Node, Node]:
    """The graph of ``jnp.logaddexp`` on two inputs (with a ``scale``, a temperature:
    ``scale * logaddexp(a / scale, b / scale)``)."""
    s = jax.ShapeDtypeStruct(shape, dtype)
    fn: Callable[[Any, Any], Any] = jnp.logaddexp
    if scale is not None:
        fn = lambda a, b: scale * jnp.logaddexp(a / scale, b / scale)
    (a, b), (out,), _ = graph(jax.make_jaxpr(fn)(s, s))
    return a, b, out if scale is None else peel(out)


def _combine_monoid(out: Node, a: Node, b: Node, want: Monoid) -> tuple[Monoid | None, str]:
    """The monoid of ``out = combine(a, b)`` (``want``: the chunk's), and what it computes."""
    n = peel(out)
    if (out.aval.shape, out.aval.dtype) != (a.aval.shape, a.aval.dtype):
        return None, f"{n.name} to {out.aval.shape} {out.aval.dtype}"
    scale = want.scale if isinstance(want, Scaled) else None  # c * logaddexp(a / c, b / c)
    if scale is None and n.name in _COMBINES and len(n.args) == 2:
        x, y = (peel(arg) for arg in n.args)
        if (x is a and y is b) or (x is b and y is a):
            return _COMBINES[n.name], n.name
        return None, f"{n.name} of other values"
    ca, cb, cout = _canonical_logaddexp(tuple(a.aval.shape), np.dtype(a.aval.dtype), scale)
    for p, q in ((a, b), (b, a)):
        if same_structure(cout, n, {ca.k: p, cb.k: q}):
            if scale is None:
                return LOGSUMEXP, "logaddexp"
            return want, f"{scale:g} * logaddexp(a / {scale:g}, b / {scale:g})"
    return None, n.name


def _analyze_reduction(reduction: Callable, leaves: tuple, tree: Any) -> list[str]:
    """Check that ``reduction`` combines each leaf with that leaf's monoid."""
    avals = jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves])
    try:
        closed, shape = fresh_jaxpr(reduction, avals, avals, return_shape=True)
    except Exception as e:
        raise _Generic(f"tracing reduction failed: {type(e).__name__}: {e}") from e
    if jax.tree.structure(shape) != tree:
        raise _Generic(f"reduction returns {jax.tree.structure(shape)}, not {tree}")
    ins, outs, _ = graph(closed)
    names = []
    for j, (leaf, out) in enumerate(zip(leaves, outs, strict=True)):
        monoid, name = _combine_monoid(out, ins[j], ins[len(leaves) + j], leaf.monoid)
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
    _prologues: tuple[tuple[Node, frozenset] | None, ...] = field(
        default=(), compare=False, repr=False
    )
    # The leaf of fun's output each term's prologue reads (None: the terms read fun's
    # output leaves themselves, a Monoid object's reduction).
    _fun_sources: tuple[int, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def fun_sources(self) -> tuple[int, ...]:
        """The leaf of ``fun``'s output each term reads (its first, for two-leaf terms)."""
        assert self.leaves is not None
        return self._fun_sources or tuple(leaf.sources[0] for leaf in self.leaves)

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
        """The arrays the terms read: each term's source leaf of ``ys`` with its
        elementwise prologue applied (or ``ys``'s leaves, for Monoid objects).

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
        if self._fun_sources is None:
            return ys
        pros = self._prologues or (None,) * len(self.leaves)
        return [
            ys[src] if pro is None else evaluate(*pro, ys[src])
            for src, pro in zip(self._fun_sources, pros, strict=True)
        ]


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


class _Term:
    """A monoid with the leaves of fun's output it reads (a leaf of the result tree)."""

    def __init__(self, monoid: Monoid, sources: tuple[int, ...]):
        self.monoid, self.sources = monoid, sources


def _monoid_terms(reduction: Any, out_shape: Any) -> Recognition:
    """A Monoid object, or a pytree of them (a prefix of fun's output structure),
    with the default chunk_reduction: each monoid reduces the rows of its subtree,
    one term per leaf (two leaves, scores and values, for SOFTMAX_WEIGHTED)."""
    leaves, tree = jax.tree.flatten(out_shape)
    if not leaves or any(len(s.shape) == 0 for s in leaves):
        return Recognition(None, None, "an output leaf of fun has no mapped axis")
    index = jax.tree.unflatten(tree, list(range(len(leaves))))

    def place(monoid: Monoid, sub: Any) -> Any:
        where = jax.tree.leaves(sub)
        if monoid.arity == 1:
            return jax.tree.map(lambda i: _Term(monoid, (i,)), sub)
        if len(where) != monoid.arity:
            raise ValueError(
                f"reduction={monoid!r} reads {monoid.arity} leaves of fun's output (e.g. "
                f"(scores, values)), but its part of the output has {len(where)}: "
                f"{jax.tree.unflatten(jax.tree.structure(sub), [leaves[i] for i in where])}"
            )
        return _Term(monoid, tuple(where))

    is_monoid = lambda m: isinstance(m, Monoid)
    try:
        placed = jax.tree.map(place, reduction, index, is_leaf=is_monoid)
    except ValueError as e:
        if "reads" in str(e):
            raise
        raise ValueError(
            f"reduction={reduction!r}: a pytree of monoids must be a prefix of the structure "
            f"of fun's output, {tree} ({e})"
        ) from None
    terms, out_tree = jax.tree.flatten(placed, is_leaf=lambda t: isinstance(t, _Term))
    result = []
    for term in terms:
        items = [
            jax.ShapeDtypeStruct(tuple(leaves[i].shape[1:]), leaves[i].dtype) for i in term.sources
        ]
        m = term.monoid
        out = jax.eval_shape(lambda m=m, items=items: m.finalize(m.init(items), items))
        result.append(LeafReduction(term.sources, term.monoid, 0, out, False))
    names = sorted({repr(t.monoid) for t in terms})
    how = f"reduction={names[0] if len(names) == 1 else reduction!r}: over axis 0 of " + (
        "every leaf" if isinstance(reduction, Monoid) else "each subtree"
    )
    return Recognition(tuple(result), out_tree, how)


def _recognize(reduction: Any, chunk_reduction: Callable, out_shape: Any) -> Recognition:
    """The monoids of ``(reduction, chunk_reduction)`` (see :func:`recognize`)."""
    tree = jax.tree.structure(out_shape)
    if is_monoid_tree(reduction) and chunk_reduction is identity:
        return _monoid_terms(reduction, out_shape)
    if is_monoid_tree(reduction) and not (
        isinstance(reduction, Monoid) and reduction.combine is not None
    ):
        raise ValueError(
            f"reduction={reduction!r} with chunk_reduction={chunk_reduction!r}: a monoid "
            "whose state is not its result (or a pytree of monoids) reduces the rows "
            "itself; use the default chunk_reduction"
        )
    if chunk_reduction is identity:
        return Recognition(None, None, "chunk_reduction is the identity: no reduction")
    try:
        rec, tree, descr, prologues, sources = _analyze_chunk(chunk_reduction, out_shape)
    except Exception as e:  # _Generic, or anything unexpected: run generically
        if not jax.tree_util.treedef_is_leaf(tree) and isinstance(e.__cause__ or e, TypeError):
            # jnp.sum(dict) raises: a known reduction applied to each leaf of a pytree
            # output (our documented extension; the call as written could not run).
            each = lambda t: jax.tree.map(chunk_reduction, t)
            pair = reduction if isinstance(reduction, Monoid) else _leafwise(reduction)
            rec_each = _recognize(pair, each, out_shape)
            if rec_each.leaves is not None:
                how = rec_each.how + " (chunk_reduction applied to each leaf)"
                return dataclasses.replace(rec_each, how=how)
        return _generic(e)
    try:
        names = (
            [reduction.name] * len(rec)
            if isinstance(reduction, Monoid)
            else (_analyze_reduction(reduction, rec, tree))
        )
    except Exception as e:
        return _generic(e)
    for leaf in rec if isinstance(reduction, Monoid) else ():
        if leaf.monoid is not reduction:
            raise ValueError(
                f"reduction={reduction!r} does not match chunk_reduction={chunk_reduction!r}, "
                f"which is a {leaf.monoid.name} reduction; pass matching functions"
            )
    parts = [f"{d} + {c}" for d, c in zip(descr, names, strict=True)]
    how = parts[0] if len(parts) == 1 else "; ".join(f"leaf {j}: {p}" for j, p in enumerate(parts))
    return Recognition(rec, tree, "traced: " + how, prologues, sources)


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
    return _recognize(reduction, chunk_reduction, out_shape)
