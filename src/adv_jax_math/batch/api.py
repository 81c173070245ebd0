"""Public entry points: validate arguments, plan, hand the plan to an engine."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from ..analysis.validate import (
    axes_per_leaf,
    batch_size_from,
    check_callable,
    resolve_mesh,
)
from ..engines import registry as _engines
from ..engines.chunked import check_callables, prepare
from ..engines.fused import FusedEngine
from ..engines.scan import ScanEngine
from ..engines.shard import ShardEngine, as_global
from ..monoids.base import identity, is_monoid_tree
from ..pairs.api import explain_pairwise, pairwise
from ..pairs.rows_engine import PairEngine
from ..plan.base import Call, Plan
from . import nested as _nested

__all__ = ["batch_map", "batch_vmap", "explain"]

# The engines, in the order they are tried (the registry imports none of them).
_engines.install(
    ShardEngine(_engines.by_name),
    FusedEngine(interpret=False),
    FusedEngine(interpret=True),
    PairEngine(),
    ScanEngine(),
)

# One numpy-style parameter section shared by the three public docstrings.
_COMMON_PARAMS = """reduction : callable or None
        Binary reduction operation. Should take two arguments and return one
        output, e.g. ``jnp.add``, and must be associative because partial chunk
        results are combined in an implementation-dependent order. A
        :class:`Monoid` object, or a pytree of them matching the result, is
        accepted too: ``ADD``, ``MAX``, ``MIN``, ``LOGSUMEXP``, ``ARGMIN``,
        ``ARGMAX``, ``MIN_ARGMIN``, ``MAX_ARGMAX``, ``top_k(k)``,
        ``softmax_weighted()``, ``MEAN``, ``VAR``, ``var(ddof)``, ``MEAN_VAR``
        (``chunk_reduction`` is then not needed).
    chunk_reduction : callable
        Chunk-wise reduction operation. Should summarize a chunk compatibly with
        ``reduction`` along the mapped axis, e.g. ``jnp.add.reduce``.
    shard : bool
        Whether to shard the mapped input across devices before chunking. The
        divisible prefix is split across devices; ``batch_size`` bounds the
        batches processed on each device. A local remainder is evaluated once per
        device and a final global remainder once overall. Default is ``False``.
    mesh : jax.sharding.Mesh or None
        The mesh ``shard=True`` spreads the rows over (all its axes; Auto or
        Explicit). Default ``None``: the mesh set by ``jax.set_mesh`` if any, else
        a one-dimensional mesh over all devices."""


def batch_map(
    fun: Callable,
    fun_input: Any,
    /,
    batch_size: int | Literal["auto"] | None = None,
    *,
    reduction: Callable | None = None,
    chunk_reduction: Callable = identity,
    strip_dim0: bool = False,
    shard: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    **kwargs: Any,
) -> Any:
    """Compute ``chunk_reduction(fun(fun_input))`` in batches.

    ``fun`` is called on chunks of at most ``batch_size`` rows of ``fun_input``
    (split along the leading axis of every leaf) and the chunk results are
    concatenated, or combined with ``reduction``. Peak memory is bounded by the
    chunk size, and so is the memory of reverse-mode gradients (each chunk is
    recomputed in the backward pass; see :func:`config`).

    Notes
    -----
    ``fun`` is not wrapped in ``vmap``: it receives chunks with their leading
    axis. ``strip_dim0=True`` (only with ``batch_size=1``) passes single rows
    without it instead, for nesting calls. For a ``fun`` that acts on rows
    independently, ``batch_map(fun, x)`` matches ``batch_vmap(fun)(x)``;
    functions whose results depend on other rows of a chunk or on its length do
    not satisfy this contract. Only ``out_axes=0`` is supported.

    When ``(reduction, chunk_reduction)`` is a recognized monoid (``jnp.add`` with
    ``jnp.sum`` or ``jnp.add.reduce``; max, min and logsumexp likewise) the input
    is split into equal chunks and ``fun`` is traced once; on GPU/TPU the chunk
    work can run as one fused Pallas kernel. Other reductions are seeded with the
    first chunk's result and the remainder rows are evaluated separately. Use
    :func:`explain` to see the plan.

    Parameters
    ----------
    fun : callable
        Vectorized function.
    fun_input : pytree
        Data to split into batches to feed to ``fun``.
    batch_size : int, "auto" or None
        Size of batches. If no batching should be done or the batch size is the
        full input then supply ``None``. ``"auto"`` chooses, when the call is
        traced, the chunk size whose compiled program fits the memory budget
        (``config(memory_budget=...)``) and runs fastest among those that fit;
        ``explain`` shows the candidates. ``chunk_size`` is accepted as an alias
        when ``batch_size`` is ``None``.
    {common}
    strip_dim0 : bool
        Whether to strip the leading dim of ``fun_input`` before passing it to
        ``fun``. Only works if ``batch_size`` is one; should be ``False`` if
        ``fun`` is wrapped in ``vmap``. Default is ``False``.

    Returns
    -------
    fun_output
        Returns ``chunk_reduction(fun(fun_input))``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> x = jnp.arange(10.0)
    >>> ajm.batch_map(lambda x: x**2, x, 4)
    Array([ 0.,  1.,  4.,  9., 16., 25., 36., 49., 64., 81.], dtype=float32)
    >>> ajm.batch_map(lambda x: x**2, x, 4, reduction=jnp.add, chunk_reduction=jnp.sum)
    Array(285., dtype=float32)
    """
    stripped = _strip_dim0(fun, batch_size, strip_dim0, kwargs)
    if stripped is None and chunk_reduction is identity and reduction is None:
        call, plan, form = _stacking(fun, fun_input, batch_size, shard, mesh, kwargs)
        if isinstance(form, _nested.Nested):
            return _pairwise_of_chunks(call, form, mesh)
        return _engines.run(plan, call)

    def run() -> Any:
        call = prepare(
            stripped or fun, fun_input, batch_size, reduction, chunk_reduction, shard, mesh, kwargs
        )
        return _engines.run(_engines.plan(call), call)

    if stripped is None and chunk_reduction is identity and is_monoid_tree(reduction):
        leaves, treedef = jax.tree.flatten(fun_input)
        inner = _nested.Inner(
            lambda rows: fun(jax.tree.unflatten(treedef, rows)),
            leaves,
            [0] * len(leaves),
            reduction,
            batch_size,
            True,
            shard,
            chunked=True,
        )
        return _nested.as_inner(inner, run)
    out = run()
    combined = reduction is not None and chunk_reduction is identity
    if stripped and combined and not is_monoid_tree(reduction):
        # Rows of one combined directly (as the original library): drop that axis.
        # Monoid objects reduce the row axis themselves.
        out = jax.tree.map(lambda y: y[0], out)
    return out


def _stacking(
    fun: Callable, fun_input: Any, batch_size: Any, shard: bool, mesh: Any, kwargs: dict
) -> tuple[Call, Plan, _nested.Nested | str | None]:
    """The plan of a :func:`batch_map` call that stacks its results, made while
    listening for a pairwise reduction written as nested calls (the per-chunk form:
    ``batch.nested``), and that form, or why not (None: no inner call heard)."""
    check_callable(fun, "fun")  # before it is wrapped
    leaves, treedef = jax.tree.flatten(fun_input)
    one = lambda *rows: _nested.heard(lambda: fun(jax.tree.unflatten(treedef, list(rows))))
    listened = lambda chunk: one(*jax.tree.leaves(chunk))
    with _nested.listen() as listener:
        call = prepare(listened, fun_input, batch_size, None, identity, shard, mesh, kwargs)
        plan = _engines.plan(call)
    if not any(listener.seen[:1]):  # no nested call: an ordinary stacking call
        return call, plan, None
    rows = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in leaves]
    return call, plan, _nested.find(listener, one, rows, True, plan.rows_per_chunk)


def _pairwise_of_chunks(call: Call, form: _nested.Nested, mesh: Any, explain: bool = False) -> Any:
    """The pairwise reduction of nested per-chunk calls (``_stacking``), run or
    explained."""
    x = jax.tree.leaves(call.xs)
    tiles = _nested.tiles(call.batch_size, form.batch_size, x, form.y)
    args = (form.pair, x, form.y, form.reduction)
    if not explain:
        return pairwise(*args, tiles=tiles, shard=call.shard, mesh=mesh)
    plan = explain_pairwise(*args, tiles=tiles, shard=call.shard)
    return dataclasses.replace(plan, reason=f"{plan.reason}; read from nested batch_map calls")


def _strip_dim0(fun: Callable, batch_size: Any, strip_dim0: bool, kwargs: Any) -> Any:
    """``jax.vmap(fun)`` when ``strip_dim0`` applies (``batch_size=1``: chunks of one row,
    ``fun`` seeing the row without its axis); None otherwise, with a warning if the
    flag is ignored."""
    if not strip_dim0:
        return None
    if batch_size_from(batch_size, kwargs) == 1:
        check_callable(fun, "fun")
        return jax.vmap(fun)
    warnings.warn(
        f"strip_dim0=True only works with batch_size=1 (got batch_size={batch_size!r}); "
        "the flag is ignored",
        UserWarning,
        stacklevel=3,
    )
    return None


def explain(fun: Callable, fun_input: Any, /, *args: Any, **kwargs: Any) -> Plan:
    """The plan :func:`batch_map` would execute for these arguments, without running it.

    Takes exactly the arguments of :func:`batch_map` (bound to its signature);
    ``fun_input`` may hold ``jax.ShapeDtypeStruct`` (no data needed). The returned
    :class:`Plan` prints as a table: rows, chunks and their sizes, repeated rows or
    a remainder, how the reduction was recognized, the engine chosen and why each
    engine before it was rejected.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> x = jnp.ones((1000, 3))
    >>> plan = ajm.explain(jnp.exp, x, 64, reduction=jnp.add, chunk_reduction=lambda y: y.sum())
    >>> (plan.chunks, plan.rows_per_chunk, plan.masked, plan.kind)
    (16, 64, 24, <Kind.MONOID: 'monoid'>)
    >>> with ajm.config(backend="scan"):  # on GPU/TPU, "auto" picks the fused kernel
    ...     print(ajm.explain(jnp.exp, x, 64, reduction=jnp.add, chunk_reduction=jnp.sum))
    ... # doctest: +ELLIPSIS
    rows (n)   : 1000
    batch_size : 64
    reduction  : add over all axes (monoid)
    recognized : traced: reduce_sum over all axes + add
    policy     : 16 chunks of 64 rows; the last chunk overlaps the one before by 24 rows, ...
    engine     : scan: requested (backend='scan')
    rejected   : pallas: not requested (backend='scan')
    ...
    """
    a = inspect.signature(batch_map).bind(fun, fun_input, *args, **kwargs)
    a.apply_defaults()
    batch_size, options, extra = a.arguments["batch_size"], a.arguments, a.arguments["kwargs"]
    stripped = _strip_dim0(fun, batch_size, options["strip_dim0"], extra)
    reduction, chunk_reduction = options["reduction"], options["chunk_reduction"]
    shard, mesh = options["shard"], options["mesh"]
    if stripped is None and chunk_reduction is identity and reduction is None:
        call, _, form = _stacking(fun, fun_input, batch_size, shard, mesh, extra)
        if isinstance(form, _nested.Nested):
            return _pairwise_of_chunks(call, form, mesh, explain=True)
        plan = _engines.explain(call)
        if form is None:
            return plan
        note = f"pairwise engine: not a pairwise reduction written as nested calls: {form}"
        return dataclasses.replace(plan, notes=(*plan.notes, note))
    fun = stripped or fun
    call = prepare(fun, fun_input, batch_size, reduction, chunk_reduction, shard, mesh, extra)
    return _engines.explain(call)


@dataclasses.dataclass(frozen=True)
class _Mapped:
    """One call of a :func:`batch_vmap` function: its argument leaves, their axes,
    the mapped ones (``mapped``: positions; ``moved``: their mapped axis first)."""

    f: Callable
    leaves: list
    treedef: Any
    axes: list
    mapped: list[int]
    moved: list

    def with_rows(self, rows: list) -> Any:
        """``f`` on one example: ``rows`` for the mapped leaves."""
        full = list(self.leaves)
        for i, leaf in zip(self.mapped, rows, strict=True):
            full[i] = leaf
        call_args, call_kwargs = jax.tree.unflatten(self.treedef, full)
        return self.f(*call_args, **call_kwargs)

    def one(self, *rows: Any) -> Any:
        """``f`` on one example, heard by an outer call listening for nested calls."""
        return _nested.heard(lambda: self.with_rows(list(rows)))

    def chunk_fun(self, rows: list) -> Any:
        return jax.vmap(self.one)(*rows)


def batch_vmap(
    f: Callable,
    /,
    in_axes: int | Sequence[Any] | None = 0,
    *,
    batch_size: int | Literal["auto"] | None = None,
    reduction: Callable | None = None,
    chunk_reduction: Callable = identity,
    shard: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    **kwargs: Any,
) -> Callable:
    """Like ``jax.vmap(f, in_axes)``, evaluated in chunks of ``batch_size``.

    The mapped axes of the arguments are split into chunks; each chunk runs
    ``jax.vmap(f)`` and the results are concatenated along axis 0
    (``out_axes=0`` only) or combined with ``reduction``, exactly as
    :func:`batch_map` does for a vectorized function.

    Parameters
    ----------
    f : callable
        The function to be vectorized, written for one example.
    in_axes : int, None, or tuple
        As in ``jax.vmap``: an int applies to every positional argument; a tuple
        gives one entry (an int, ``None`` or a pytree prefix of the argument) per
        positional argument; ``None`` broadcasts; negative axes count from the end.
        Keyword arguments of the returned function are mapped over axis 0.
    batch_size : int, "auto" or None
        Rows per chunk; ``None`` evaluates everything at once; ``"auto"``: the
        fastest chunk size that fits the memory budget (as in :func:`batch_map`).
        ``chunk_size`` is accepted as an alias when ``batch_size`` is ``None``.
    {common}

    Returns
    -------
    callable
        The vectorized, chunked function. Its ``explain(*args)`` gives the plan of a
        call without running it.

    Notes
    -----
    A pairwise reduction written as nested calls, ``batch_vmap(lambda xi:
    batch_vmap(lambda yj: f(xi, yj), batch_size=bj, reduction=M)(y),
    batch_size=bi)(x)`` with a :class:`Monoid` ``M``, runs as
    ``pairwise(f, x, y, M, tiles=(bi, bj))`` (see :func:`pairwise`): the outer call
    reads that form from its trace of ``f`` (one inner call whose result it returns
    as is, the inner call's mapped inputs closed over). ``explain`` says why another
    form is not read.

    Examples
    --------
    Per-example gradients of a loss, three examples at a time:

    >>> import jax, jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    >>> w, xs = jnp.ones(3), jnp.arange(12.0).reshape(4, 3) / 10
    >>> grads = ajm.batch_vmap(jax.grad(loss), in_axes=(None, 0), batch_size=3)(w, xs)
    >>> grads.shape
    (4, 3)
    >>> bool(jnp.allclose(grads, jax.vmap(jax.grad(loss), (None, 0))(w, xs)))
    True
    """
    batch_size_from(batch_size, kwargs)  # fail at definition time, like the original
    check_callables(f, reduction, chunk_reduction)

    def mapped_call(args: tuple, fkwargs: dict) -> _Mapped:
        leaves, treedef = jax.tree.flatten((args, fkwargs))
        axes = axes_per_leaf(in_axes, args) + [0] * len(jax.tree.leaves(fkwargs))
        mapped = [i for i, axis in enumerate(axes) if axis is not None]
        if not mapped:
            raise ValueError(
                f"batch_vmap needs at least one mapped argument, but in_axes={in_axes!r} "
                "maps none; use an integer axis for at least one argument"
            )
        if shard:
            on_mesh = resolve_mesh(mesh)
            leaves = [
                x if a is not None else as_global(x, on_mesh)
                for x, a in zip(leaves, axes, strict=True)
            ]
        moved = []
        for i in mapped:
            leaf, axis = jnp.asarray(leaves[i]), axes[i]
            assert axis is not None  # mapped: the leaves with an axis
            if not -leaf.ndim <= axis < leaf.ndim:
                raise ValueError(
                    f"in_axes entry {axis} is out of range for an argument of shape "
                    f"{leaf.shape} (ndim {leaf.ndim})"
                )
            moved.append(jnp.moveaxis(leaf, axis, 0))
        return _Mapped(f, leaves, treedef, axes, mapped, moved)

    def stacked(m: _Mapped) -> tuple[Call, Plan, _nested.Nested | str]:
        """The plan of a call that stacks its results, made while listening for a
        pairwise reduction written as nested calls, and that form (or why not)."""
        with _nested.listen() as listener:
            call = prepare(m.chunk_fun, m.moved, batch_size, None, identity, shard, mesh, kwargs)
            plan = _engines.plan(call)
        rows = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in m.moved]
        return call, plan, _nested.find(listener, m.one, rows)

    def pairwise_of(call: Call, m: _Mapped, form: _nested.Nested) -> tuple[tuple, dict]:
        tiles = _nested.tiles(call.batch_size, form.batch_size, m.moved, form.y)
        return (form.pair, m.moved, form.y, form.reduction), dict(tiles=tiles, shard=shard)

    def reducing(to: Callable, m: _Mapped) -> Any:
        """``to`` (:func:`batch_map` or :func:`explain`) of a call with a reduction."""
        return to(
            m.chunk_fun,
            m.moved,
            batch_size,
            reduction=reduction,
            chunk_reduction=chunk_reduction,
            shard=shard,
            mesh=mesh,
            **kwargs,
        )

    def run(m: _Mapped) -> Any:
        if reduction is not None or chunk_reduction is not identity:
            return reducing(batch_map, m)
        call, plan, form = stacked(m)
        if isinstance(form, str):
            return _engines.run(plan, call)

        args, options = pairwise_of(call, m, form)
        return pairwise(*args, **options, mesh=mesh)

    def vectorized(*args: Any, **fkwargs: Any) -> Any:
        m = mapped_call(args, fkwargs)
        inner = _nested.Inner(
            m.with_rows,
            [m.leaves[i] for i in m.mapped],
            [m.axes[i] for i in m.mapped],
            reduction,
            batch_size,
            chunk_reduction is identity,
            shard,
        )
        return _nested.as_inner(inner, lambda: run(m))

    def explain_call(*args: Any, **fkwargs: Any) -> Any:
        """The plan of this function's call on these arguments (without running it):
        a :class:`PairwisePlan` for a pairwise reduction written as nested calls,
        else :func:`explain`'s plan (with why it is not pairwise, where it stacks)."""
        m = mapped_call(args, fkwargs)
        if reduction is not None or chunk_reduction is not identity:
            return reducing(explain, m)
        call, plan, form = stacked(m)
        if isinstance(form, str):
            note = f"pairwise engine: not a pairwise reduction written as nested calls: {form}"
            return dataclasses.replace(plan, notes=(*plan.notes, note))
        args, options = pairwise_of(call, m, form)
        pairs = explain_pairwise(*args, **options)
        return dataclasses.replace(
            pairs, reason=f"{pairs.reason}; read from nested batch_vmap calls"
        )

    vectorized.explain = explain_call  # type: ignore[attr-defined]
    return vectorized


# Docstrings are None only under python -OO (where this fails either way).
assert batch_map.__doc__ is not None and batch_vmap.__doc__ is not None
batch_map.__doc__ = batch_map.__doc__.format(common=_COMMON_PARAMS)
batch_vmap.__doc__ = batch_vmap.__doc__.format(common=_COMMON_PARAMS)
