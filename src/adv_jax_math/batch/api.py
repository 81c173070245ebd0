"""Public entry points: ``batch_map``, ``batch_vmap`` and ``explain`` read their
arguments into a :class:`~.route.Request`; ``batch.route`` runs it or explains it."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from ..analysis.validate import axes_per_leaf, batch_size_from, resolve_mesh
from ..engines.chunked import check_callables
from ..engines.shard import as_global
from ..monoids.base import identity, is_monoid_tree
from ..plan.base import Plan
from .route import Request, route

__all__ = ["batch_map", "batch_vmap", "explain"]

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
    return route(
        _mapping(
            fun, fun_input, batch_size, reduction, chunk_reduction, strip_dim0, shard, mesh, kwargs
        )
    )


def _mapping(
    fun: Callable,
    fun_input: Any,
    batch_size: Any,
    reduction: Any,
    chunk_reduction: Any,
    strip_dim0: bool,
    shard: Any,
    mesh: Any,
    kwargs: dict[str, Any],
) -> Request:
    """A :func:`batch_map` call (its arguments by name) as a :class:`Request`: an outer
    call listening for nested calls hears it where it reduces with a :class:`Monoid`."""
    leaves, treedef = jax.tree.flatten(fun_input)
    with_rows = lambda rows: fun(jax.tree.unflatten(treedef, rows))
    options = (batch_size, reduction, chunk_reduction, shard, mesh, kwargs)
    monoid = chunk_reduction is identity and is_monoid_tree(reduction)
    heard = (leaves, [0] * len(leaves)) if monoid else None
    return Request(
        with_rows, fun_input, *options, chunked=True, fun=fun, heard=heard, strip_dim0=strip_dim0
    )


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
    return route(_mapping(**a.arguments), explain=True)


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

    def request(args: tuple, fkwargs: dict) -> Request:
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

        def with_rows(rows: list) -> Any:
            """``f`` on one example: ``rows`` for the mapped leaves."""
            full = list(leaves)
            for i, leaf in zip(mapped, rows, strict=True):
                full[i] = leaf
            call_args, call_kwargs = jax.tree.unflatten(treedef, full)
            return f(*call_args, **call_kwargs)

        heard = ([leaves[i] for i in mapped], [axes[i] for i in mapped])
        options = (batch_size, reduction, chunk_reduction, shard, mesh, kwargs)
        return Request(with_rows, moved, *options, chunked=False, heard=heard)

    def vectorized(*args: Any, **fkwargs: Any) -> Any:
        return route(request(args, fkwargs))

    def explain_call(*args: Any, **fkwargs: Any) -> Any:
        """The plan of this function's call on these arguments (without running it):
        a :class:`PairwisePlan` for a pairwise reduction written as nested calls,
        else :func:`explain`'s plan (with why it is not pairwise, where it stacks)."""
        return route(request(args, fkwargs), explain=True)

    vectorized.explain = explain_call  # type: ignore[attr-defined]
    return vectorized


# Docstrings are None only under python -OO (where this fails either way).
assert batch_map.__doc__ is not None and batch_vmap.__doc__ is not None
batch_map.__doc__ = batch_map.__doc__.format(common=_COMMON_PARAMS)
batch_vmap.__doc__ = batch_vmap.__doc__.format(common=_COMMON_PARAMS)
