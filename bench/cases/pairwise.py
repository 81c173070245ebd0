"""``ajm.pairwise(f, x, y, reduction)``, ``out_i = reduce_j f(x_i, y_j)``: the cases.

* :data:`REDUCTIONS`: one case per reduction (a vector per pair, several heads, a pytree
  of monoids), ``f`` of two rows of points: ``tests/test_pairwise.py`` runs them on
  37 x 53 rows (and ``tests/test_accelerator_pairwise.py`` on a GPU or TPU),
  ``bench/accel/pairwise_targets.py`` compiles some for GPUs and TPUs at KeOps-like
  sizes;
* the workloads, :func:`gaussian` (KeOps' benchmark), :data:`KNN`, :data:`SINKHORN`,
  :func:`attention` and :data:`CROSS_ENTROPY`: ``bench/bench_pairwise.py`` measures
  the first three, ``bench/accel/pairwise_roofline.py`` models the Gaussian sum,
  attention and cross-entropy;
* the matrix-unit grid, :func:`matmul_grid` (issue 41: dot-product pairs that the matmul
  tiles take): attention at d = 16, 64, 128 in float32 and bfloat16, k-NN top-8 at
  D = 128 (:data:`KNN_TOP8`) and a Sinkhorn logsumexp at D = 64, at 8191 x 16411 and
  30011 x 100003 rows; ``bench/accel/pairwise_targets.py --matmul`` compiles it for
  GPUs and TPUs, ``bench/device_check.py --matmul`` times it on a device.

The oracle of a case is the plain-JAX reduction along axis 1 of the dense
``(N, M, ...)`` outputs of ``f`` (``vmap(vmap(f))``): :attr:`Pairwise.oracle`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import adv_jax_math as ajm

from . import oracle

S, F32 = jax.ShapeDtypeStruct, jnp.float32
EPS = 0.05  # Sinkhorn's entropic regularization


def points(m: int, d: int) -> jax.ShapeDtypeStruct:
    return S((m, d), F32)


@dataclasses.dataclass(frozen=True)
class Pairwise:
    """``pairwise(f, x, y, reduction)`` with ``x`` of ``(n, d)`` points and ``y`` of
    what ``y(m, d)`` gives (``m`` points by default)."""

    name: str
    reduction: Any  # a monoid or a pytree of them
    f: Callable  # f(x row, y row)
    y: Callable[[int, int], Any] = points
    differentiable: bool = True  # False: integer results only (nothing to differentiate)
    dtype: Any = F32  # the float leaves of x and y (bfloat16: the half-precision cases)

    @property
    def oracle(self) -> Callable:
        """Plain JAX on the dense ``(N, M, ...)`` outputs of ``f``."""
        return oracle(self.reduction, axis=1)

    def inputs(self, n: int, m: int, d: int) -> tuple:
        """``(x, y)`` as ``ShapeDtypeStruct``s: ``n`` and ``m`` rows of ``d`` features,
        float leaves in :attr:`dtype`."""
        cast = lambda s: S(s.shape, self.dtype) if s.dtype == F32 else s
        return jax.tree.map(cast, (points(n, d), self.y(m, d)))

    def pair_args(self, d: int) -> tuple:
        """One x row and one y row (``ShapeDtypeStruct``s), for ``f``'s jaxpr."""
        return jax.tree.map(lambda s: S(s.shape[1:], s.dtype), self.inputs(1, 1, d))


def sqdist(xi, yj):
    return jnp.sum((xi - yj) ** 2)


def _softmax_pair(xi, yj):
    return -sqdist(xi, yj), jnp.stack([yj[0], jnp.sin(yj[1])])


def _two_heads(xi, yj):  # two scores per pair (heads), each weighing the same values
    return jnp.stack([-sqdist(xi, yj), -jnp.abs(xi - yj).sum()]), yj[:2]


def _two_leaves(xi, yj):
    d = sqdist(xi, yj)
    return {"sum": jnp.exp(-d), "near": d}


REDUCTIONS = [
    Pairwise("add", ajm.ADD, lambda a, b: jnp.exp(-sqdist(a, b))),
    # a vector per pair: KeOps' kernel sum with a signal of dimension 2
    Pairwise("vector_add", ajm.ADD, lambda a, b: jnp.exp(-sqdist(a, b)) * b[:2]),
    Pairwise("max", ajm.MAX, sqdist),
    Pairwise("min", ajm.MIN, sqdist),
    Pairwise("logsumexp", ajm.LOGSUMEXP, lambda a, b: -sqdist(a, b)),
    # two values per pair (exponent, weight): OTT-JAX's weighted Sinkhorn step
    Pairwise(
        "weighted_logsumexp", ajm.WEIGHTED_LOGSUMEXP, lambda a, b: (-sqdist(a, b), b[0] ** 2 + 0.1)
    ),
    Pairwise("argmin", ajm.ARGMIN, sqdist, differentiable=False),
    Pairwise("argmax", ajm.ARGMAX, sqdist, differentiable=False),
    Pairwise("min_argmin", ajm.MIN_ARGMIN, sqdist),
    Pairwise("max_argmax", ajm.MAX_ARGMAX, sqdist),
    Pairwise("top_k", ajm.top_k(3), sqdist),
    Pairwise("k_nearest", ajm.top_k(3, smallest=True), sqdist),
    Pairwise("mean", ajm.MEAN, sqdist),
    Pairwise("var", ajm.VAR, sqdist),
    Pairwise("softmax_weighted", ajm.SOFTMAX_WEIGHTED, _softmax_pair),
    Pairwise("softmax_two_heads", ajm.SOFTMAX_WEIGHTED, _two_heads),
    Pairwise("pytree", {"sum": ajm.ADD, "near": ajm.MIN_ARGMIN}, _two_leaves),
]

# -- the workloads ----------------------------------------------------------------------


def _with_one_float(m: int, d: int) -> tuple:
    return points(m, d), S((m,), F32)


def gaussian(p: float = 1.0) -> Pairwise:
    """KeOps' benchmark (``plot_benchmark_convolutions``), ``Exp(-p * SqDist(X,Y)) * B``
    with ``B = Vj(1)``: ``out_i = sum_j exp(-p |x_i - y_j|^2) b_j``, ``b`` one float per
    y row (``y = (points, b)``)."""

    def f(xi, yb):
        yj, bj = yb
        d = jnp.sum((xi - yj) ** 2)
        return jnp.exp(-d if p == 1 else -p * d) * bj

    return Pairwise("gaussian", ajm.ADD, f, _with_one_float)


KNN = Pairwise("knn", ajm.top_k(10, smallest=True), sqdist)  # the 10 nearest y rows
KNN_TOP8 = Pairwise("knn_top8", ajm.top_k(8, smallest=True), sqdist)  # the 8 nearest


def sinkhorn_pair(xi, yg):
    """``(g_j - C_ij) / eps`` for one pair: ``C`` the squared Euclidean cost."""
    yj, gj = yg
    return (gj - jnp.sum((xi - yj) ** 2)) / EPS


# a log-domain Sinkhorn half-step: y = (points, their potential g)
SINKHORN = Pairwise("sinkhorn", ajm.LOGSUMEXP, sinkhorn_pair, _with_one_float)


def attention(d: int) -> Pairwise:
    """One head: the softmax of ``q . k / sqrt(d)`` weighing the values, ``y = (k, v)``."""
    scale = 1.0 / d**0.5
    f = lambda q, kv: (jnp.dot(q, kv[0]) * scale, kv[1])
    return Pairwise("attention", ajm.SOFTMAX_WEIGHTED, f, lambda m, dim: (points(m, dim),) * 2)


# cross-entropy's logsumexp over the vocabulary: a token's logit for each of its rows
CROSS_ENTROPY = Pairwise("cross_entropy", ajm.LOGSUMEXP, jnp.dot)


# -- the matrix-unit grid (issue 41) ----------------------------------------------------

MATMUL_SIZES = ((8191, 16411), (30011, 100003))  # N x M rows: odd, so tiles are ragged
MATMUL_DTYPES = (F32, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class MatmulCase:
    """One point of the grid: ``case`` at ``n x m`` rows of ``d`` features."""

    case: Pairwise
    n: int
    m: int
    d: int

    @property
    def dtype(self) -> str:
        return jnp.dtype(self.case.dtype).name


def matmul_grid(quick: bool = False) -> list[MatmulCase]:
    """Attention (d = 16, 64, 128; float32 and bfloat16), k-NN top-8 at D = 128 and the
    Sinkhorn logsumexp at D = 64, at each of :data:`MATMUL_SIZES`; ``quick``: the
    smaller size and attention at d = 64 only (8 compiles with both passes)."""
    sizes = MATMUL_SIZES[:1] if quick else MATMUL_SIZES
    dims = (64,) if quick else (16, 64, 128)
    out = []
    for n, m in sizes:
        out += [
            MatmulCase(dataclasses.replace(attention(d), dtype=t), n, m, d)
            for d in dims
            for t in MATMUL_DTYPES
        ]
        out += [MatmulCase(KNN_TOP8, n, m, 128), MatmulCase(SINKHORN, n, m, 64)]
    return out
