"""Nested calls that are pairwise reductions, found and run on the pairwise engine.

Users write ``out_i = reduce_j f(x_i, y_j)`` as nested per-example calls::

    inner = lambda xi: batch_vmap(lambda yj: f(xi, yj), batch_size=bj, reduction=M)(y)
    out = batch_vmap(inner, batch_size=bi)(x)

The outer call (a ``batch_vmap`` that stacks its results) listens while it plans:
the trace of its function it makes anyway records the ``batch_vmap`` calls made in
it. Where that is exactly one, with a :class:`Monoid` reduction, it traces its
function once more on one row (a *probe*, where the inner call only records itself)
to check that the function returns the inner call's result unchanged and closes over
the inner call's mapped inputs (they do not depend on the outer row). Then it runs
:func:`pairwise` with ``f(xi, yj)`` = the outer function on ``xi`` where the inner
call evaluates its own function on the row ``yj`` (a *pair* evaluation), and tiles
``(bi, bj)``. Anything else runs as planned; ``explain`` says why.

The per-chunk form is heard the same way::

    out = batch_map(lambda xc: batch_map(lambda yc: g(yc, xc), y, bj, reduction=M), x, bi)

where the outer ``batch_map`` stacks its results and the inner one reduces ``g``'s
blocks ``(bj, bi, ...)`` (or ``(bj, ...)``: the same for every x row, a softmax's
values) over the y rows. Blocks are not pairs, and the reading must compute what
the program as written computes: ``analysis.separable.read_blocks`` shows from ``g``'s
jaxpr that block element ``[b, a]`` depends on y row ``b`` and x row ``a`` alone
(and that ``g`` does not compute with its blocks' sizes), and ``per_x_row`` that each
monoid's result over such blocks is its result per x row stacked on axis 0, where
the outer call stacks the inner results (a top-k puts its k slots there; a
softmax-weighted sum of values with x rows weighs every x row's values). Then
``f(xi, yj)`` is ``g``'s jaxpr evaluated at one row each (:func:`pairs`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..analysis.pair_rows import evaluate, row_tags
from ..analysis.recognize import recognize
from ..analysis.separable import Blocks, _Refused, per_x_row, read_blocks
from ..core import config as _config
from ..monoids.base import identity, is_monoid_tree
from ..pairs.tiles import batch_sizes as tiles  # the tiles of a pairwise reduction read here
from ..plan.planner import split_rows

__all__ = ["Inner", "Nested", "as_inner", "find", "heard", "listen", "tiles"]

_MODE = threading.local()  # .value: None, a _Listen, a _Record or a _Pair


@dataclasses.dataclass
class _Listen:
    seen: list  # per trace of the outer function: the Inner calls made in it


@dataclasses.dataclass
class _Record:
    calls: list  # the Inner calls met while tracing the outer function
    probe: bool  # only record them (their results: zeros of their shapes)


@dataclasses.dataclass
class _Pair:
    row: list  # one row of each mapped input of the inner call


@dataclasses.dataclass
class Inner:
    """One inner ``batch_vmap`` call: its function on one example with the mapped
    leaves substituted (``with_rows(rows)``), its mapped inputs and their axes, its
    reduction and batch size, and what it returned in the probe."""

    with_rows: Callable[[list], Any]
    mapped: list  # as given
    axes: list  # their mapped axes
    reduction: Any
    batch_size: Any
    chunk_reduction_is_identity: bool
    shard: bool
    chunked: bool = False  # a batch_map call: its function on chunks of rows
    out: Any = None


@dataclasses.dataclass(frozen=True)
class Nested:
    """The pairwise form of an outer call: ``pair(x_row, y_row)``, ``y`` (the inner
    call's mapped inputs, rows first), its reduction and batch size."""

    pair: Callable[[list, list], Any]
    y: list
    reduction: Any
    batch_size: Any


@contextlib.contextmanager
def _mode(value: Any) -> Iterator[Any]:
    before = getattr(_MODE, "value", None)
    _MODE.value = value
    try:
        yield value
    finally:
        _MODE.value = before


def listen() -> contextlib.AbstractContextManager[_Listen]:
    """Record the inner calls of the outer function's traces (see :func:`heard`)."""
    return _mode(_Listen([]))


def heard(call: Callable[[], Any]) -> Any:
    """``call()`` (the outer function on its row), recording its inner calls when
    listening."""
    mode = getattr(_MODE, "value", None)
    if not isinstance(mode, _Listen):
        return call()
    with _mode(_Record([], probe=False)) as record:
        out = call()
    mode.seen.append(record.calls)
    return out


def as_inner(inner: Inner, run: Callable[[], Any]) -> Any:
    """What a ``batch_vmap`` call returns: ``run()`` (its result), recorded while an
    outer call listens; under a probe only recorded (zeros of its result's shape
    returned); in a pair evaluation its function on that row."""
    mode = getattr(_MODE, "value", None)
    if isinstance(mode, _Pair):
        with _mode(None):
            return inner.with_rows(mode.row)
    if not isinstance(mode, _Record):
        with _mode(None):
            return run()
    with _mode(None):
        if mode.probe:
            shapes = jax.eval_shape(run)
            inner.out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        else:
            inner.out = run()
    mode.calls.append(inner)
    return inner.out


def find(
    listener: _Listen,
    one: Callable[..., Any],
    rows: list,
    chunked: bool = False,
    chunk_rows: int | None = None,
) -> Nested | str:
    """The pairwise form of ``one`` (the outer function on one row, or with
    ``chunked`` on a chunk of rows: its mapped leaves as positional arguments,
    ``rows`` their avals, ``chunk_rows`` the rows of the chunks it is planned on)
    after ``listener`` heard its planning trace, or why it has none."""
    kind, other = ("batch_map", "batch_vmap") if chunked else ("batch_vmap", "batch_map")
    if not listener.seen:
        return "its function was not traced"
    heard = listener.seen[0]
    if len(heard) != 1:
        return f"its function makes {len(heard)} nested batch_vmap/batch_map calls, not one"
    if heard[0].chunked != chunked:
        return f"the inner call is a {other}: nest {kind} in {kind}"
    if not is_monoid_tree(heard[0].reduction) or not heard[0].chunk_reduction_is_identity:
        return "the inner call's reduction is not a Monoid (ajm.ADD, ajm.LOGSUMEXP, ...)"
    if heard[0].shard:
        return "the inner call shards"
    found: dict[str, Any] = {}

    def probe(*row: Any) -> list:
        with _mode(_Record([], probe=True)) as p:
            out = one(*row)
        if len(p.calls) != 1:
            found["why"] = f"traced on one row, it makes {len(p.calls)} batch_vmap calls"
            return []
        inner = found["inner"] = p.calls[0]
        mine, theirs = jax.tree.flatten(out), jax.tree.flatten(inner.out)
        same = str(mine[1]) == str(theirs[1]) and all(
            a is b for a, b in zip(mine[0], theirs[0], strict=True)
        )
        if not same:
            found["why"] = "its function does not return the inner call's result as is"
        return inner.mapped

    closed = jax.make_jaxpr(probe)(*rows)
    if "why" in found:
        return found["why"]
    inner: Inner = found["inner"]
    consts = closed.jaxpr.constvars
    if not all(v in consts for v in closed.jaxpr.outvars):
        return "the inner call's mapped inputs are computed in the outer function; close over them"

    y = [jnp.moveaxis(a, axis, 0) for a, axis in zip(inner.mapped, inner.axes, strict=True)]

    def pair(x_row: list, y_row: list) -> Any:
        with _mode(_Pair(y_row)):
            return one(*x_row)

    if chunked:
        x_rows = [chunk_rows] if chunk_rows else _block_rows(rows[0].shape[0], None)
        return _blocks(lambda yc, xc: pair(xc, yc), rows, x_rows, y, inner)
    return Nested(pair, y, inner.reduction, inner.batch_size)


def _block_rows(n: int, batch_size: Any) -> list[int]:
    """The rows of the chunks a call over ``n`` rows in chunks of ``batch_size``
    evaluates its function on, as the scan engine plans them (the first: the most
    chunks; "auto" or None: all rows)."""
    if not isinstance(batch_size, int) or n <= batch_size:
        return [n]
    rows, split = split_rows(n, batch_size, _config.current().remainder)
    return [rows, n % rows] if split == "separate" and n % rows else [rows]


def _blocks(
    g: Callable[[list, list], Any], x: list, x_rows: list[int], y: list, inner: Inner
) -> Nested | str:
    """The pairwise form of nested per-chunk calls whose inner call reduces the blocks
    ``g(yc, xc)`` over y rows (``x``: the outer call's rows, avals, in chunks of
    ``x_rows``), or why the program as written computes something else.
    ``analysis.separable`` reads the blocks as pairs, at the sizes the program evaluates them
    on, and proves each term's result laid out per x row on axis 0 (where the outer
    call stacks the inner results); ``f(xi, yj)`` is ``g``'s jaxpr evaluated at one
    row each."""
    y_rows = _block_rows(y[0].shape[0], inner.batch_size)
    at = lambda leaves, r: [jax.ShapeDtypeStruct((r, *a.shape[1:]), a.dtype) for a in leaves]
    also = [(a, b) for a in y_rows for b in x_rows]
    found = read_blocks(g, at(y, y_rows[0]), at(x, x_rows[0]), also)
    if isinstance(found, str):
        return f"the inner call's blocks are not shown to be pairs: {found}"
    shapes = jax.tree.leaves(found.shapes)
    try:
        rec = recognize(inner.reduction, identity, found.shapes)
    except ValueError as e:
        return str(e)
    for term in rec.leaves or ():
        items = [jax.ShapeDtypeStruct(shapes[s].shape[1:], shapes[s].dtype) for s in term.sources]
        x_axes = [None if found.x_axes[s] is None else 0 for s in term.sources]
        why = per_x_row(term.monoid, items, x_axes)
        if why:
            return f"as written, the outer call stacks the inner results: {why}"
    return Nested(pairs(found, g), y, inner.reduction, inner.batch_size)


def pairs(found: Blocks, g: Callable[[Any, Any], Any]) -> Callable[[list, list], Any]:
    """``f(x_row, y_row)`` (lists of leaves) of the blocks ``g(yc, xc)`` that
    ``found`` reads as pairs: ``g``'s jaxpr evaluated at one row each (its pair's
    element of each output leaf), or, where a custom derivative rule on the rows
    cannot be evaluated at other sizes, ``g`` traced again at one row each (which
    ``read_blocks`` compared with the blocks)."""
    jaxpr, consts = found.closed.jaxpr, list(found.closed.consts)
    tags = [row_tags(v, "j" if k < found.n_y else "i") for k, v in enumerate(jaxpr.invars)]
    tree = jax.tree.structure(found.shapes)
    at = lambda o, p: o[0] if p is None else lax.index_in_dim(o[0], 0, p - 1, keepdims=False)
    take = lambda outs: jax.tree.unflatten(
        tree, [at(o, p) for o, p in zip(jax.tree.leaves(outs), found.x_axes, strict=True)]
    )

    def f(x_row: list, y_row: list) -> Any:
        outs, _ = evaluate(jaxpr, consts, [r[None] for r in (*y_row, *x_row)], None, tags)
        return take(outs)

    def again(x_row: list, y_row: list) -> Any:
        return take(g([r[None] for r in y_row], [r[None] for r in x_row]))

    one = lambda v: jax.ShapeDtypeStruct(v.aval.shape[1:], v.aval.dtype)
    rows = [one(v) for v in jaxpr.invars]
    try:
        jax.eval_shape(f, rows[found.n_y :], rows[: found.n_y])
    except _Refused:
        return again
    return f
