"""What certainly cannot combine chunk results: the checks of a generic reduction.

A ``reduction`` that is not a monoid is traced on two results of
``chunk_reduction``; :func:`check_combine` rejects it when calling it fails, when
in a loop it returns another structure, shape or dtype, or when its jaxpr shows a
combination that is not associative (read as an affine form ``alpha * a + beta * b
+ gamma`` of its two arguments, or ``a / b``, ``a ** b`` ...). Whatever it cannot
decide it accepts. Recognizing monoid reductions is ``analysis.recognize``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.trace import fresh_jaxpr
from .jaxpr_graph import KEEPDIMS, Node, deps, graph, node_value, peel
from .patterns import LOOKALIKES

__all__ = ["check_combine"]

# Reductions over the rows passed as the reduction that combines two chunk results
# (calling one on two results fails): the monoid that reduces the rows instead, or the
# binary function that combines two of its results. Hand-written look-alikes of
# monoids (argmin ...) too: what explain() suggests for them.
_HINTS = {
    **LOOKALIKES,
    "sum": "ADD (or combine chunk sums with reduction=jnp.add)",
    "max": "MAX (or combine chunk maxima with reduction=jnp.maximum)",
    "min": "MIN (or combine chunk minima with reduction=jnp.minimum)",
    "logsumexp": (
        "LOGSUMEXP (or combine the logsumexps of chunks, chunk_reduction=jax.nn.logsumexp, "
        "with reduction=jnp.logaddexp)"
    ),
    "mean": "MEAN (averaging chunk means weights chunks unequally)",
}

# Binary operations that are not associative when applied to the two partial results.
_NOT_ASSOCIATIVE = {"div": "/", "pow": "**", "rem": "%", "atan2": "atan2"}
_TOL = 1e-6

Affine = tuple[float, float, float]  # (alpha, beta, gamma): alpha * a + beta * b + gamma


def _affine(a: Node, b: Node) -> Callable[[Node], Affine | None]:
    """A reader of nodes as ``alpha * a + beta * b + gamma`` with scalar coefficients (None
    when a node is not such a form: other inputs, non-linear or non-elementwise ops)."""
    memo: dict[int, Affine | None] = {}

    def form(n: Node) -> Affine | None:
        if n.k not in memo:
            memo[n.k] = _form(n)
        return memo[n.k]

    def _form(n: Node) -> Affine | None:
        if n is a or n is b:
            return (1.0, 0.0, 0.0) if n is a else (0.0, 1.0, 0.0)
        if n.name in ("lit", "const"):
            v = node_value(n)
            if v is None or not v.size or not np.isrealobj(v) or np.any(v != v.flat[0]):
                return None
            return (0.0, 0.0, float(v.flat[0]))
        if n.name in KEEPDIMS or n.name in ("copy", "copy_p", "convert_element_type"):
            same = np.prod(n.args[0].aval.shape) == np.prod(n.aval.shape)
            exact = n.name != "convert_element_type" or jnp.issubdtype(n.aval.dtype, jnp.inexact)
            return form(n.args[0]) if (same or not deps(n)) and exact else None
        args = [form(x) for x in n.args]
        known = [f for f in args if f is not None]
        if not known or len(known) != len(args):
            return None
        p, q = known[0], known[-1]
        if n.name == "neg":
            return _scaled(-1.0, p)
        if n.name in ("add", "sub") and len(known) == 2:
            sign = 1.0 if n.name == "add" else -1.0
            return (p[0] + sign * q[0], p[1] + sign * q[1], p[2] + sign * q[2])
        if n.name == "mul" and (_constant(p) or _constant(q)):
            return _scaled(p[2], q) if _constant(p) else _scaled(q[2], p)
        if n.name == "div" and _constant(q) and q[2]:
            return _scaled(1.0 / q[2], p)
        return None

    return form


def _scaled(c: float, f: Affine) -> Affine:
    return (c * f[0], c * f[1], c * f[2])


def _constant(f: Affine) -> bool:
    return f[0] == f[1] == 0.0


def _formula(alpha: float, beta: float, gamma: float) -> str:
    """``alpha * a + beta * b + gamma`` written as people write it."""
    text = ""
    for c, term in ((alpha, "a"), (beta, "b"), (gamma, "")):
        if not c:
            continue
        word = f"{abs(c):g}*{term}" if term and abs(c) != 1 else term or f"{abs(c):g}"
        text += (" - " if c < 0 else " + ") + word if text else ("-" if c < 0 else "") + word
    return text or "0"


def _non_associative(out: Node, a: Node, b: Node) -> str | None:
    """What ``out = f(a, b)`` computes, when that certainly is not associative: an
    affine ``alpha * a + beta * b + gamma`` is associative only when ``alpha`` and ``beta``
    are 0 or 1 and ``alpha * gamma == beta * gamma``; ``a / b``, ``a ** b`` ... never."""
    form = _affine(a, b)
    coeffs = form(out)
    if coeffs is not None:
        alpha, beta, gamma = coeffs
        idempotent = lambda c: abs(c * c - c) <= _TOL * max(1.0, abs(c))
        if idempotent(alpha) and idempotent(beta) and (abs(alpha - beta) <= _TOL or not gamma):
            return None
        mean = abs(alpha - 0.5) <= _TOL and abs(beta - 0.5) <= _TOL
        hint = (
            " (an average of two partial results weights chunks unequally: for a mean "
            "over rows use reduction=adv_jax_math.MEAN with the default chunk_reduction)"
        )
        return f"{_formula(alpha, beta, gamma)}{hint if mean else ''}"
    n = peel(out)
    if n.name in _NOT_ASSOCIATIVE and len(n.args) == 2:
        x, y = (form(arg) for arg in n.args)
        pair = {x, y} == {(1.0, 0.0, 0.0), (0.0, 1.0, 0.0)}
        first, second = ("a", "b") if x == (1.0, 0.0, 0.0) else ("b", "a")
        op = _NOT_ASSOCIATIVE[n.name]
        if pair:
            return f"{op}({first}, {second})" if op[0].isalpha() else f"{first} {op} {second}"
    return None


def _types(tree: Any) -> str:
    """``float32[4, 3]`` for each leaf of a pytree of shaped values."""
    text = jax.tree.map(lambda s: f"{np.dtype(s.dtype).name}{list(s.shape)}", tree)
    return str(text).replace("'", "")


def check_combine(
    reduction: Callable, chunk_reduction: Callable, out_shape: Any, loop: bool
) -> None:
    """Raise when a generic ``reduction`` certainly cannot combine chunk results.

    It is traced on two results of ``chunk_reduction`` (for ``fun``'s output
    ``out_shape``); in a ``loop`` (more than one full chunk) it must return their
    structure, shapes and dtypes (once, e.g. a chunk and the remainder, it may
    concatenate); and its jaxpr must not show a non-associative combination of the two
    (``a - b``, ``(a + b) / 2``, ``2 * a + b``, ``a / b``, ``a ** b``). Whatever it cannot
    decide it accepts. TypeError when calling it fails; ValueError for another
    structure, shape or dtype, or a combination that is not associative.
    """
    part = jax.eval_shape(chunk_reduction, out_shape)
    try:
        closed, shape = fresh_jaxpr(reduction, part, part, return_shape=True)
    except Exception as e:
        name = getattr(reduction, "__name__", "")
        use = _HINTS.get(name) if isinstance(name, str) else None
        hint = f"; for {name} over rows use reduction=adv_jax_math.{use}" if use else ""
        raise TypeError(
            f"reduction={reduction!r} cannot combine two results of chunk_reduction "
            f"({_types(part)}): calling it raised {type(e).__name__}: {_first_line(e)}. "
            "reduction must take two partial results and return one of the same shape, "
            f"e.g. jnp.add{hint}"
        ) from e
    leaves = lambda t: [(tuple(s.shape), np.dtype(s.dtype)) for s in jax.tree.leaves(t)]
    tree: Any = jax.tree.structure(part)
    if jax.tree.structure(shape) != tree or leaves(shape) != leaves(part):
        if not loop:
            return
        raise ValueError(
            f"reduction={reduction!r} returns {_types(shape)} for two partial results "
            f"{_types(part)}: a reduction must return the structure, shapes and dtypes of "
            "its inputs: it combines the running result with each chunk's in a loop. To "
            "concatenate fun's outputs, pass reduction=None (the default); to reduce, "
            "pass a chunk_reduction that reduces the rows (e.g. jnp.sum) and a matching "
            "reduction (jnp.add)"
        )
    ins, outs, _ = graph(closed)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shape)[0]]
    for j, out in enumerate(outs):
        what = _non_associative(out, ins[j], ins[len(outs) + j])
        if what is not None:
            where = f" (for the result{paths[j]})" if paths[j] else ""
            raise ValueError(
                f"reduction={reduction!r} is not associative: it computes {what} from its "
                f"arguments a and b{where}, so the result would depend on how the rows are "
                "split into chunks (batch_size, devices). Pass an associative reduction "
                "(e.g. jnp.add, jnp.maximum, or a Monoid such as adv_jax_math.MEAN), or "
                "batch_size=None to reduce in one call"
            )


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [""])[0].rstrip(".")
