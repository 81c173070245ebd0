"""The one route of the front end: :func:`route` takes a ``batch_map`` or ``batch_vmap``
call (a :class:`Request`, as ``batch.api`` read its arguments) and runs it or, for
``explain`` and ``batch_vmap(...).explain``, returns the plan it would run:

- with ``strip_dim0`` (``batch_size=1``): ``jax.vmap(fun)`` on chunks of one row;
- an outer call listening for nested calls hears the call (``nested.as_inner``);
- a call that stacks its results plans while listening for a pairwise reduction written
  as nested calls (``batch.nested``) and runs that on :func:`~..pairs.api.pairwise`;
- every call is prepared (``engines.chunked.prepare``), planned and run on the engines
  installed here, in the order they are tried (the registry imports none of them).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..analysis.validate import batch_size_from, check_callable
from ..engines import registry as _engines
from ..engines.chunked import prepare
from ..engines.fused import FusedEngine
from ..engines.scan import ScanEngine
from ..engines.shard import ShardEngine
from ..monoids.base import identity, is_monoid_tree
from ..pairs.api import explain_pairwise, pairwise
from ..pairs.rows_engine import PairEngine
from ..plan.base import Call
from . import nested as _nested

__all__ = ["Request", "route"]

_engines.install(
    ShardEngine(_engines.by_name),
    FusedEngine(interpret=False),
    FusedEngine(interpret=True),
    PairEngine(),
    ScanEngine(),
)

# Where a warning is not given: this package, and jax (which traces the route's functions).
_LIBRARIES = (
    os.path.dirname(os.path.dirname(__file__)) + os.sep,
    os.path.dirname(jax.__file__) + os.sep,
)


@dataclasses.dataclass(frozen=True)
class Request:
    """One ``batch_map`` or ``batch_vmap`` call: ``with_rows``, its function on one row
    (``chunked``, ``batch_map``'s form: on one chunk) given the list of its mapped
    leaves; ``xs``, the mapped input (``batch_vmap``: its mapped leaves, mapped axis
    first); ``fun``, ``batch_map``'s function as given; the options of
    :func:`~..engines.chunked.prepare`; ``heard``, the mapped inputs as given and their
    axes where an outer call listening for nested calls hears this one (None: it does
    not)."""

    with_rows: Callable[[list], Any]
    xs: Any
    batch_size: Any
    reduction: Any
    chunk_reduction: Any
    shard: Any
    mesh: Any
    kwargs: dict[str, Any]
    chunked: bool
    fun: Any = None
    heard: tuple[list, list] | None = None
    strip_dim0: bool = False

    def one(self, *rows: Any) -> Any:
        """``with_rows`` on its mapped leaves, heard by an outer call that listens."""
        return _nested.heard(lambda: self.with_rows(list(rows)))

    def on_chunk(self, chunk: Any) -> Any:
        """:meth:`one` on a chunk of ``xs`` (``batch_vmap``: on each of its rows)."""
        leaves = jax.tree.leaves(chunk)
        return self.one(*leaves) if self.chunked else jax.vmap(self.one)(*leaves)


def route(r: Request, explain: bool = False) -> Any:
    """The result of the call ``r``, or with ``explain`` the plan it would run."""
    rows_of_one = _strip_dim0(r)
    if rows_of_one is not None:  # neither heard by an outer call nor listening
        out = _prepared(r, rows_of_one, explain)
        combined = r.reduction is not None and r.chunk_reduction is identity
        if explain or not combined or is_monoid_tree(r.reduction):
            return out
        # Rows of one combined directly (as the original library): drop that axis.
        # Monoid objects reduce the row axis themselves.
        return jax.tree.map(lambda y: y[0], out)
    if explain or r.heard is None:
        return _route(r, explain)
    by_rows = r.chunk_reduction is identity
    inner = _nested.Inner(
        r.with_rows, *r.heard, r.reduction, r.batch_size, by_rows, r.shard, chunked=r.chunked
    )
    return _nested.as_inner(inner, lambda: _route(r, False))


def _route(r: Request, explain: bool) -> Any:
    if r.reduction is None and r.chunk_reduction is identity:
        return _stacking(r, explain)
    return _prepared(r, r.fun if r.chunked else r.on_chunk, explain)


def _prepared(r: Request, fun: Any, explain: bool) -> Any:
    """``fun`` on chunks of ``r.xs``, planned on the installed engines: run, or the plan."""
    call = _prepare(r, fun)
    return _engines.explain(call) if explain else _engines.run(_engines.plan(call), call)


def _prepare(r: Request, fun: Any) -> Call:
    """:func:`~..engines.chunked.prepare`, with its warning for a mesh without ``shard``
    given at the caller's line."""
    mesh = r.mesh if r.shard else None
    call = prepare(fun, r.xs, r.batch_size, r.reduction, r.chunk_reduction, r.shard, mesh, r.kwargs)
    if r.mesh is not None and not r.shard:
        _warn("mesh is only used with shard=True; it is ignored")
    return call


def _stacking(r: Request, explain: bool) -> Any:
    """A call that stacks its results: planned while listening for a pairwise reduction
    written as nested calls (the form ``batch.nested`` reads), run on ``pairwise`` where
    it is one, else as planned (``explain``: with why it is not, where ``batch_map``
    heard a nested call or for any ``batch_vmap``)."""
    if r.chunked:
        check_callable(r.fun, "fun")  # before it is wrapped
    with _nested.listen() as listener:
        call = _prepare(r, r.on_chunk)
        plan = (_engines.explain if explain else _engines.plan)(call)
    form: _nested.Nested | str | None = None
    if not r.chunked or any(listener.seen[:1]):  # else an ordinary stacking batch_map
        cut = 0 if r.chunked else 1  # what ``one`` takes: a chunk's leaves, or a row's
        leaves = jax.tree.leaves(r.xs)
        rows = [jax.ShapeDtypeStruct(jnp.shape(a)[cut:], jnp.result_type(a)) for a in leaves]
        form = _nested.find(listener, r.one, rows, r.chunked, plan.rows_per_chunk)
    if isinstance(form, _nested.Nested):
        return _pairwise(r, call, form, explain)
    if not explain:
        return _engines.run(plan, call)
    if form is None:
        return plan
    note = f"pairwise engine: not a pairwise reduction written as nested calls: {form}"
    return dataclasses.replace(plan, notes=(*plan.notes, note))


def _pairwise(r: Request, call: Call, form: _nested.Nested, explain: bool) -> Any:
    """The pairwise reduction of nested calls that :func:`_stacking` read, run or
    explained."""
    x = jax.tree.leaves(call.xs)
    tiles = _nested.tiles(call.batch_size, form.batch_size, x, form.y)
    args = (form.pair, x, form.y, form.reduction)
    if not explain:
        return pairwise(*args, tiles=tiles, shard=call.shard, mesh=r.mesh)
    plan = explain_pairwise(*args, tiles=tiles, shard=call.shard)
    calls = "batch_map" if r.chunked else "batch_vmap"
    return dataclasses.replace(plan, reason=f"{plan.reason}; read from nested {calls} calls")


def _strip_dim0(r: Request) -> Any:
    """``jax.vmap(fun)`` when ``strip_dim0`` applies (``batch_size=1``: chunks of one row,
    ``fun`` seeing the row without its axis); None otherwise, with a warning if the flag
    is ignored."""
    if not r.strip_dim0:
        return None
    if batch_size_from(r.batch_size, r.kwargs) == 1:
        check_callable(r.fun, "fun")
        return jax.vmap(r.fun)
    _warn(
        f"strip_dim0=True only works with batch_size=1 (got batch_size={r.batch_size!r}); "
        "the flag is ignored"
    )
    return None


def _warn(message: str) -> None:
    """A ``UserWarning`` at the line that called into this package, however deep the
    route it took before it warns (nested calls, ``batch_vmap``'s wrapper, traces)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)
