"""``ajm.pairwise`` against KeOps, OTT-JAX, dense XLA and the nested ``batch_map`` form.

The cases (:func:`gaussian`, :func:`knn`, :func:`attention`, :func:`sinkhorn`: the workloads of
``cases/pairwise.py`` with their contenders; sizes in ``pairwise_report.py``):

* ``Gaussian kernel sum``: KeOps' own benchmark (``plot_benchmark_convolutions``:
  ``Exp(-SqDist(X,Y)) * B`` with ``B = Vj(1)``), ``out_i = sum_j exp(-|x_i - y_j|^2) b_j``,
  D = 3, float32, x, y, b standard normal; ``b`` is one float per y row, passed to
  ``pairwise`` as an ``(M,)`` vector so that ``f`` returns a scalar per pair (a context
  row passes it as ``(M, 1)`` rows, which ``f`` returns as ``(1,)`` values). Against
  pykeops ``Genred`` (CPU backend, float32), dense XLA (``exp(-sqdist) @ b`` on the
  ``N x M`` matrix, only where it fits) and today's nested form, ``batch_map`` over x
  chunks of ``batch_map(..., reduction=ajm.ADD)`` over y chunks, at ours' tiles;
* ``k-NN``: the 10 nearest y rows of each x row (D = 16, squared distances),
  ``ajm.top_k(10, smallest=True)``, against ``lax.top_k`` on dense blocks (``lax.map``
  over blocks of 1024 x rows, each block's distances to all of y by a matmul);
* ``attention``: one head, ``softmax(q k^T / sqrt(d)) v`` at d = 64 (the dot product
  runs on the matmul tiles), and its gradient with respect to q, k and v, against
  ``jax.nn.dot_product_attention(implementation="xla")``;
* ``Sinkhorn``: a fixed number of log-domain Sinkhorn iterations between two point
  clouds (D = 3, uniform weights, squared Euclidean cost), each iteration a g then an f
  half-step ``-eps * logsumexp_j((g_j - C_ij) / eps) + eps * log(1 / M)`` (OTT's order),
  written with ``ajm.pairwise(..., ajm.LOGSUMEXP)`` (the g half-step with x and y
  swapped; the uniform log-weights are added outside, ``ajm.WEIGHTED_LOGSUMEXP`` takes
  others), against OTT-JAX's dense ``PointCloud`` + ``Sinkhorn`` with the iterations
  fixed and the same loop in plain dense JAX.

Every contender's result is checked before it is timed: the Gaussian sums and the
k-NN distances against float64 NumPy on a sample of x rows (the k-NN indices through
their exact distances, so ties and near-ties may differ), the Sinkhorn potentials
against the dense loop run in float64; errors are ``max |out - ref| / max |ref|``.

``pairwise_report.py`` measures all of it in one process, interleaved, and writes
``bench/results/pairwise.{json,md}``; the tests below are the pytest-benchmark view
(``make bench``) at small sizes. pykeops and ott-jax are optional (the
``bench-pairwise`` extra): their contenders are skipped where they are not installed.
pykeops compiles its C++ at first use, into ``bench/.cache/keops``.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _timing import compile_fn
from cases import max_rel_error, pairwise
from cases.pairwise import EPS, KNN, SINKHORN, sinkhorn_pair
from jax import lax
from jax.extend import core as jax_core

import adv_jax_math as ajm

HERE = Path(__file__).resolve().parent
# pykeops reads it when first imported: its compiled formulas stay in the git-ignored cache
os.environ.setdefault("KEOPS_CACHE_FOLDER", str(HERE / ".cache" / "keops"))

GAUSSIAN = pairwise.gaussian()
K = KNN.reduction.k  # neighbours
KNN_DIM = 16
GAUSS_DIM = 3
SINKHORN_DIM = 3
DENSE_BLOCK = 1024  # x rows per block of the dense k-NN
OTT_BATCH = 2048  # rows per block of OTT's online PointCloud
DENSE_MAX_BYTES = 4 << 30  # a dense N x M float32 matrix runs where it fits in this
CHECK_ROWS = 1024  # x rows checked against float64 NumPy
RTOL = 1e-4  # of the reference's max abs
SINKHORN_RTOL = 1e-4

# The reduction's own flops per pair and output element (the f part is counted from
# f's jaxpr, :func:`pair_flops`): ADD an add; LOGSUMEXP the shift by the running
# maximum, the exp and the add (the maximum itself is a comparison); top_k none.
REDUCTION_FLOPS = {"add": 1, "logsumexp": 3, "top_k": 0, "softmax_weighted": 3}


# -- flops ------------------------------------------------------------------------------------

_ELEMENTWISE = {
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "max",
    "min",
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "sqrt",
    "rsqrt",
    "abs",
    "pow",
    "integer_pow",
    "square",
    "tanh",
    "logistic",
    "sin",
    "cos",
    "erf",
    "atan2",
}
_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"}


def _size(aval: Any) -> int:
    return math.prod(aval.shape)


def _count(jaxpr: Any) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _ELEMENTWISE:
            total += sum(_size(v.aval) for v in eqn.outvars)
        elif name in _REDUCE:
            total += _size(eqn.invars[0].aval) - _size(eqn.outvars[0].aval)
        elif name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            k = math.prod(eqn.invars[0].aval.shape[i] for i in contract)
            total += 2 * k * _size(eqn.outvars[0].aval)
        for sub in jax_core.jaxprs_in_params(eqn.params):
            total += _count(sub)
    return total


def pair_flops(f: Callable, xi: Any, yj: Any) -> int:
    """Floating-point operations of ``f`` on one pair, counted in its jaxpr: each
    elementwise arithmetic operation (``exp`` and ``x ** 2`` included) one per element,
    a sum of ``n`` elements ``n - 1``, a dot product ``2 k`` per output; comparisons,
    selects, conversions and layout none."""
    return _count(jax.make_jaxpr(f)(xi, yj).jaxpr)


def roofline_flops(f: Callable, xi: Any, yj: Any) -> float | None:
    """``jax.experimental.roofline``'s ``unfused_flops`` of ``f`` on one pair (a
    cross-check of :func:`pair_flops`; None where this jax has no roofline)."""
    try:
        from jax.experimental import roofline

        return float(roofline.roofline(f)(xi, yj)[1].unfused_flops)
    except Exception:
        return None


# -- contenders and cases ---------------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    """One way to compute a case: ``fn`` of the case's arguments.

    A JAX contender is compiled (``_timing.compile_fn``) and called on the arguments; a
    ``host`` one (pykeops) is a NumPy function, called on NumPy copies of them."""

    name: str
    fn: Callable
    engine: str
    ours: bool = False
    host: bool = False
    needs: str | None = None  # the optional module it imports (skipped without it)
    context: bool = False  # shown for context, not a contender the issue asks for
    rounds: int | None = None  # timed rounds (None: the case's; 0: timed by its check)
    plan: Callable | None = None  # args -> ajm.PairwisePlan (ours)

    def build(self, args: tuple) -> tuple[Callable[[], Any], float]:
        """A call of no arguments, and what preparing it took (compile seconds; for
        pykeops its first call on a few rows, which compiles the formula once)."""
        if self.host:
            host_args = tuple(np.asarray(a) for a in args)
            small = tuple(a[:8] for a in host_args)
            t = _seconds(lambda: self.fn(*small))
            return lambda: self.fn(*host_args), t
        compiled = compile_fn(self.fn, args)
        exe = compiled.executable
        return lambda: exe(*args), compiled.seconds


def _seconds(call: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Case:
    """A workload at one size, its contenders and its check."""

    name: str
    size: str
    description: str
    n: int
    m: int
    dim: int
    pairs: int  # f evaluations per call
    pair_fn: Callable  # ours' f, for the flop count
    pair_args: tuple  # one x row and one y row (ShapeDtypeStructs are fine)
    reduction: str  # a key of REDUCTION_FLOPS
    make_args: Callable[[], tuple]
    contenders: tuple[Contender, ...]
    reference: Callable[[tuple], Any]  # args -> the reference (host arrays)
    compare: Callable[[Any, Any, tuple], dict]  # (output, reference, args) -> errors; raises
    rounds: int = 5
    skipped: tuple[tuple[str, str], ...] = ()  # (contender, why not run)

    def __str__(self) -> str:
        return f"{self.name} {self.size}"

    def args(self) -> tuple:
        return _cached(self, "args", lambda: jax.block_until_ready(self.make_args()))

    def expected(self) -> Any:
        return _cached(self, "reference", lambda: self.reference(self.args()))

    def flops_per_pair(self) -> int:
        return pair_flops(self.pair_fn, *self.pair_args) + REDUCTION_FLOPS[self.reduction]

    def verify(self, contender: Contender, out: Any) -> dict:
        """``contender``'s output against the reference; AssertionError when wrong."""
        out = jax.tree.map(np.asarray, out)
        return self.compare(out, self.expected(), self.args())


_CACHE: dict[tuple, Any] = {}


def _cached(case: Case, what: str, make: Callable[[], Any]) -> Any:
    """One case's arguments and reference at a time (the large ones take GiBs)."""
    key = (case.name, case.size, what)
    if key not in _CACHE:
        if not any(k[:2] == key[:2] for k in _CACHE):
            _CACHE.clear()
        _CACHE[key] = make()
    return _CACHE[key]


def _check_rows(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, min(n, CHECK_ROWS), replace=False))


def _normal(seed: int, *shapes: tuple[int, ...]) -> tuple:
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return tuple(jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True))


def _fits(n: int, m: int) -> bool:
    return 4 * n * m <= DENSE_MAX_BYTES


def _skip_dense(n: int, m: int) -> str:
    return f"the dense {n} x {m} float32 matrix takes {4 * n * m / 2**30:.0f} GiB"


# -- Gaussian kernel sum ----------------------------------------------------------------------


gauss_pair = GAUSSIAN.f  # one pair of KeOps' ``Exp(-SqDist(X,Y)) * B``: ``b_j`` a scalar


def ours_gauss(x, y, b):
    return ajm.pairwise(gauss_pair, x, (y, b), ajm.ADD)


def ours_gauss_rows(x, y, b):
    """``b`` as ``(M, 1)`` rows: ``f`` returns a ``(1,)`` value per pair."""
    return ajm.pairwise(gauss_pair, x, (y, b[:, None]), ajm.ADD)


def gauss_plan(x, y, b) -> ajm.PairwisePlan:
    return ajm.explain_pairwise(gauss_pair, x, (y, b), ajm.ADD)


def gauss_rows_plan(x, y, b) -> ajm.PairwisePlan:
    return ajm.explain_pairwise(gauss_pair, x, (y, b[:, None]), ajm.ADD)


def nested_gauss(bi: int, bj: int, as_written: bool = False) -> Callable:
    """The nested per-chunk form: ``batch_map`` over x chunks of ``bi`` rows of a
    ``batch_map`` over y chunks of ``bj`` rows reducing ``(bj, bi)`` blocks with ADD,
    which the planner reads as a pairwise reduction; ``as_written``: its result + 0,
    which it does not (a post-processed result), run as nested loops as before."""

    def block(yc, xc):
        yy, bb = yc
        return jnp.exp(-jnp.sum((yy[:, None, :] - xc[None, :, :]) ** 2, -1)) * bb[:, None]

    def per_chunk(y, b):
        inner = lambda xc: ajm.batch_map(lambda yc: block(yc, xc), (y, b), bj, reduction=ajm.ADD)
        return (lambda xc: inner(xc) + 0.0) if as_written else inner

    return lambda x, y, b: ajm.batch_map(per_chunk(y, b), x, bi)


def dense_gauss(x, y, b):
    """KeOps' PyTorch benchmark in XLA: ``|x|^2 - 2 x.y + |y|^2`` by a matmul, then
    ``exp(-D) @ b`` on the ``N x M`` matrix."""
    sq = jnp.sum(x * x, -1)[:, None] - 2 * x @ y.T + jnp.sum(y * y, -1)[None]
    return jnp.exp(-sq) @ b


@functools.cache
def keops_gauss_routine() -> Callable:
    from pykeops.numpy import Genred

    return Genred(
        "Exp(-SqDist(X,Y)) * B",
        [f"X = Vi({GAUSS_DIM})", f"Y = Vj({GAUSS_DIM})", "B = Vj(1)"],
        reduction_op="Sum",
        axis=1,
    )


def keops_gauss(x, y, b):
    return keops_gauss_routine()(x, y, b[:, None], backend="CPU")


def _gauss_reference(args) -> tuple[np.ndarray, np.ndarray]:
    """The sampled x rows and their sums, in float64 NumPy."""
    x, y, b = (np.asarray(a, np.float64) for a in args)
    rows = _check_rows(x.shape[0])
    parts = np.array_split(rows, max(1, len(rows) // 64))
    ref = [np.exp(-np.sum((x[r, None, :] - y[None]) ** 2, -1)) @ b for r in parts]
    return rows, np.concatenate(ref)


def _gauss_compare(out, ref, args) -> dict:
    rows, expect = ref
    got = np.asarray(out).reshape(-1)  # (N,) from ours, (N, 1) from pykeops
    assert got.shape == (args[0].shape[0],), got.shape
    err = max_rel_error(got[rows], expect)
    assert err <= RTOL, f"relative error {err:.2e} > {RTOL:g}"
    return {"rel_error": err, "checked_rows": len(rows)}


def gaussian(n: int, *, rounds: int = 5, slow_rounds: int | None = None) -> Case:
    """The Gaussian kernel sum at ``N = M = n``; ``slow_rounds`` for the nested form,
    pykeops and the ``(M, 1)`` context row (their check call is one more sample where
    0)."""
    x, (y, b) = GAUSSIAN.inputs(n, n, GAUSS_DIM)
    bi, bj = gauss_plan(x, y, b).tiles
    contenders = [
        Contender("ours: pairwise", ours_gauss, "", ours=True, plan=gauss_plan),
        Contender(
            "pykeops Genred (CPU)",
            keops_gauss,
            "pykeops 2.3 Genred, backend='CPU' (g++ -O3 -fopenmp, its defaults)",
            host=True,
            needs="pykeops",
            rounds=slow_rounds,
        ),
        Contender(
            "nested batch_map",
            nested_gauss(bi, bj, as_written=True),
            f"batch_map over {bi}-row x chunks of batch_map(ADD) over {bj}-row y chunks, "
            "run as written (its result + 0: the outer call not read as pairwise): a loop "
            "over x chunks, each inner call on the pairwise tiles (it closes over its chunk)",
            rounds=slow_rounds,
        ),
        Contender(
            "nested batch_map, read as pairwise",
            nested_gauss(bi, bj),
            "the same nested calls as users write them: the planner reads them as a "
            f"pairwise reduction, tiles {bi} x {bj}",
            context=True,
            rounds=slow_rounds,
        ),
    ]
    skipped = []
    if _fits(n, n):
        contenders.append(Contender("dense XLA", dense_gauss, "XLA: exp(-D) @ b, D dense"))
    else:
        skipped.append(("dense XLA", _skip_dense(n, n)))
    if n * n <= 10**8:
        contenders.append(
            Contender(
                "ours: pairwise, b as (M, 1) rows",
                ours_gauss_rows,
                "",
                ours=True,
                context=True,
                plan=gauss_rows_plan,
                rounds=slow_rounds,
            )
        )
    else:
        skipped.append(("ours: pairwise, b as (M, 1) rows", "context row: small sizes only"))
    return Case(
        "Gaussian kernel sum",
        f"N = M = {n:.0e}".replace("e+0", "e"),
        f"out_i = sum_j exp(-|x_i - y_j|^2) b_j, D = {GAUSS_DIM}, float32, x, y, b ~ N(0, 1), "
        "b one float per y row (KeOps' B = Vj(1))",
        n,
        n,
        GAUSS_DIM,
        n * n,
        gauss_pair,
        GAUSSIAN.pair_args(GAUSS_DIM),
        "add",
        lambda: _normal(0, (n, GAUSS_DIM), (n, GAUSS_DIM), (n,)),
        tuple(contenders),
        _gauss_reference,
        _gauss_compare,
        rounds=rounds,
        skipped=tuple(skipped),
    )


# -- k-NN -------------------------------------------------------------------------------------


def ours_knn(x, y):
    return ajm.pairwise(KNN.f, x, y, KNN.reduction)


def knn_plan(x, y) -> ajm.PairwisePlan:
    return ajm.explain_pairwise(KNN.f, x, y, KNN.reduction)


def dense_knn(x, y):
    """``lax.map`` over blocks of ``DENSE_BLOCK`` x rows: each block's squared distances
    to every y row (``|y|^2 - 2 y.x + |x|^2``, a matmul) and ``lax.top_k`` of their
    negatives."""
    yy = jnp.sum(y * y, -1)

    def row(xi):
        d = yy - 2 * (y @ xi) + jnp.sum(xi * xi)
        v, i = lax.top_k(-d, K)
        return -v, i

    return lax.map(row, x, batch_size=DENSE_BLOCK)


def _exact_sq_dist(x: np.ndarray, y: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """float64 squared distances of each x row to the y rows ``idx`` names, ``(rows, K)``."""
    return np.sum((x[:, None, :] - y[idx]) ** 2, -1)


def _knn_reference(args) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sampled x rows, their exact k nearest y rows and distances (float64 NumPy)."""
    x, y = (np.asarray(a, np.float64) for a in args)
    rows = _check_rows(x.shape[0])
    yy, dists, idxs = np.sum(y * y, -1), [], []
    for r in np.array_split(rows, max(1, len(rows) // 32)):
        d = yy[None] - 2 * x[r] @ y.T  # + |x|^2: the same for a row
        part = np.argpartition(d, K - 1, axis=1)[:, :K]
        exact = _exact_sq_dist(x[r], y, part)
        order = np.argsort(exact, 1, kind="stable")
        dists.append(np.take_along_axis(exact, order, 1))
        idxs.append(np.take_along_axis(part, order, 1))
    return rows, np.concatenate(dists), np.concatenate(idxs)


def _knn_compare(out, ref, args) -> dict:
    """The returned indices through their exact distances: sorted, they equal the exact
    ``k`` smallest; the returned values equal the exact distances of the returned
    indices (both to ``RTOL`` of the largest). Ties and near-ties may pick other rows."""
    values, idx = (np.asarray(o) for o in out)
    rows, ref_d, ref_i = ref
    n = args[0].shape[0]
    assert values.shape == idx.shape == (n, K), (values.shape, idx.shape)
    x, y = (np.asarray(a, np.float64) for a in args)
    got_d = _exact_sq_dist(x[rows], y, idx[rows].astype(np.int64))
    set_err = max_rel_error(np.sort(got_d, 1), ref_d)
    value_err = max_rel_error(values[rows], got_d)
    assert set_err <= RTOL, f"neighbour distances off by {set_err:.2e} (relative)"
    assert value_err <= RTOL, f"values off by {value_err:.2e} (relative)"
    same = np.all(np.sort(idx[rows], 1) == np.sort(ref_i, 1), 1)
    return {
        "rel_error": max(set_err, value_err),
        "distance_rel_error": set_err,
        "value_rel_error": value_err,
        "rows_same_indices": float(np.mean(same)),
        "checked_rows": len(rows),
    }


def knn(n: int, *, rounds: int = 3) -> Case:
    """The ``K`` nearest of ``n`` y rows for each of ``n`` x rows, D = ``KNN_DIM``."""
    return Case(
        f"k-NN top-{K}",
        f"N = M = {n:.0e}".replace("e+0", "e"),
        f"the {K} nearest y rows of each x row by squared distance, D = {KNN_DIM}, float32, "
        "x, y ~ N(0, 1); values and indices",
        n,
        n,
        KNN_DIM,
        n * n,
        KNN.f,
        KNN.pair_args(KNN_DIM),
        "top_k",
        lambda: _normal(1, (n, KNN_DIM), (n, KNN_DIM)),
        (
            Contender("ours: pairwise", ours_knn, "", ours=True, plan=knn_plan),
            Contender(
                f"lax.top_k on dense {DENSE_BLOCK}-row blocks",
                dense_knn,
                f"lax.map over {DENSE_BLOCK} x rows: matmul distances to all y, lax.top_k",
            ),
        ),
        _knn_reference,
        _knn_compare,
        rounds=rounds,
    )


# -- attention ---------------------------------------------------------------------------------

ATTENTION_DIM = 64
ATTENTION = pairwise.attention(ATTENTION_DIM)


def ours_attention(q, k, v):
    return ajm.pairwise(ATTENTION.f, q, (k, v), ATTENTION.reduction)


def xla_attention(q, k, v):
    """``jax.nn.dot_product_attention`` (``implementation="xla"``), one batch and head."""
    one = lambda a: a[None, :, None]  # (batch, tokens, heads, features)
    return jax.nn.dot_product_attention(one(q), one(k), one(v), implementation="xla")[0, :, 0]


def attention_grad(fn: Callable) -> Callable:
    """The gradient with respect to ``q``, ``k`` and ``v`` of ``sum(fn(q, k, v) * w)``."""
    return lambda q, k, v, w: jax.grad(lambda *a: jnp.sum(fn(*a) * w), (0, 1, 2))(q, k, v)


def _attention_reference(grad: bool) -> Callable:
    """float64 NumPy on the float32 inputs, 512 queries at a time: the output at the
    check rows, or (``grad``) the gradients with respect to q, k and v (flash attention's
    formulas: dS = P (dO V^T - delta), delta = rowsum(dO O))."""

    def reference(args) -> Any:
        q, k, v, *w = (np.asarray(a, np.float64) for a in args)
        scale = 1 / math.sqrt(q.shape[1])
        rows = np.arange(q.shape[0]) if grad else _check_rows(q.shape[0])
        dq, dk, dv, outs = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v), []
        for r in np.array_split(rows, max(1, len(rows) // 512)):
            s = q[r] @ k.T * scale
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            outs.append(p @ v)
            if grad:
                do = w[0][r]
                ds = p * (do @ v.T - np.sum(do * outs[-1], 1, keepdims=True))
                dq[r], dk, dv = ds @ k * scale, dk + ds.T @ q[r] * scale, dv + p.T @ do
        return (dq, dk, dv) if grad else (rows, np.concatenate(outs))

    return reference


def _attention_compare(grad: bool) -> Callable:
    def compare(out, ref, args) -> dict:
        if grad:
            errors = [max_rel_error(np.asarray(o), r) for o, r in zip(out, ref, strict=True)]
        else:
            rows, want = ref
            errors = [max_rel_error(np.asarray(out)[rows], want)]
        assert max(errors) <= RTOL, f"off by {max(errors):.2e} (relative)"
        return {"rel_error": max(errors)}

    return compare


def attention(n: int, grad: bool = False, *, rounds: int = 3) -> Case:
    """One attention head over ``n`` queries and ``n`` keys, d = ``ATTENTION_DIM``, or
    (``grad``) its gradient with respect to q, k and v."""
    fns = (ours_attention, xla_attention)
    if grad:
        fns = tuple(map(attention_grad, fns))
    what = "the output"
    if grad:  # (its flops per pair counted as the forward's)
        what = "the gradient w.r.t. q, k, v of sum(out * w) (flops: the forward's)"
    return Case(
        "attention" + (" gradient" if grad else ""),
        f"N = M = {n}",
        f"softmax(q k^T / sqrt(d)) v, d = {ATTENTION_DIM}, float32, q, k, v ~ N(0, 1); {what}",
        n,
        n,
        ATTENTION_DIM,
        n * n,
        ATTENTION.f,
        ATTENTION.pair_args(ATTENTION_DIM),
        "softmax_weighted",
        lambda: _normal(3, *[(n, ATTENTION_DIM)] * (4 if grad else 3)),
        (
            Contender("ours: pairwise", fns[0], "", ours=True, plan=attention_plan),
            Contender(
                "jax.nn.dot_product_attention",
                fns[1],
                "implementation='xla': the N x M scores stored",
            ),
        ),
        _attention_reference(grad),
        _attention_compare(grad),
        rounds=rounds,
    )


def attention_plan(q, k, v, *_) -> ajm.PairwisePlan:
    return ajm.explain_pairwise(ATTENTION.f, q, (k, v), ATTENTION.reduction)


# -- Sinkhorn ---------------------------------------------------------------------------------


def ours_sinkhorn(iterations: int) -> Callable:
    def f(x, y):
        la, lb = -jnp.log(x.shape[0]), -jnp.log(y.shape[0])  # uniform weights

        def body(_, fg):
            f, g = fg
            g = EPS * lb - EPS * ajm.pairwise(sinkhorn_pair, y, (x, f), ajm.LOGSUMEXP)
            f = EPS * la - EPS * ajm.pairwise(sinkhorn_pair, x, (y, g), ajm.LOGSUMEXP)
            return f, g

        init = (jnp.zeros(x.shape[0], x.dtype), jnp.zeros(y.shape[0], y.dtype))
        return lax.fori_loop(0, iterations, body, init)

    return f


def sinkhorn_plan(x, y) -> ajm.PairwisePlan:
    f = jax.ShapeDtypeStruct((x.shape[0],), x.dtype)
    return ajm.explain_pairwise(sinkhorn_pair, y, (x, f), ajm.LOGSUMEXP)


def dense_sinkhorn(iterations: int) -> Callable:
    """The same loop on the dense cost matrix (``jax.nn.logsumexp`` along each axis)."""

    def f(x, y):
        c = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)
        la, lb = -jnp.log(x.shape[0]), -jnp.log(y.shape[0])

        def body(_, fg):
            f, g = fg
            g = EPS * lb - EPS * jax.nn.logsumexp((f[:, None] - c) / EPS, axis=0)
            f = EPS * la - EPS * jax.nn.logsumexp((g[None, :] - c) / EPS, axis=1)
            return f, g

        init = (jnp.zeros(x.shape[0], x.dtype), jnp.zeros(y.shape[0], y.dtype))
        return lax.fori_loop(0, iterations, body, init)

    return f


def ott_sinkhorn(iterations: int, batch_size: int | None = None) -> Callable:
    """OTT-JAX: a ``PointCloud`` (squared Euclidean cost, ``epsilon=EPS``; dense, or
    online in blocks of ``batch_size`` rows) and ``Sinkhorn`` with exactly
    ``iterations`` iterations (``min_iterations = max_iterations``, a threshold no error
    reaches; lse mode, OTT's default)."""

    def f(x, y):
        from ott.geometry import pointcloud
        from ott.problems.linear import linear_problem
        from ott.solvers.linear import sinkhorn

        geom = pointcloud.PointCloud(x, y, epsilon=EPS, batch_size=batch_size)
        solver = sinkhorn.Sinkhorn(
            threshold=-1.0,
            min_iterations=iterations,
            max_iterations=iterations,
            inner_iterations=iterations,
        )
        out = solver(linear_problem.LinearProblem(geom))
        return out.f, out.g

    return f


def _sinkhorn_reference(iterations: int) -> Callable:
    """The dense loop in float64 (``jax.enable_x64``), on the float32 points."""

    def reference(args) -> tuple[np.ndarray, np.ndarray]:
        with jax.enable_x64(True):
            x, y = (jnp.asarray(np.asarray(a), jnp.float64) for a in args)
            f, g = jax.jit(dense_sinkhorn(iterations))(x, y)
            return np.asarray(f), np.asarray(g)

    return reference


def _sinkhorn_compare(out, ref, args) -> dict:
    f, g = (np.asarray(o).reshape(-1) for o in out)
    rf, rg = ref
    assert f.shape == rf.shape and g.shape == rg.shape, (f.shape, g.shape)
    ef, eg = max_rel_error(f, rf), max_rel_error(g, rg)
    assert max(ef, eg) <= SINKHORN_RTOL, f"potentials off by {ef:.2e} (f), {eg:.2e} (g)"
    return {"rel_error": max(ef, eg), "f_rel_error": ef, "g_rel_error": eg}


def _uniform_clouds(n: int, m: int) -> tuple:
    kx, ky = jax.random.split(jax.random.key(2))
    return (
        jax.random.uniform(kx, (n, SINKHORN_DIM), jnp.float32),
        jax.random.uniform(ky, (m, SINKHORN_DIM), jnp.float32),
    )


def sinkhorn(n: int, iterations: int = 50, *, rounds: int = 3) -> Case:
    """``iterations`` Sinkhorn iterations between ``n`` and ``n`` points in the unit cube."""
    return Case(
        "Sinkhorn",
        f"N = M = {n:.0e}, {iterations} it.".replace("e+0", "e"),
        f"{iterations} log-domain Sinkhorn iterations (g then f half-step), eps = {EPS}, "
        f"D = {SINKHORN_DIM}, x, y ~ U[0, 1)^3, uniform weights, squared Euclidean cost; "
        "the potentials (f, g)",
        n,
        n,
        SINKHORN_DIM,
        2 * iterations * n * n,
        sinkhorn_pair,
        SINKHORN.pair_args(SINKHORN_DIM),
        "logsumexp",
        lambda: _uniform_clouds(n, n),
        (
            Contender(
                "ours: pairwise",
                ours_sinkhorn(iterations),
                "",
                ours=True,
                plan=sinkhorn_plan,
            ),
            Contender(
                "OTT-JAX dense",
                ott_sinkhorn(iterations),
                "ott-jax 0.6 PointCloud (dense cost matrix) + Sinkhorn (lse mode)",
                needs="ott",
            ),
            Contender(
                "dense JAX loop",
                dense_sinkhorn(iterations),
                "lax.fori_loop of jax.nn.logsumexp on the dense cost matrix",
            ),
            Contender(
                "OTT-JAX online",
                ott_sinkhorn(iterations, OTT_BATCH),
                f"ott-jax 0.6 PointCloud(batch_size={OTT_BATCH}): the cost in blocks, online",
                needs="ott",
                context=True,
            ),
        ),
        _sinkhorn_reference(iterations),
        _sinkhorn_compare,
        rounds=rounds,
    )


# -- pytest-benchmark -------------------------------------------------------------------------

BENCH_CASES = (gaussian(2000), knn(4096), sinkhorn(1000, 10))
RUN_PARAMS = [(c, e) for c in BENCH_CASES for e in c.contenders]


@pytest.mark.parametrize(
    ("case", "contender"), RUN_PARAMS, ids=[f"{c}-{e.name}" for c, e in RUN_PARAMS]
)
def test_run_time(benchmark, case: Case, contender: Contender):
    """Checked against the reference, then timed (the check's call is the warm-up). A
    context contender that cannot run is an expected failure (OTT-JAX 0.6's online
    PointCloud on jax 0.12: ``jax.interpreters.batching.is_vmappable`` is gone)."""
    if contender.needs:
        pytest.importorskip(contender.needs)
    try:
        call, _ = contender.build(case.args())
        out = jax.block_until_ready(call())
    except Exception as e:
        if not contender.context:
            raise
        pytest.xfail(f"{contender.name}: {type(e).__name__}: {e}".splitlines()[0])
    benchmark.group = f"pairwise: {case}"
    benchmark.extra_info.update(case.verify(contender, out))
    if contender.plan is not None:
        benchmark.extra_info["engine"] = contender.plan(*case.args()).engine
    benchmark.pedantic(lambda: jax.block_until_ready(call()), rounds=3, warmup_rounds=0)


def test_flops_per_pair():
    """The jaxpr count of each case's f, against hand counts (a Gaussian pair: 3 sub, 3
    squares, 2 adds, neg, exp, mul; k-NN: 16 + 16 + 15; Sinkhorn: 3 + 3 + 2, sub, div)
    plus the reduction's."""
    assert [c.flops_per_pair() for c in BENCH_CASES] == [11 + 1, 47, 10 + 3]
