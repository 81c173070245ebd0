"""``batch_vectorize``: ``jnp.vectorize`` whose loop runs in chunks of ``batch_size``.

``jnp.vectorize`` nests one ``vmap`` per broadcast loop dimension. Here the loop
dimensions are flattened into a single mapped axis of length ``n = prod(loop
shape)`` and mapped with ``batch_vmap``, so at most ``batch_size`` core calls are
live at once whatever the loop shape. Arguments are never broadcast to the full
loop shape: an argument that spans the whole loop shape is reshaped (free), one
with no loop dimensions is passed unmapped, and one that is broadcast along some
loop dimensions only is indexed per element from the flat loop index.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from ..analysis.validate import batch_size_from, fits_one_chunk
from .api import batch_vmap

__all__ = ["batch_vectorize"]

CoreDims = tuple[str, ...]


def batch_vectorize(
    pyfunc: Callable,
    *,
    excluded: Collection[int | str] = frozenset(),
    signature: str | None = None,
    batch_size: int | Literal["auto"] | None = None,
    **kwargs: Any,
) -> Callable:
    """Vectorize ``pyfunc`` with broadcasting, like :func:`jax.numpy.vectorize`, in chunks.

    The broadcast loop dimensions are flattened into one axis that is mapped with
    ``batch_vmap`` in chunks of ``batch_size`` elements, bounding the memory of
    ``pyfunc``'s intermediates. Results equal ``jnp.vectorize(pyfunc, excluded=...,
    signature=...)``.

    Parameters
    ----------
    pyfunc : callable
        Function to vectorize, written for one element (core-shaped arguments).
    excluded : set of int or str
        Positional indices or keyword names of arguments passed to ``pyfunc``
        unmodified (not vectorized). Arguments that are None are excluded too.
    signature : str or None
        Generalized ufunc signature such as ``"(m,n),(n)->(m)"``: the core
        dimensions of each non-excluded argument and of each output. Outputs must
        match it (a tuple when there are several). None means scalar cores for
        every input and outputs of any shape or pytree structure.
    batch_size : int, "auto" or None
        Number of loop elements evaluated per chunk. None evaluates all at once;
        ``"auto"`` chooses the fastest chunk size that fits the memory budget (see
        :func:`batch_map`). ``chunk_size`` is accepted as an alias when
        ``batch_size`` is None.

    Returns
    -------
    vectorized : callable
        Takes the arguments of ``pyfunc`` with any number of leading loop
        dimensions (broadcast together, NumPy style) and returns outputs of shape
        ``loop_shape + core_shape``.

    Notes
    -----
    Non-excluded keyword arguments are vectorized like NumPy's ``vectorize`` does:
    they count as extra inputs after the positional ones (also in ``signature``).
    ``jnp.vectorize`` silently drops them instead. Broadcasting that needs rank
    promotion follows the ``jax_numpy_rank_promotion`` config ("allow", "warn",
    "raise").

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from adv_jax_math import batch_vectorize
    >>> matvec = batch_vectorize(lambda m, v: m @ v, signature="(n,k),(k)->(n)", batch_size=2)
    >>> matvec(jnp.ones((5, 2, 3)), jnp.arange(3.0)).shape
    (5, 2)
    >>> batch_vectorize(lambda a, b: a * b, batch_size=4)(jnp.arange(3.0)[:, None], jnp.ones(2))
    Array([[0., 0.],
           [1., 1.],
           [2., 2.]], dtype=float32)
    """
    if not callable(pyfunc):
        raise TypeError(f"batch_vectorize expects a callable pyfunc, got {pyfunc!r}")
    for e in excluded:
        if isinstance(e, bool) or not isinstance(e, (int, str)):
            raise TypeError(
                f"excluded={excluded!r} may only hold argument positions (int) or names "
                f"(str), got {e!r}"
            )
        if isinstance(e, int) and e < 0:
            raise ValueError(
                f"excluded={excluded!r} contains the negative position {e}; "
                "use non-negative positional indices"
            )
    batch_size = batch_size_from(batch_size, kwargs)
    parsed = None if signature is None else _parse_signature(signature)
    context = f"(batch_vectorize with excluded={excluded!r}, signature={signature!r})"

    @functools.wraps(pyfunc)
    def vectorized(*args: Any, **kw: Any) -> Any:
        # ("pos", index into args) or ("kw", name in kw)
        slots: list[tuple[str, Any]] = [("pos", i) for i in range(len(args)) if i not in excluded]
        slots += [("kw", name) for name in kw if name not in excluded]
        values = [args[i] if kind == "pos" else kw[i] for kind, i in slots]
        if parsed is None:
            in_core: list[CoreDims] = [()] * len(values)
            out_core = None
        else:
            in_core, out_core = parsed
            if len(in_core) != len(values):
                raise TypeError(
                    f"wrong number of vectorized arguments: the signature has {len(in_core)} "
                    f"input(s) but {len(values)} were given {context}"
                )
        # None arguments are passed through unmodified, like excluded ones.
        for (_, i), v, core in zip(slots, values, in_core, strict=True):
            if v is None and core:
                raise ValueError(
                    f"Cannot pass None as argument {i!r} with core dims {core} {context}"
                )
        keep = [v is not None for v in values]
        slots = [s for s, k in zip(slots, keep, strict=True) if k]
        in_core = [c for c, k in zip(in_core, keep, strict=True) if k]
        values = [jnp.asarray(v) for v, k in zip(values, keep, strict=True) if k]
        dim_sizes = _core_dim_sizes(values, in_core, context)

        def call(*core_values: jax.Array) -> Any:
            pos, named = list(args), dict(kw)
            for (kind, i), v in zip(slots, core_values, strict=True):
                if kind == "pos":
                    pos[i] = v
                else:
                    named[i] = v
            out = pyfunc(*pos, **named)
            if out_core is not None:
                _check_outputs(out, out_core, dim_sizes, context)
            return out

        loop_shapes = [v.shape[: v.ndim - len(c)] for v, c in zip(values, in_core, strict=True)]
        loop = _broadcast_shapes(loop_shapes, context)
        _check_rank_promotion(values, loop_shapes, signature)
        return _loop(call, values, loop_shapes, loop, batch_size)

    return vectorized


def _loop(
    call: Callable,
    values: list[jax.Array],
    loop_shapes: list[tuple[int, ...]],
    loop: tuple[int, ...],
    batch_size: int | Literal["auto"] | None,
) -> Any:
    """Evaluate ``call`` over the flattened loop shape ``loop``."""
    n = math.prod(loop)
    ops: list[jax.Array] = []
    in_axes: list[int | None] = []
    kinds: list[tuple[str, tuple[int, ...]]] = []
    for v, shape in zip(values, loop_shapes, strict=True):
        padded = (1,) * (len(loop) - len(shape)) + shape
        core_shape = v.shape[len(shape) :]
        if all(d == 1 for d in padded):  # no loop dims: same value for every element
            kinds.append(("same", ()))
            ops.append(v.reshape(core_shape))
            in_axes.append(None)
        elif padded == loop:  # spans the whole loop: flatten the loop dims
            kinds.append(("mapped", ()))
            ops.append(v.reshape((n, *core_shape)))
            in_axes.append(0)
        else:  # broadcast along some loop dims: index it from the flat loop index
            dims = tuple(d for d, size in enumerate(padded) if size != 1)
            kinds.append(("indexed", dims))
            ops.append(v.reshape(tuple(padded[d] for d in dims) + core_shape))
            in_axes.append(None)
    if all(kind == "same" for kind, _ in kinds):
        out = call(*ops)
        return jax.tree.map(lambda y: jnp.reshape(y, loop + jnp.shape(y)), out)

    strides = [math.prod(loop[d + 1 :]) for d in range(len(loop))]

    def element(index: jax.Array, *elem_ops: jax.Array) -> Any:
        core_values = []
        for (kind, dims), op in zip(kinds, elem_ops, strict=True):
            if kind == "indexed":
                op = op[tuple((index // strides[d]) % loop[d] for d in dims)]
            core_values.append(op)
        return call(*core_values)

    if fits_one_chunk(batch_size, n):
        mapped = jax.vmap(element, in_axes=(0, *in_axes))
    else:
        mapped = batch_vmap(element, in_axes=(0, *in_axes), batch_size=batch_size)
    out = mapped(jnp.arange(n), *ops)
    return jax.tree.map(lambda y: y.reshape(loop + y.shape[1:]), out)


_ARGUMENTS = r"\((\w+(,\w+)*)?\)(,\((\w+(,\w+)*)?\))*"  # "(m,n),(n)": at least one


def _parse_signature(signature: str) -> tuple[list[CoreDims], list[CoreDims]]:
    """``"(m,n),(n)->(m)"`` -> ``([("m", "n"), ("n",)], [("m",)])``. Whitespace is ignored."""
    if not isinstance(signature, str):
        raise TypeError(f"signature={signature!r} must be a str such as '(m,n),(n)->(m)' or None")
    sides = "".join(signature.split()).split("->")
    if len(sides) != 2 or not all(re.fullmatch(_ARGUMENTS, side) for side in sides):
        raise ValueError(
            f"not a valid gufunc signature: {signature!r}; expected comma-separated "
            "parenthesized dimension names on both sides of '->', e.g. '(m,n),(n)->(m)'"
        )
    inputs, outputs = (
        [tuple(a.split(",")) if a else () for a in re.findall(r"\(([^)]*)\)", side)]
        for side in sides
    )
    return inputs, outputs


def _core_dim_sizes(
    values: Sequence[jax.Array], in_core: Sequence[CoreDims], context: str
) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for v, core in zip(values, in_core, strict=True):
        if v.ndim < len(core):
            raise ValueError(
                f"input with shape {v.shape} does not have enough dimensions for all core "
                f"dimensions {core} {context}"
            )
        _update_sizes(sizes, v.shape[v.ndim - len(core) :], core, context)
    return sizes


def _update_sizes(
    sizes: dict[str, int], shape: tuple[int, ...], core: CoreDims, context: str
) -> None:
    for name, size in zip(core, shape, strict=True):
        if sizes.setdefault(name, size) != size:
            raise ValueError(
                f"inconsistent size for core dimension {name!r}: {size} vs {sizes[name]} {context}"
            )


def _check_outputs(out: Any, out_core: list[CoreDims], dim_sizes: dict, context: str) -> None:
    if len(out_core) > 1 and not isinstance(out, tuple):
        raise TypeError(
            f"the signature has {len(out_core)} outputs, so pyfunc must return a tuple; "
            f"got {type(out).__name__} {context}"
        )
    outs = out if isinstance(out, tuple) else (out,)
    if len(outs) != len(out_core):
        raise TypeError(
            f"wrong number of outputs: the signature has {len(out_core)}, pyfunc returned "
            f"{len(outs)} {context}"
        )
    sizes = dict(dim_sizes)
    for y, core in zip(outs, out_core, strict=True):
        shape = jnp.shape(y)
        if len(shape) != len(core):
            raise ValueError(
                f"output shape {shape} does not match core dimensions {core} {context}"
            )
        _update_sizes(sizes, shape, core, context)


def _broadcast_shapes(shapes: Sequence[tuple[int, ...]], context: str) -> tuple[int, ...]:
    try:
        return np.broadcast_shapes(*shapes)
    except ValueError:
        raise ValueError(
            f"loop dimensions of the arguments do not broadcast: shapes {list(shapes)} "
            f"(core dimensions excluded) {context}"
        ) from None


def _check_rank_promotion(
    values: Sequence[jax.Array], loop_shapes: Sequence[tuple[int, ...]], signature: str | None
) -> None:
    mode = jax.config.jax_numpy_rank_promotion
    if mode == "allow":
        return
    ranks = {len(s) for v, s in zip(values, loop_shapes, strict=True) if v.ndim != 0}
    if len(ranks) > 1:
        msg = (
            f"operands with shapes {[v.shape for v in values]} require rank promotion for "
            f"batch_vectorize with signature={signature!r}. Add the missing leading "
            "dimensions explicitly, or set the jax_numpy_rank_promotion config option to "
            "'allow' to disable this check; see "
            "https://docs.jax.dev/en/latest/101/rank_promotion_warning.html"
        )
        if mode == "raise":
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=3)
