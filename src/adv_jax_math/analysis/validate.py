"""Argument checks shared by every public entry point and every engine.

Each check raises a clear error that says what was given and what to do.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ..core.sharding import context_mesh
from ..monoids.base import Monoid

__all__ = [
    "axes_per_leaf",
    "batch_size_from",
    "check_callable",
    "check_monoid_rows",
    "check_reduction",
    "check_rowwise",
    "fits_one_chunk",
    "is_int",
    "mapped_rows",
    "resolve_mesh",
    "rowwise_problem",
]


def is_int(x: Any) -> bool:
    """An integer (anything with ``__index__``), but not a bool."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def check_callable(value: Any, name: str, what: str = "callable") -> None:
    if not callable(value):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}: {value!r}")


_REDUCTION = (
    "a binary callable (e.g. jnp.add), a Monoid object (e.g. adv_jax_math.ADD), a pytree "
    "of Monoid objects, or None"
)
_STEPS = ("init", "fold", "merge", "finalize")


def check_reduction(reduction: Any) -> None:
    """``reduction`` is None, a binary callable, a :class:`Monoid` that defines its four
    steps, or a pytree whose every leaf is one; a clear error otherwise."""
    if isinstance(reduction, type):
        raise TypeError(
            f"reduction={reduction!r} is a class, not a reduction; pass {_REDUCTION} "
            "(for a Monoid subclass, an instance: reduction=MyMonoid(...))"
        )
    if reduction is None or (callable(reduction) and not isinstance(reduction, Monoid)):
        return
    is_leaf = lambda m: m is None or isinstance(m, Monoid | type)
    flat = jax.tree_util.tree_flatten_with_path(reduction, is_leaf=is_leaf)[0]
    if not flat:
        raise TypeError(f"reduction must be {_REDUCTION}, got the empty {reduction!r}")
    for path, m in flat:
        where = f"reduction{jax.tree_util.keystr(path)}" if path else "reduction"
        if m is None:
            raise ValueError(
                f"{where} is None in reduction={reduction!r}: in a pytree of reductions "
                "every leaf must be a Monoid object (None does not leave a part of fun's "
                "output unreduced); give that part a monoid too (e.g. adv_jax_math.ADD), or "
                "return only the parts to reduce from fun and map the others in a separate "
                "batch_map call"
            )
        if not isinstance(m, Monoid):
            what = "a class" if isinstance(m, type) else type(m).__name__
            raise TypeError(
                f"reduction must be {_REDUCTION}; {where} is {what}: {m!r} (a pytree of "
                "reductions holds Monoid objects only)"
            )
        missing = [s for s in _STEPS if getattr(type(m), s) is getattr(Monoid, s)]
        if missing:
            raise TypeError(
                f"{where}={m!r} ({type(m).__name__}) does not define {', '.join(missing)}: "
                "the Monoid base class only describes the protocol. Pass one of "
                "adv_jax_math's monoids (ADD, MAX, MIN, LOGSUMEXP, ARGMIN, MEAN, VAR, "
                "top_k(k), softmax_weighted() ...), or a subclass of Monoid that defines "
                f"{', '.join(_STEPS)}"
            )


def check_monoid_rows(reduction: Any, out_shape: Any, rows: int) -> None:
    """Monoid objects (default ``chunk_reduction``) reduce the rows of ``fun``'s output:
    each leaf needs one row per input row. A 0-d or empty output is left to the generic
    path when every monoid combines results (ADD, MAX, MIN, LOGSUMEXP act as
    ``jnp.add`` ... on per-chunk results)."""
    leaves = jax.tree.leaves(out_shape)
    monoids = jax.tree.leaves(reduction, is_leaf=lambda m: isinstance(m, Monoid))
    if not leaves or any(not leaf.shape for leaf in leaves):
        if all(m.combine is not None for m in monoids):
            return
        got = (
            "nothing (no array leaves)"
            if not leaves
            else f"{jax.tree.map(lambda s: tuple(s.shape), out_shape)} (a 0-d leaf)"
        )
        raise ValueError(
            f"reduction={reduction!r} reduces the rows of fun's output, but fun returned "
            f"{got} for a chunk of {rows} rows; fun must return arrays with one row per "
            "input row (shape (rows, ...)), e.g. lambda x: x or jax.vmap of a per-row function"
        )
    need = (
        f"reduction={reduction!r} reduces axis 0 of each output leaf as the rows, so fun "
        "must return one row per input row, in order (not transposed or repeated)"
    )
    problem = rowwise_problem(out_shape, rows, "fun(chunk)", need)
    if problem:
        raise ValueError(problem)


def batch_size_from(batch_size: Any, kwargs: Mapping[str, Any]) -> int | Literal["auto"] | None:
    """Validate ``batch_size`` and the ``chunk_size`` alias; reject other kwargs.

    ``chunk_size`` is used only when ``batch_size`` is None (``batch_size`` wins).
    ``"auto"`` (any case) is returned as ``"auto"``: the planner chooses the chunk
    size (see ``plan.autotune``).
    """
    unexpected = sorted(set(kwargs) - {"chunk_size"})
    if unexpected:
        raise ValueError(
            f"Unexpected keyword argument(s) {', '.join(map(repr, unexpected))}; "
            "the only extra keyword accepted is 'chunk_size' (an alias of batch_size)"
        )
    name = "batch_size"
    if batch_size is None:
        batch_size, name = kwargs.get("chunk_size"), "chunk_size"
    if batch_size is None:
        return None
    if isinstance(batch_size, str) and batch_size.strip().lower() == "auto":
        return "auto"
    if not is_int(batch_size):
        raise TypeError(
            f"{name}={batch_size!r} must be a positive int, 'auto' or None, "
            f"not {type(batch_size).__name__}"
        )
    batch_size = operator.index(batch_size)
    if batch_size < 1:
        raise ValueError(f"{name}={batch_size} must be a positive int, 'auto' or None")
    return batch_size


def fits_one_chunk(batch_size: int | str | None, n: int) -> bool:
    """Whether ``n`` rows run as one call: no ``batch_size``, or an int ``>= n``
    (``"auto"`` is decided later, by the planner)."""
    return batch_size is None or (not isinstance(batch_size, str) and batch_size >= n)


def mapped_rows(xs: Any, what: str = "fun_input") -> int:
    """The common leading size of the leaves of ``xs`` (arrays or
    ``jax.ShapeDtypeStruct``); a clear error otherwise."""
    paths_leaves = jax.tree_util.tree_flatten_with_path(xs)[0]
    if not paths_leaves:
        raise ValueError(f"{what} has no array leaves to map over; pass at least one array")
    sizes: dict[str, int] = {}
    for path, leaf in paths_leaves:
        name = f"{what}{jax.tree_util.keystr(path)}"
        shape = getattr(leaf, "shape", None)
        shape = np.shape(leaf) if shape is None else tuple(shape)
        if not shape:
            raise ValueError(
                f"{name} is 0-d (shape ()), but mapping needs a leading axis to split; "
                "give it a leading axis, or close over it in fun instead of mapping it"
            )
        if not is_int(shape[0]):
            raise ValueError(
                f"{name} has the symbolic leading dimension {shape[0]!r} (from "
                "jax.export.symbolic_shape?), but batch_map needs the number of rows to "
                "plan its chunks; export with a concrete leading size (batch_size=None "
                "with a plain-JAX chunk_reduction such as jnp.sum makes one call of fun, "
                "at any size)"
            )
        sizes[name] = operator.index(shape[0])
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(
            f"the mapped leaves have different leading sizes ({listing}); "
            "every mapped leaf must have the same number of rows"
        )
    return next(iter(sizes.values()))


def rowwise_problem(out_shape: Any, rows: int, what: str, need: str) -> str | None:
    """Why an output leaf does not have one row per input row (``need`` says what
    requires it), or None."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(out_shape)[0]:
        if tuple(leaf.shape[:1]) != (rows,):
            return (
                f"{what}{jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)} for a chunk "
                f"of {rows} rows; {need}"
            )
    return None


def check_rowwise(out_shape: Any, rows: int, what: str) -> None:
    """A map's chunk outputs must have one row per input row."""
    need = (
        "without a reduction, each output leaf needs one row per input row "
        "(leading dimension == rows) so chunks can be concatenated"
    )
    problem = rowwise_problem(out_shape, rows, what, need)
    if problem:
        raise ValueError(problem)


def resolve_mesh(mesh: Any) -> Any:
    """The mesh ``shard=True`` spreads rows over: ``mesh`` checked to be
    one-dimensional and ``AxisType.Auto`` (the original library's contract); else
    the mesh set with ``jax.set_mesh`` (any axis types; rows are split over all its
    axes); else an Auto mesh over every device of every process (inputs typed on
    another mesh are put on it replicated: no Explicit mesh leaks into the
    cotangents of an eager ``jax.grad``, as in the original library)."""
    if mesh is None:
        context = context_mesh()
        if context is not None:
            return context
        return jax.make_mesh((jax.device_count(),), ("devices",), axis_types=(AxisType.Auto,))
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"shard=True needs a one-dimensional mesh, got axes {mesh.axis_names} with shape "
            f"{dict(mesh.shape)}; make one with jax.make_mesh((n,), ('x',), "
            "axis_types=(jax.sharding.AxisType.Auto,)), or set a mesh of any shape with "
            "jax.set_mesh and pass mesh=None"
        )
    if tuple(mesh.axis_types) != (AxisType.Auto,):
        raise ValueError(
            f"shard=True needs the mesh axis to be AxisType.Auto, got {mesh.axis_types}; "
            "make the mesh with axis_types=(jax.sharding.AxisType.Auto,), or set it with "
            "jax.set_mesh and pass mesh=None"
        )
    return mesh


def axes_per_leaf(in_axes: Any, args: tuple) -> list[int | None]:
    """Broadcast a ``jax.vmap``-style ``in_axes`` prefix to one entry per leaf of args."""
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    if isinstance(in_axes, tuple) and len(in_axes) != len(args):
        raise ValueError(
            f"in_axes={in_axes!r} has {len(in_axes)} entries but the function was called "
            f"with {len(args)} positional arguments; give one entry per argument"
        )
    if not isinstance(in_axes, tuple):
        in_axes = (in_axes,) * len(args)

    def spread(axis: Any, subtree: Any) -> list:
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
            raise TypeError(f"in_axes entries must be int or None, got {axis!r}")
        return [axis] * len(jax.tree.leaves(subtree))

    try:
        per_arg = jax.tree.map(spread, in_axes, args, is_leaf=lambda a: a is None)
    except ValueError as err:
        raise ValueError(
            f"in_axes={in_axes!r} is not a prefix of the arguments' structure: {err}"
        ) from None
    return [
        a for axes in jax.tree.leaves(per_arg, is_leaf=lambda a: isinstance(a, list)) for a in axes
    ]
