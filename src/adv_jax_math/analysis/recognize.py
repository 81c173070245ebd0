"""Recognize monoid reductions by what they compute (their jaxprs), not by identity.

``chunk_reduction`` is traced on one chunk of ``fun``'s output and each output
leaf is matched against ``[elementwise prologue] -> reduce -> [keepdims reshape]``;
``reduction`` is traced on two copies of the chunk result and each leaf must be
the matching binary ``add`` / ``max`` / ``min`` / ``logaddexp``. Calls (``jit``,
``custom_jvp_call``, ...) are inlined first, so ``jnp.add.reduce`` and
``jnp.logaddexp`` look like the primitives they run (the patterns: ``analysis.patterns``).
Anything else is generic (``analysis.combine_check`` rejects the generic reductions
that certainly cannot combine chunk results). A :class:`Monoid` object (or a pytree
of them) with the default ``chunk_reduction`` is taken as it is, one term per leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from ..monoids.base import Monoid, identity, is_monoid_tree
from ..monoids.reduction import LeafReduction
from .jaxpr_graph import Node, evaluate, upstream
from .patterns import NotMonoid, analyze_chunk, analyze_reduction

__all__ = ["LeafReduction", "Recognition", "recognize"]


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
        heads = (p[0] for p in self._prologues if p is not None)
        return any(n.name == "const" for n in upstream(heads))

    def prologue(self, ys: Any) -> list[jax.Array]:
        """The arrays the terms read: each term's source leaf of ``ys`` with its
        elementwise prologue applied (or ``ys``'s leaves, for Monoid objects): one
        array per result leaf, ready for ``leaf.monoid.reduce(v, axis=leaf.axis)``.
        ``ys`` is ``fun``'s output for a chunk of any number (>= 1) of rows, maybe traced.
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
    why = str(e) if isinstance(e, NotMonoid) else f"not recognized ({type(e).__name__}: {e})"
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


def recognize(reduction: Any, chunk_reduction: Callable, out_shape: Any) -> Recognition:
    """The monoid reduction that ``(reduction, chunk_reduction)`` computes, for ``fun``'s
    output ``out_shape`` on one chunk (rows first): ``reduction`` combines two chunk
    results (a callable, a Monoid, a pytree of them; None: a map, no reduction) and
    ``chunk_reduction`` reduces one chunk. The :class:`Recognition`'s ``leaves`` are
    None when it is not recognized, its ``how`` says how, or why not. Raises
    ValueError if ``reduction`` is a :class:`Monoid` and ``chunk_reduction`` another.
    """
    if reduction is None:
        return Recognition(None, None, "no reduction")
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
        rec, tree, descr, prologues, sources = analyze_chunk(chunk_reduction, out_shape)
    except Exception as e:  # NotMonoid, or anything unexpected: run generically
        if not jax.tree_util.treedef_is_leaf(tree) and isinstance(e.__cause__ or e, TypeError):
            # jnp.sum(dict) raises: a known reduction applied to each leaf of a pytree
            # output (our documented extension; the call as written could not run).
            each = lambda t: jax.tree.map(chunk_reduction, t)
            pair = reduction if isinstance(reduction, Monoid) else _leafwise(reduction)
            rec_each = recognize(pair, each, out_shape)
            if rec_each.leaves is not None:
                how = rec_each.how + " (chunk_reduction applied to each leaf)"
                return dataclasses.replace(rec_each, how=how)
        return _generic(e)
    try:
        names = (
            [reduction.name] * len(rec)
            if isinstance(reduction, Monoid)
            else (analyze_reduction(reduction, rec, tree))
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
