"""Jacobians computed in chunks of basis directions: ``batch_jacfwd``, ``batch_jacrev``.

``jax.jacfwd`` pushes every input basis vector through ``jax.jvp`` at once (one
``vmap`` over all of them), and ``jax.jacrev`` pulls every output basis vector back
through ``jax.vjp`` at once; peak memory grows with the number of directions. Here
the primal is evaluated once (``jax.linearize`` / ``jax.vjp``) and the directions
are pushed through the resulting linear map ``batch_size`` at a time with
``batch_vmap``. Basis vectors are built from their index inside the mapped
function, so no identity matrix is materialized.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from ..analysis.validate import batch_size_from, check_callable, fits_one_chunk, is_int
from ..core.sharding import explicit, sharding_of
from . import jacobian_dtypes as _dtypes
from .api import batch_vmap

__all__ = ["batch_jacfwd", "batch_jacrev"]


def batch_jacfwd(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    *,
    batch_size: int | Literal["auto"] | None = None,
    **kwargs: Any,
) -> Callable:
    """Jacobian of ``fun`` by forward mode, pushing ``batch_size`` columns at a time.

    Same results and output layout as :func:`jax.jacfwd`. The primal is evaluated
    once with :func:`jax.linearize`; the input basis vectors are then pushed through
    the linearized function in chunks of ``batch_size`` with ``batch_vmap``, so peak
    memory grows with ``batch_size`` rather than with the input size.

    Parameters
    ----------
    fun : callable
        Function to differentiate. Its arguments at ``argnums`` are arrays or pytrees
        of arrays with real (or, with ``holomorphic=True``, complex) dtypes.
    {argnums_has_aux_holomorphic}
    {batch_size_returns_examples}
    >>> import jax.numpy as jnp
    >>> from adv_jax_math import batch_jacfwd
    >>> f = lambda x: x * jnp.sum(x)
    >>> batch_jacfwd(f, batch_size=2)(jnp.array([1.0, 2.0, 3.0]))
    Array([[7., 1., 1.],
           [2., 8., 2.],
           [3., 3., 9.]], dtype=float32)
    """
    argnums_tuple, single, batch_size = _setup(fun, "batch_jacfwd", argnums, batch_size, kwargs)

    def jac_fun(*args: Any, **fun_kwargs: Any) -> Any:
        f_leaves, in_leaves, in_tree = _flat_problem(fun, argnums_tuple, single, args, fun_kwargs)
        _dtypes.check_jacfwd_inputs(in_leaves, holomorphic)
        layout = _Layout.of(in_leaves)
        if fits_one_chunk(batch_size, layout.total):
            # Everything fits in one chunk: a single vmap of jvp, no linearization.
            def push(i: jax.Array) -> Any:
                return jax.jvp(f_leaves, in_leaves, layout.one_hot(i), has_aux=has_aux)

            out_axes = (None, 0, None) if has_aux else (None, 0)
            y, tangents, *aux = jax.vmap(push, out_axes=out_axes)(jnp.arange(layout.total))
            y_leaves, out_tree = jax.tree.flatten(y)
            _dtypes.check_jacfwd_outputs(y_leaves, holomorphic)
            cols = [None if t.dtype == jax.dtypes.float0 else t for t in jax.tree.leaves(tangents)]
        else:
            y, f_jvp, aux = _with_aux(jax.linearize, f_leaves, in_leaves, has_aux)
            y_leaves, out_tree = jax.tree.flatten(y)
            _dtypes.check_jacfwd_outputs(y_leaves, holomorphic)
            # Integer/bool outputs have float0 tangents: keep them out of the map.
            keep = [_is_inexact(leaf.dtype) for leaf in y_leaves]

            def push_chunk(i: jax.Array) -> list[jax.Array]:
                out = jax.tree.leaves(f_jvp(*layout.one_hot(i)))
                return [t for t, k in zip(out, keep, strict=True) if k]

            kept = iter(
                batch_vmap(push_chunk, batch_size=batch_size)(jnp.arange(layout.total))
                if any(keep)
                else []
            )
            cols = [next(kept) if k else None for k in keep]

        rows = []
        for y_leaf, col in zip(y_leaves, cols, strict=True):
            oshape = np.shape(y_leaf)
            if col is None:  # no tangent: the Jacobian of an int/bool output is zero
                blocks = [jnp.zeros(oshape + s, y_leaf.dtype) for s in layout.shapes]
            else:  # col: (directions, *oshape) -> (*oshape, directions) -> input blocks
                blocks = layout.split(jnp.moveaxis(col, 0, -1), oshape)
            rows.append(jax.tree.unflatten(in_tree, blocks))
        jac = jax.tree.unflatten(out_tree, rows)
        return (jac, aux[0]) if has_aux else jac

    return _named(jac_fun, fun, "batch_jacfwd", argnums)


def batch_jacrev(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    *,
    batch_size: int | Literal["auto"] | None = None,
    **kwargs: Any,
) -> Callable:
    """Jacobian of ``fun`` by reverse mode, pulling back ``batch_size`` rows at a time.

    Same results and output layout as :func:`jax.jacrev`. The primal is evaluated
    once with :func:`jax.vjp`; the output basis vectors are then pulled back in
    chunks of ``batch_size`` with ``batch_vmap``, so peak memory grows with
    ``batch_size`` rather than with the output size.

    Parameters
    ----------
    fun : callable
        Function to differentiate. Its outputs are real arrays (complex with
        ``holomorphic=True``), or pytrees of them.
    {argnums_has_aux_holomorphic}
    allow_int : bool
        Whether integer or bool inputs are allowed; their Jacobian blocks are zeros
        of the input's dtype, as in :func:`jax.jacrev`.
    {batch_size_returns_examples}
    >>> import jax.numpy as jnp
    >>> from adv_jax_math import batch_jacrev
    >>> f = lambda x, y: {"s": x * y, "p": jnp.prod(x)}
    >>> jac = batch_jacrev(f, argnums=(0, 1), batch_size=1)(jnp.array([1.0, 2.0]), 3.0)
    >>> jac["s"][0]
    Array([[3., 0.],
           [0., 3.]], dtype=float32)
    >>> jac["p"][0]
    Array([2., 1.], dtype=float32)
    """
    argnums_tuple, single, batch_size = _setup(fun, "batch_jacrev", argnums, batch_size, kwargs)

    def jac_fun(*args: Any, **fun_kwargs: Any) -> Any:
        f_leaves, in_leaves, in_tree = _flat_problem(fun, argnums_tuple, single, args, fun_kwargs)
        _dtypes.check_jacrev_inputs(in_leaves, holomorphic, allow_int)
        y, pullback, aux = _with_aux(jax.vjp, f_leaves, in_leaves, has_aux)
        y_leaves, out_tree = jax.tree.flatten(y)
        _dtypes.check_jacrev_outputs(y_leaves, holomorphic)
        out_layout = _Layout.of(y_leaves)
        # Integer/bool inputs have float0 cotangents: keep them out of the map.
        keep = [_is_inexact(x.dtype) for x in in_leaves]

        def pull(i: jax.Array) -> list[jax.Array]:
            cts = pullback(jax.tree.unflatten(out_tree, out_layout.one_hot(i)))
            return [c for c, k in zip(cts, keep, strict=True) if k]

        directions = jnp.arange(out_layout.total)
        pulled: list[jax.Array]
        if not any(keep):
            pulled = []
        elif fits_one_chunk(batch_size, out_layout.total):
            pulled = jax.vmap(pull)(directions)
        else:
            pulled = batch_vmap(pull, batch_size=batch_size)(directions)
        kept = iter(pulled)

        # per input leaf: (output directions, *in.shape) -> one block per output leaf
        by_input = []
        for x, k in zip(in_leaves, keep, strict=True):
            ishape = np.shape(x)
            if k:
                by_input.append(out_layout.split(next(kept), ishape, axis=0))
            else:
                by_input.append([jnp.zeros(s + ishape, x.dtype) for s in out_layout.shapes])
        rows = [
            jax.tree.unflatten(in_tree, [blocks[j] for blocks in by_input])
            for j in range(len(y_leaves))
        ]
        jac = jax.tree.unflatten(out_tree, rows)
        return (jac, aux[0]) if has_aux else jac

    return _named(jac_fun, fun, "batch_jacrev", argnums)


class _Layout:
    """Sizes, shapes, dtypes (and shardings in types) of a flat list of leaves seen
    as one vector."""

    def __init__(self, shapes: list[tuple[int, ...]], dtypes: list[Any], shardings: list[Any]):
        self.shapes = shapes
        self.dtypes = dtypes
        self.shardings = shardings
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        self.offsets = [sum(self.sizes[:k]) for k in range(len(self.sizes))]
        self.total = sum(self.sizes)

    @classmethod
    def of(cls, leaves: Sequence[Any]) -> _Layout:
        shardings = [s if explicit(s) else None for s in map(sharding_of, leaves)]
        return cls([np.shape(x) for x in leaves], [jnp.result_type(x) for x in leaves], shardings)

    def one_hot(self, i: jax.Array) -> list[jax.Array]:
        """Basis vector ``i`` of the flattened vector, split back into the leaves (typed
        like them on Explicit meshes: tangents and cotangents must match their values)."""
        out = []
        for size, offset, shape, dtype, sharding in zip(
            self.sizes, self.offsets, self.shapes, self.dtypes, self.shardings, strict=True
        ):
            e = (jnp.arange(size) == i - offset).reshape(shape).astype(dtype)
            out.append(e if sharding is None else jax.sharding.reshard(e, sharding))
        return out

    def split(self, arr: jax.Array, other_shape: tuple[int, ...], axis: int = -1) -> list:
        """Split ``arr``'s flattened ``axis`` into one block per leaf.

        ``axis=-1``: ``(*other_shape, total)`` -> ``[(*other_shape, *leaf.shape)]``.
        ``axis=0``: ``(total, *other_shape)`` -> ``[(*leaf.shape, *other_shape)]``.
        """
        blocks = []
        for size, offset, shape in zip(self.sizes, self.offsets, self.shapes, strict=True):
            block = jax.lax.slice_in_dim(arr, offset, offset + size, axis=axis % arr.ndim)
            new_shape = (*other_shape, *shape) if axis == -1 else (*shape, *other_shape)
            blocks.append(block.reshape(new_shape))
        return blocks


def _flat_problem(
    fun: Callable,
    argnums: tuple[int, ...],
    single: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Callable, list[jax.Array], Any]:
    """``fun`` as a function of the flat leaves of the differentiated arguments.

    Returns ``(f_leaves, leaves, in_tree)``: ``in_tree`` is the structure of the one
    differentiated argument (int ``argnums``) or of the tuple of them.
    """
    positions = []
    for a in argnums:
        if not -len(args) <= a < len(args):
            raise ValueError(
                f"argnums={a} is out of range for a call with {len(args)} positional "
                "argument(s); pass argnums between -len(args) and len(args) - 1"
            )
        positions.append(a % len(args))
    if len(set(positions)) != len(positions):
        raise ValueError(
            f"argnums={argnums} refers to the same positional argument more than once; "
            "pass each argument position once"
        )
    dyn = args[positions[0]] if single else tuple(args[p] for p in positions)
    leaves, in_tree = jax.tree.flatten(dyn)
    leaves = [jnp.asarray(x) for x in leaves]

    def f_leaves(*new_leaves: jax.Array) -> Any:
        new_dyn = jax.tree.unflatten(in_tree, new_leaves)
        new_args = list(args)
        for p, value in zip(positions, [new_dyn] if single else new_dyn, strict=True):
            new_args[p] = value
        return fun(*new_args, **kwargs)

    return f_leaves, leaves, in_tree


def _with_aux(transform: Any, f: Callable, leaves: Sequence[Any], has_aux: bool) -> tuple:
    """``jax.linearize``/``jax.vjp`` of ``f``: ``(y, linear function, [aux] or [])``;
    ``has_aux`` passed as a literal (their overloads return 2 or 3 values)."""
    if has_aux:
        y, g, aux = transform(f, *leaves, has_aux=True)
        return y, g, [aux]
    y, g = transform(f, *leaves, has_aux=False)
    return y, g, []


def _setup(
    fun: Any, name: str, argnums: Any, batch_size: Any, kwargs: dict[str, Any]
) -> tuple[tuple[int, ...], bool, Any]:
    """Checked arguments of a Jacobian front end: ``(argnums, single, batch_size)``,
    ``single`` when ``argnums`` is one int (not a sequence)."""
    check_callable(fun, f"{name}: fun")
    single = is_int(argnums)
    nums = (argnums,) if single else tuple(argnums) if isinstance(argnums, Sequence) else ()
    if not nums or not all(map(is_int, nums)):
        raise TypeError(
            f"{name}: argnums={argnums!r} must be an int or a non-empty sequence of ints"
        )
    return tuple(map(operator.index, nums)), single, batch_size_from(batch_size, kwargs)


def _is_inexact(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _named(jac_fun: Callable, fun: Callable, name: str, argnums: Any) -> Callable:
    functools.update_wrapper(jac_fun, fun, updated=())
    fun_name = getattr(fun, "__name__", repr(fun))
    jac_fun.__doc__ = (
        f"Jacobian of {fun_name} with respect to positional argument(s) {argnums}, "
        f"computed by {name}. Takes the same arguments as {fun_name}."
    )
    return jac_fun


# Parameter and return text shared by the two docstrings.
_ARGNUMS_HAS_AUX_HOLOMORPHIC = """argnums : int or sequence of int
        Positional argument(s) to differentiate with respect to. Default 0.
    has_aux : bool
        Whether ``fun`` returns a pair ``(output, aux)``; ``aux`` is returned as is.
    holomorphic : bool
        Whether ``fun`` is promised to be holomorphic (complex inputs and outputs)."""
_BATCH_SIZE_RETURNS_EXAMPLES = """batch_size : int, "auto" or None
        Basis vectors per chunk (input directions pushed forward by ``batch_jacfwd``,
        output vectors pulled back by ``batch_jacrev``). None takes all of them at once,
        like :func:`jax.jacfwd` / :func:`jax.jacrev`; ``"auto"`` chooses the fastest
        chunk size that fits the memory budget (see :func:`batch_map`).
        ``chunk_size`` is accepted as an alias when ``batch_size`` is None.

    Returns
    -------
    jac_fun : callable
        Takes the same arguments as ``fun`` and returns the Jacobian (and ``aux``
        when ``has_aux``). Each leaf has shape ``out.shape + in.shape``, nested as
        the output pytree outside and the input pytree(s) inside.

    Examples
    --------"""
for _f in (batch_jacfwd, batch_jacrev):
    assert _f.__doc__ is not None
    _f.__doc__ = _f.__doc__.replace("{argnums_has_aux_holomorphic}", _ARGNUMS_HAS_AUX_HOLOMORPHIC)
    _f.__doc__ = _f.__doc__.replace("{batch_size_returns_examples}", _BATCH_SIZE_RETURNS_EXAMPLES)
