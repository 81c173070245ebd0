"""The jaxpr patterns ``analysis.recognize`` matches (on ``analysis.jaxpr_graph``
graphs): per leaf, a chunk reduction's ``[elementwise prologue] -> reduce_sum / max /
min or logsumexp (times a temperature)`` and a combine's ``add / max / min / logaddexp``
of the same monoid; anything else raises :class:`NotMonoid`, saying why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.trace import fresh_jaxpr
from ..monoids.base import Monoid
from ..monoids.catalog import ADD, LOGSUMEXP, MAX, MIN
from ..monoids.reduction import LeafReduction
from ..monoids.scaled import Scaled
from .jaxpr_graph import (
    ELEMENTWISE,
    KEEPDIMS,
    Node,
    deps,
    graph,
    node_value,
    peel,
    same_structure,
    same_value,
    upstream,
)

__all__ = ["LOOKALIKES", "NotMonoid", "analyze_chunk", "analyze_reduction"]

_REDUCES = {"reduce_sum": ADD, "reduce_max": MAX, "reduce_min": MIN}
_COMBINES = {"add": ADD, "max": MAX, "min": MIN}


class NotMonoid(Exception):
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
        raise NotMonoid(f"the reduced value mixes {len(deps(v))} leaves of fun's output")
    full, bcasts, free, seen, stack = v.aval.shape, set(), set(), set(), [v]
    while stack:
        n = stack.pop()
        if n.k in seen or n.name == "in":
            continue
        seen.add(n.k)
        if n.name not in ELEMENTWISE or n.aval.shape != full:
            raise NotMonoid(f"prologue op {n.name} is not elementwise (it may mix rows)")
        for a in n.args:
            if deps(a):
                if a.aval.shape != full:
                    raise NotMonoid(f"prologue op {n.name} broadcasts a {a.aval.shape} operand")
                stack.append(a)
            elif a.aval.shape == full and a.name == "broadcast_in_dim":
                if 0 in a.params["broadcast_dimensions"]:
                    raise NotMonoid("prologue uses a constant with the row axis in its shape")
                bcasts.add(a.k)
                free.add(a.args[0].k)
            elif a.aval.ndim == 0 or (a.aval.ndim == len(full) and a.aval.shape[0] == 1):
                free.add(a.k)
            else:
                raise NotMonoid(f"prologue uses a constant of shape {a.aval.shape} (row axis)")
    return frozenset(bcasts), free


# Reductions a monoid object computes, written by hand: what explain() suggests.
LOOKALIKES = {
    "argmin": "ARGMIN (its indices are global rows; a chunk's argmin is chunk-local)",
    "argmax": "ARGMAX (its indices are global rows; a chunk's argmax is chunk-local)",
    "top_k": "top_k(k) (global row indices, no row reported twice)",
}


def _describe(n: Node) -> str:
    if n.name in LOOKALIKES:
        return f"computes {n.name}: not a monoid; use reduction=adv_jax_math.{LOOKALIKES[n.name]}"
    for a in upstream(n.args):
        if a.name in LOOKALIKES:
            return f"computes {a.name}: not a monoid; use adv_jax_math.{LOOKALIKES[a.name]}"
        if a.name in _REDUCES:
            mean = (
                " (a mean? use reduction=adv_jax_math.MEAN: averaging chunk means weights "
                "chunks unequally)"
                if (n.name, a.name) == ("div", "reduce_sum")
                else ""
            )
            return f"computes {n.name} after {a.name}{mean}: not a monoid"
    return "returns its input unreduced" if n.name == "in" else f"ends in {n.name}, no reduction"


def analyze_chunk(chunk_reduction: Callable, out_shape: Any) -> tuple:
    """Trace ``chunk_reduction``: (leaves, out_tree, descriptions, prologues)."""
    leaves, tree = jax.tree.flatten(out_shape)
    if not leaves or any(len(s.shape) == 0 for s in leaves):
        raise NotMonoid("an output leaf of fun has no mapped (leading) axis")
    rows = max(int(leaves[0].shape[0]), 2)  # 1 row can't tell the row axis from keepdims

    def trace(r: int) -> tuple:
        avals = [jax.ShapeDtypeStruct((r, *s.shape[1:]), s.dtype) for s in leaves]
        try:
            return fresh_jaxpr(chunk_reduction, jax.tree.unflatten(tree, avals), return_shape=True)
        except Exception as e:
            raise NotMonoid(f"tracing chunk_reduction failed: {type(e).__name__}: {e}") from e

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
            raise NotMonoid(f"chunk_reduction output {j} {_describe(n)}")
        if sorted(axes) not in ([0], list(range(v.aval.ndim))):
            raise NotMonoid(
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
        # and everything feeding a row-free operand keeps its shape
        feed = upstream(nodes[k] for k in free)
        ok = ok and all(nodes2[n.k].aval.shape == n.aval.shape for n in feed)
        if not ok:
            raise NotMonoid(
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


def analyze_reduction(reduction: Callable, leaves: tuple, tree: Any) -> list[str]:
    """Check that ``reduction`` combines each leaf with that leaf's monoid."""
    avals = jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves])
    try:
        closed, shape = fresh_jaxpr(reduction, avals, avals, return_shape=True)
    except Exception as e:
        raise NotMonoid(f"tracing reduction failed: {type(e).__name__}: {e}") from e
    if jax.tree.structure(shape) != tree:
        raise NotMonoid(f"reduction returns {jax.tree.structure(shape)}, not {tree}")
    ins, outs, _ = graph(closed)
    names = []
    for j, (leaf, out) in enumerate(zip(leaves, outs, strict=True)):
        monoid, name = _combine_monoid(out, ins[j], ins[len(leaves) + j], leaf.monoid)
        if monoid is not leaf.monoid:
            raise NotMonoid(
                f"chunk_reduction reduces leaf {j} with {leaf.monoid.name} but reduction "
                f"combines it with {name}: not a monoid"
            )
        names.append(name)
    return names
