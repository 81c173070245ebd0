"""``adv_jax_math.ott.PointCloud`` against OTT-JAX's own dense ``PointCloud``.

A Sinkhorn solve through our geometry equals the dense one (cost, potentials and
gradients, with implicit and with unrolled differentiation) at 2000 x 1500; OTT's
options (costs, ``scale_cost``, default ``epsilon``, kernel mode, the batched signed
transport of implicit differentiation) at small sizes; the weighted lse kernel on a
pairwise engine (not the scan) at temp memory near the unweighted one; the pytree;
bad input. ott-jax comes with the ``test`` extra: nothing here is skipped.
"""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ott.geometry import costs
from ott.geometry import pointcloud as ott_pointcloud
from ott.problems.linear import linear_problem
from ott.solvers import linear
from ott.solvers.linear import implicit_differentiation, sinkhorn

from adv_jax_math.ott import PointCloud

N, M, D = 2000, 1500, 16


def rel(a, b) -> float:
    """The largest difference over the pytrees, relative to the largest value of ``b``."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(jnp.max(jnp.abs(u - v)) / jnp.max(jnp.abs(v))) for u, v in pairs)


def clouds(n: int, m: int, d: int, seed: int = 0):
    kx, ky, ka = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (n, d))
    y = 0.8 * jax.random.normal(ky, (m, d)) + 0.3
    a = jax.random.uniform(ka, (n,)) + 0.5
    return x, y, a / a.sum(), jnp.full((m,), 1.0 / m)


def solve_and_grad(cls, implicit: bool, size: tuple[int, int, int]):
    """``reg_ot_cost`` of a Sinkhorn solve, its potentials, and its gradients with
    respect to the x points, the y points and the weights a."""
    x, y, a, b = clouds(*size)
    diff = implicit_differentiation.ImplicitDiff() if implicit else None
    solver = sinkhorn.Sinkhorn(threshold=1e-3, max_iterations=200, implicit_diff=diff)

    def cost(x, y, a):
        out = solver(linear_problem.LinearProblem(cls(x, y, epsilon=1.0), a, b))
        return out.reg_ot_cost, (out.f, out.g, out.n_iters)

    return jax.jit(jax.value_and_grad(cost, argnums=(0, 1, 2), has_aux=True))(x, y, a)


@pytest.mark.parametrize(
    ("implicit", "size"),
    [
        (True, (N, M, D)),
        pytest.param(False, (N, M, D), marks=pytest.mark.slow),  # 13 s on 2 cores
        (False, (400, 300, D)),
    ],
    ids=["implicit", "unrolled", "unrolled-400x300"],
)
def test_sinkhorn_equals_dense(implicit, size):
    """At 2000 x 1500 (unrolled: the slow run; 400 x 300 by default)."""
    (cost, (f, g, iters)), grads = solve_and_grad(PointCloud, implicit, size)
    (want, (wf, wg, witers)), wgrads = solve_and_grad(ott_pointcloud.PointCloud, implicit, size)
    assert int(iters) == int(witers)
    assert rel(cost, want) < 1e-6
    assert rel((f, g), (wf, wg)) < 1e-5
    for got, dense in zip(grads, wgrads, strict=True):  # x, y, a
        assert rel(got, dense) < 1e-4


SMALL = clouds(200, 150, 3, seed=1)[:2]
OPTIONS = {  # cost_fn, scale_cost, epsilon (None: OTT's default, from the costs' std)
    "sqeuclidean-max_cost": (costs.SqEuclidean(), "max_cost", 0.05),
    "euclidean-mean": (costs.Euclidean(), "mean", 0.1),
    "pnorm-default_epsilon": (costs.PNormP(1.5), 2.0, None),
    "sqeuclidean-max_bound": (None, "max_bound", 0.05),
    "negdot-max_norm": (costs.NegDotProduct(), "max_norm", 0.5),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_equal_dense(option):
    cost_fn, scale_cost, eps = OPTIONS[option]
    v = jax.random.normal(jax.random.key(2), (150, 4))

    @jax.jit
    def run(x, y, v):
        out = []
        for cls in (PointCloud, ott_pointcloud.PointCloud):
            geom = cls(x, y, cost_fn=cost_fn, scale_cost=scale_cost, epsilon=eps)
            sol = linear.solve(geom)
            out.append(
                (
                    (geom.inv_scale_cost, geom.epsilon),
                    (sol.f, sol.g, sol.reg_ot_cost),
                    geom.apply_square_cost(v, axis=1),
                )
            )
        return out

    (scale, solution, square), (want_scale, want_solution, want_square) = run(*SMALL, v)
    assert rel(scale, want_scale) < 1e-5
    assert rel(solution, want_solution) < 1e-5
    assert rel(square, want_square) < 1e-5


def test_kernel_mode_and_transport_equal_dense():
    v = jax.random.normal(jax.random.key(3), (3, 200))  # signed, batched: implicit diff's form

    @jax.jit
    def run(x, y, v):
        out = []
        for cls in (PointCloud, ott_pointcloud.PointCloud):
            geom = cls(x, y, epsilon=0.5)
            kernel, lse = linear.solve(geom, lse_mode=False), linear.solve(geom)
            out.append(
                (
                    (kernel.f, kernel.g, kernel.reg_ot_cost),
                    (lse.apply(v, axis=0), lse.apply(v[0, :150], axis=1)),
                    (lse.marginal(0), lse.marginal(1)),
                )
            )
        return out

    got, want = run(*SMALL, v)
    for part, dense in zip(got, want, strict=True):
        assert rel(part, dense) < 1e-5


def test_apply_kernel_at_another_epsilon_equals_float64():
    """OTT's dense ``apply_kernel(vec, eps)`` raises the stored kernel to a power
    (``K ** (epsilon / eps)``), whose entries underflowed at the geometry's epsilon;
    ours evaluates ``exp(-C / eps)`` for each pair."""
    ours = PointCloud(*SMALL, scale_cost="max_cost")
    v = jax.random.normal(jax.random.key(4), (200, 2))
    cost = np.asarray(ott_pointcloud.PointCloud(*SMALL, scale_cost="max_cost").cost_matrix)
    want = np.exp(-cost.astype(np.float64) / 0.7).T @ np.asarray(v, np.float64)
    assert rel(ours.apply_kernel(v, 0.7, axis=0), want) < 1e-5


def test_tiles_batch_size_and_the_pytree():
    geom = PointCloud(*SMALL, epsilon=0.1, tiles=(64, 32), batch_size=16)
    assert not geom.is_online  # OTT's online code never runs
    _, aux = geom.tree_flatten()
    assert aux["tiles"] == (64, 32) and aux["batch_size"] == 16
    again = jax.tree.unflatten(*reversed(jax.tree.flatten(geom)))
    assert type(again) is PointCloud and again.tiles == (64, 32)
    assert type(geom.subset(row_ixs=jnp.arange(10))) is PointCloud
    assert geom.explain_lse_kernel(axis=1).tiles == (64, 32)
    assert geom.explain_lse_kernel(axis=0).tiles == (32, 64)  # y points first there
    f = jax.random.normal(jax.random.key(5), (200,))
    g = jax.random.normal(jax.random.key(6), (150,))
    lse = jax.jit(lambda geom, f, g: geom.apply_lse_kernel(f, g, 0.1, axis=1)[0])
    want = ott_pointcloud.PointCloud(*SMALL, epsilon=0.1).apply_lse_kernel(f, g, 0.1, axis=1)[0]
    assert rel(lse(geom, f, g), want) < 1e-6
    assert rel(lse(PointCloud(*SMALL, epsilon=0.1), f, g), want) < 1e-6


@pytest.mark.parametrize("axis", [0, 1])
def test_weighted_lse_kernel_runs_on_the_pairwise_engine(axis):
    """The signed weighted form (implicit differentiation's) takes a pairwise engine,
    not the scan, at temp memory within 2x of the unweighted call."""
    x, y, _, _ = clouds(N, M, D)
    geom = PointCloud(x, y, epsilon=1.0)
    plan = geom.explain_lse_kernel(axis=axis, weighted=True)
    assert plan.engine.startswith("pairwise") and "scan" not in plan.engine, str(plan)
    assert "weighted_logsumexp(return_sign=True)" in plan.reduction
    f, g = jnp.zeros(N), jnp.zeros(M)
    vec = jnp.ones(N if axis == 0 else M)

    def temp(fn):
        compiled = jax.jit(fn).lower(f, g, vec).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plain = temp(lambda f, g, v: geom.apply_lse_kernel(f, g, 1.0, axis=axis))
    weighted = temp(lambda f, g, v: geom.apply_lse_kernel(f, g, 1.0, vec=v, axis=axis))
    assert weighted <= 2 * plain, (weighted, plain)
    assert weighted < N * M * 4 / 4  # far below one N x M matrix of float32


BAD = {
    "x-1d": (lambda: PointCloud(jnp.zeros(5)), ValueError, "shape (points, features)"),
    "features": (
        lambda: PointCloud(jnp.zeros((5, 3)), jnp.zeros((4, 2))),
        ValueError,
        "different numbers of features",
    ),
    "cost_fn": (
        lambda: PointCloud(*SMALL, cost_fn=lambda a, b: 0.0),
        TypeError,
        "not an ott.geometry.costs.CostFn",
    ),
    "median": (lambda: PointCloud(*SMALL, scale_cost="median"), NotImplementedError, "median"),
    "scale": (lambda: PointCloud(*SMALL, scale_cost="std"), ValueError, "scale_cost='std'"),
    "tiles": (lambda: PointCloud(*SMALL, tiles=(0, 8)), ValueError, "tiles=(0, 8)"),
    "batch_size": (lambda: PointCloud(*SMALL, batch_size=-1), ValueError, "batch_size=-1"),
    "axis": (lambda: PointCloud(*SMALL).apply_kernel(jnp.ones(200), axis=2), ValueError, "axis=2"),
    "vec": (
        lambda: PointCloud(*SMALL).apply_lse_kernel(
            jnp.zeros(200), jnp.zeros(150), 1.0, vec=jnp.ones(150), axis=0
        ),
        ValueError,
        "vec of shape (150,) with axis=0",
    ),
    "potential": (
        lambda: PointCloud(*SMALL).apply_lse_kernel(jnp.zeros(200), jnp.zeros(7), 1.0, axis=1),
        ValueError,
        "potential g has shape (7,)",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_says_what_and_what_to_do(case):
    call, error, match = BAD[case]
    with pytest.raises(error, match=re.escape(match)):
        call()


def test_the_package_does_not_import_ott():
    code = (
        "import sys, adv_jax_math; "
        "print([m for m in ('ott', 'adv_jax_math.ott') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
