"""OTT-JAX integration: a point cloud geometry whose kernel runs on :func:`pairwise`.

``adv_jax_math.ott.PointCloud`` is OTT-JAX's own ``ott.geometry.pointcloud.PointCloud``
(a subclass, registered as a pytree the same way), with its kernel applications
computed by :func:`~adv_jax_math.pairwise`: the cost of each pair is evaluated in
tiles and reduced at once, so neither the ``N x M`` cost matrix nor the kernel
matrix is ever stored, forward or backward. Every lse-mode Sinkhorn step, marginal,
``reg_ot_cost`` and implicit-differentiation solve goes through it.

What runs on ``pairwise``:

* ``apply_lse_kernel`` (lse mode: the Sinkhorn updates, the marginals), with
  ``vec=`` too (the signed weighted form of implicit differentiation and of
  ``apply_transport_from_potentials``): ``LOGSUMEXP`` or
  ``weighted_logsumexp(return_sign=True)`` over the pairs;
* ``apply_kernel`` (kernel mode: ``lse_mode=False``, ``marginal_from_scalings``):
  an ``ADD`` of ``exp(-C_ij / eps) * vec_j``;
* ``apply_cost`` where OTT would store the cost matrix (a cost other than
  ``SqEuclidean``, or a nonlinear ``fn`` such as ``apply_square_cost``, which the
  default ``epsilon`` needs): an ``ADD`` of ``fn(C_ij) * vec_j``;
* ``scale_cost="max_cost"`` and ``"mean"``: a ``MAX`` / ``ADD`` over the pairs.

What stays as OTT has it: the properties that *are* ``N x M`` matrices
(``cost_matrix``, ``kernel_matrix``, ``transport_from_potentials``, a solution's
``.matrix``), ``scale_cost="max_norm"``, ``"max_bound"`` and floats (per point).
``scale_cost="median"`` needs every cost at once: it raises ``NotImplementedError``.
``batch_size`` (OTT's online mode) is accepted and ignored: the tiles of
``pairwise`` bound the memory (``tiles=`` sets them), and OTT's online code is never
run. This module imports OTT; ``import adv_jax_math`` does not import this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

try:
    from ott.geometry import costs, pointcloud
except ImportError as err:  # pragma: no cover - the test extra installs ott-jax
    raise ImportError(
        "adv_jax_math.ott needs OTT-JAX: pip install 'ott-jax>=0.6' (or adv-jax-math[test])"
    ) from err

from .monoids.catalog import ADD, LOGSUMEXP, MAX, weighted_logsumexp
from .pairs.api import PairwisePlan, explain_pairwise, pairwise

__all__ = ["SCALE_COSTS", "PointCloud"]

SCALE_COSTS = ("mean", "max_cost", "max_norm", "max_bound")
"""The ``scale_cost`` names supported (besides a positive float); OTT's ``"median"``
is not (it needs every cost at once)."""

_SIGNED = weighted_logsumexp(return_sign=True)

# (points the output is indexed by, points reduced over) for ``axis``: OTT's
# ``axis=1`` reduces over the columns (the y points), ``axis=0`` over the rows (x).
_AXES = {0: "the x points (rows): one value per y point", 1: "the y points (columns)"}


@jax.tree_util.register_pytree_node_class
class PointCloud(pointcloud.PointCloud):
    """OTT-JAX's ``PointCloud`` with its kernel applied by :func:`~adv_jax_math.pairwise`.

    A drop-in replacement for ``ott.geometry.pointcloud.PointCloud`` (same arguments,
    same pytree, same results to rounding): pass it to ``LinearProblem``,
    ``Sinkhorn``, ``ott.solvers.linear.solve``... Nothing ``N x M`` is stored by the
    kernel applications (see the module's docstring for what runs where).

    Parameters
    ----------
    x : array of shape (n, d)
        The first point cloud.
    y : array of shape (m, d) or None
        The second one (``None``: ``x`` itself).
    cost_fn : ott.geometry.costs.CostFn or None
        The cost of a pair, ``cost_fn(x_i, y_j)`` (default ``costs.SqEuclidean()``);
        any OTT cost, or your own subclass of ``costs.CostFn``.
    batch_size : int or None
        OTT's online mode: accepted (for code written for OTT) and ignored; memory
        is bounded by the tiles anyway. ``tiles=`` sets them.
    scale_cost : float or {"mean", "max_cost", "max_norm", "max_bound"}
        Divide the costs by this (a float) or by a statistic of them, as OTT does.
        ``"mean"`` and ``"max_cost"`` are reductions over every pair, computed at
        each kernel application (as OTT's dense geometry recomputes them): a float
        costs nothing.
    tiles : (int, int) or "auto"
        ``(x points, y points)`` per tile of :func:`~adv_jax_math.pairwise` (the
        pass over ``axis=0`` takes them swapped); ``"auto"`` lets it choose.
    **kwargs
        ``epsilon``, ``relative_epsilon``: as OTT's ``Geometry``.

    Examples
    --------
    >>> import jax
    >>> from ott.solvers import linear
    >>> from adv_jax_math.ott import PointCloud
    >>> x = jax.random.normal(jax.random.key(0), (100, 2))
    >>> y = jax.random.normal(jax.random.key(1), (80, 2)) + 1.0
    >>> out = linear.solve(PointCloud(x, y, epsilon=0.1))
    >>> bool(out.converged), round(float(out.reg_ot_cost), 2)
    (True, 2.92)
    """

    def __init__(
        self,
        x: jax.Array,
        y: jax.Array | None = None,
        cost_fn: costs.CostFn | None = None,
        batch_size: int | None = None,
        scale_cost: float | str = 1.0,
        tiles: tuple[int, int] | str = "auto",
        **kwargs: Any,
    ) -> None:
        _check_points(x, y)
        _check_cost_fn(cost_fn)
        if batch_size is not None and not (_is_int(batch_size) and batch_size > 0):
            raise ValueError(
                f"PointCloud: batch_size={batch_size!r}; pass a positive int or None "
                "(it is ignored: tiles= sets the tiles of pairwise)"
            )
        _check_scale_cost(scale_cost)
        scale = cast(Any, scale_cost)  # (checked above; OTT's hint is a Literal)
        super().__init__(x, y, cost_fn=cost_fn, batch_size=None, scale_cost=scale, **kwargs)
        self._ignored_batch_size = batch_size
        self.tiles = _check_tiles(tiles)

    # -- OTT's pytree: the tiles and the ignored batch_size travel in the aux data --

    def tree_flatten(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """OTT's children (points, epsilon, cost), its aux data with ``tiles`` and
        the ``batch_size`` given."""
        children, aux = super().tree_flatten()
        return children, {**aux, "batch_size": self._ignored_batch_size, "tiles": self.tiles}

    # -- what runs on pairwise --

    def apply_lse_kernel(
        self,
        f: jax.Array,
        g: jax.Array,
        eps: float | jax.Array,
        vec: jax.Array | None = None,
        axis: int = 0,
    ) -> tuple[jax.Array, jax.Array]:
        """The kernel applied in the log domain, as OTT's ``Geometry.apply_lse_kernel``.

        ``axis=1``: ``eps * log(sum_j vec_j exp((f_i + g_j - C_ij) / eps)) - f_i`` for
        every ``i``; ``axis=0``: the same over ``i`` for every ``j``, ``- g_j``
        (``vec=None``: every ``vec`` 1). The potential subtracted is never added, so it
        costs no digits (where it is not finite, it is added, as OTT's result is).

        Returns
        -------
        (array, array)
            The values and their signs (``vec=None``: ``jnp.array([1.0])``, as OTT).
        """
        axis = _check_axis(axis)
        remove = f if axis == 1 else g
        fn, rows, cols, reduction, tiles = self._lse_call(f, g, eps, vec, axis)
        out = pairwise(fn, rows, cols, reduction, tiles=tiles)
        sign = jnp.array([1.0]) if vec is None else out[1]
        value = eps * (out if vec is None else out[0])
        return jnp.where(jnp.isfinite(remove), value, value + remove), sign

    def apply_kernel(
        self, vec: jax.Array, eps: float | jax.Array | None = None, axis: int = 0
    ) -> jax.Array:
        """``exp(-C / eps)`` applied to ``vec`` (kernel mode), as OTT's ``apply_kernel``:
        ``axis=1`` sums over the y points (``K @ vec``), ``axis=0`` over the x points
        (``K.T @ vec``); ``vec`` may have trailing axes (``(len, k)``: ``k`` vectors)."""
        axis = _check_axis(axis)
        eps = self.epsilon if eps is None else eps
        vec = self._check_vec(vec, axis, "apply_kernel", trailing=True)
        scale = self.inv_scale_cost
        cost = self._pair_cost(axis)
        fn = lambda p, q: jnp.exp(-scale * cost(p, q[0]) / eps) * q[1]
        rows, cols, tiles = self._sides(axis)
        return pairwise(fn, rows, (cols, vec), ADD, tiles=tiles)

    def _apply_cost_to_vec(
        self,
        vec: jax.Array,
        axis: int = 0,
        fn: Callable[[jax.Array], jax.Array] | None = None,
        is_linear: bool = False,
        scale_cost: float | jax.Array | None = None,
    ) -> jax.Array:
        """``fn(C)`` (or ``fn(C).T``) applied to ``vec``, for ``apply_cost`` and the
        statistics of the costs: OTT's closed form for ``SqEuclidean`` with a linear
        ``fn``, else an ``ADD`` over the pairs (OTT would store the matrix)."""
        axis = _check_axis(axis)
        scale = self.inv_scale_cost if scale_cost is None else scale_cost
        if self.is_squared_euclidean and (fn is None or is_linear):
            return self._apply_sqeucl_cost(vec, cast(Any, scale), axis=axis, fn=fn)
        vec = self._check_vec(vec, axis, "apply_cost", trailing=True)
        cost, apply = self._pair_cost(axis), (lambda c: c) if fn is None else fn
        term = lambda p, q: apply(scale * cost(p, q[0])) * q[1]
        rows, cols, tiles = self._sides(axis)
        return pairwise(term, rows, (cols, vec), ADD, tiles=tiles)

    @property
    def inv_scale_cost(self) -> jax.Array:
        """``1 / scale``: ``"max_cost"`` and ``"mean"`` reduce every pair on
        :func:`~adv_jax_math.pairwise`, the other options are OTT's."""
        if isinstance(self._scale_cost, str) and self._scale_cost == "max_cost":
            return 1.0 / jnp.max(pairwise(self.cost_fn, self.x, self.y, MAX, tiles=self.tiles))
        if isinstance(self._scale_cost, str) and self._scale_cost == "mean":
            n, m = self.shape
            every = jnp.full((n,), 1.0 / n, dtype=self.dtype)
            return 1.0 / jnp.sum(self._apply_cost_to_vec(every, scale_cost=1.0) / m)
        return super().inv_scale_cost

    def explain_lse_kernel(self, axis: int = 0, weighted: bool = False) -> PairwisePlan:
        """The plan of :func:`~adv_jax_math.pairwise` for ``apply_lse_kernel(..., axis)``
        (``weighted=True``: with a ``vec``, the signed form), as
        :func:`~adv_jax_math.explain_pairwise` prints it; nothing is computed. With
        ``axis=0`` the plan's x rows are the geometry's y points (one value each)."""
        axis = _check_axis(axis)
        n, m = self.shape
        f = jax.ShapeDtypeStruct((n,), self.dtype)
        g = jax.ShapeDtypeStruct((m,), self.dtype)
        vec = jax.ShapeDtypeStruct(((n, m)[axis],), self.dtype) if weighted else None
        fn, rows, cols, reduction, tiles = self._lse_call(f, g, 1.0, vec, axis, explain=True)
        return explain_pairwise(fn, rows, cols, reduction, tiles=tiles)

    # -- helpers --

    def _lse_call(
        self, f: Any, g: Any, eps: Any, vec: Any, axis: int, explain: bool = False
    ) -> tuple[Callable, Any, Any, Any, Any]:
        """``(fn, rows, cols, reduction, tiles)`` of ``apply_lse_kernel``'s pairwise call:
        the other potential (and ``vec``) as leaves of the reduced side, ``fn`` one
        pair's exponent (and weight, of the exponent's shape)."""
        other = g if axis == 1 else f
        _check_potential(other, self.shape[axis], "g" if axis == 1 else "f")
        if vec is not None and not explain:
            vec = self._check_vec(vec, axis, "apply_lse_kernel", trailing=False)
        scale = 1.0 if explain else self.inv_scale_cost
        cost = self._pair_cost(axis)
        rows, cols, tiles = self._sides(axis)
        if vec is None:
            fn = lambda p, q: (q[1] - scale * cost(p, q[0])) / eps
            return fn, rows, (cols, other), LOGSUMEXP, tiles
        signed = lambda p, q: ((q[1] - scale * cost(p, q[0])) / eps, q[2])
        return signed, rows, (cols, other, vec), _SIGNED, tiles

    def _pair_cost(self, axis: int) -> Callable[[jax.Array, jax.Array], Any]:
        """``cost(p, q)`` for a point ``p`` of the output side and ``q`` of the reduced
        one: ``cost_fn(x_i, y_j)`` in OTT's order either way."""
        cost_fn = self.cost_fn
        if axis == 1:
            return lambda xi, yj: cost_fn(xi, yj)
        return lambda yj, xi: cost_fn(xi, yj)

    def _sides(self, axis: int) -> tuple[jax.Array, jax.Array, Any]:
        """(output side's points, reduced side's points, tiles in that order)."""
        if axis == 1:
            return self.x, self.y, self.tiles
        tiles = self.tiles if isinstance(self.tiles, str) else self.tiles[::-1]
        return self.y, self.x, tiles

    def _check_vec(self, vec: Any, axis: int, where: str, *, trailing: bool) -> jax.Array:
        """``vec`` as an array with one entry (or, ``trailing``, one row) per point
        reduced over (``axis=1``: the y points, ``axis=0``: the x points)."""
        want = self.shape[axis]
        vec = jnp.asarray(vec)
        ok = vec.ndim >= 1 and vec.shape[0] == want and (trailing or vec.ndim == 1)
        if not ok:
            shape = f"({want}, ...)" if trailing else f"({want},)"
            raise ValueError(
                f"PointCloud.{where}: vec of shape {vec.shape} with axis={axis}, which "
                f"reduces over {_AXES[axis]}; pass a vec of shape {shape}"
                + ("" if trailing else " (several: jax.vmap, or apply_transport_from_potentials)")
            )
        if not jnp.issubdtype(vec.dtype, jnp.inexact):
            vec = vec.astype(self.dtype)
        return vec


def _is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _check_points(x: Any, y: Any) -> None:
    """Two point clouds of shapes (n, d) and (m, d); leaves that are not arrays (JAX
    rebuilding the pytree with placeholders) are let through."""
    if not (hasattr(x, "shape") and (y is None or hasattr(y, "shape"))):
        return
    for name, a in (("x", x), ("y", y)):
        if a is not None and len(a.shape) != 2:
            raise ValueError(
                f"PointCloud: {name} of shape {tuple(a.shape)}; pass points as an array of "
                "shape (points, features) (one point: x[None])"
            )
    if y is not None and x.shape[1:] != y.shape[1:]:
        raise ValueError(
            f"PointCloud: x of shape {tuple(x.shape)} and y of shape {tuple(y.shape)} "
            "have different numbers of features; pass points of the same dimension"
        )


def _check_cost_fn(cost_fn: Any) -> None:
    if cost_fn is not None and not isinstance(cost_fn, costs.CostFn):
        raise TypeError(
            f"PointCloud: cost_fn={cost_fn!r} is not an ott.geometry.costs.CostFn; pass "
            "costs.SqEuclidean(), costs.Euclidean(), ... or subclass costs.CostFn with "
            "__call__(x, y) for one pair"
        )


def _check_scale_cost(scale_cost: Any) -> None:
    if isinstance(scale_cost, str):
        if scale_cost == "median":
            raise NotImplementedError(
                "PointCloud: scale_cost='median' needs every cost of the N x M matrix at "
                f"once; pass one of {SCALE_COSTS}, a float, or use "
                "ott.geometry.pointcloud.PointCloud (which stores the matrix)"
            )
        if scale_cost not in SCALE_COSTS:
            raise ValueError(
                f"PointCloud: scale_cost={scale_cost!r}; pass a float or one of {SCALE_COSTS}"
            )
    elif not (isinstance(scale_cost, int | float | np.number) or hasattr(scale_cost, "shape")):
        raise TypeError(
            f"PointCloud: scale_cost={scale_cost!r}; pass a float or one of {SCALE_COSTS}"
        )


def _check_tiles(tiles: Any) -> tuple[int, int] | str:
    if tiles == "auto":
        return "auto"
    ok = isinstance(tiles, tuple | list) and len(tiles) == 2
    if not (ok and all(_is_int(t) and t > 0 for t in tiles)):
        raise ValueError(
            f"PointCloud: tiles={tiles!r}; pass 'auto' or (x points, y points) per tile, "
            "two positive ints"
        )
    return (int(tiles[0]), int(tiles[1]))


def _check_axis(axis: Any) -> int:
    if axis not in (0, 1) or isinstance(axis, bool):
        raise ValueError(
            f"PointCloud: axis={axis!r}; pass 1 (reduce over the y points, one value per "
            "x point) or 0 (over the x points, one per y point)"
        )
    return int(axis)


def _check_potential(p: Any, want: int, name: str) -> None:
    shape = tuple(getattr(p, "shape", ()))
    if shape != (want,):
        raise ValueError(
            f"PointCloud.apply_lse_kernel: the potential {name} has shape {shape}; pass "
            f"one value per point, shape ({want},)"
        )
