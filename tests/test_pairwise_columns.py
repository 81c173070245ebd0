"""Both marginals of one pairwise matrix: ``pairwise(..., columns=)`` against the dense oracle.

The oracle stores every pair: ``vmap(vmap(f))`` gives ``(N, M, ...)``, reduced along
axis 1 with plain JAX for the rows and along axis 0 for the columns. Ragged N and M,
explicit and "auto" tiles, a pytree of monoids for the columns, gradients with
respect to x, y and a closed-over parameter, every engine (the column pass planned as
the row pass is), the plan and its text, the Sinkhorn transport plan's two marginals.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close, needs_abstract_devices, normal, on_abstract_device

import adv_jax_math as ajm

N, M, D, TILES = 37, 53, 3, (8, 16)
TOL = dict(rtol=2e-5, atol=2e-5)
BACKENDS = ("auto", "scan", "interpret")


def inputs():
    x = normal(0, (N, D))
    y = normal(1, (M, D))
    return x, y


def sqdist(xi, yj):
    return jnp.sum((xi - yj) ** 2)


def neg_sqdist(xi, yj):
    return -sqdist(xi, yj)


def dense(f, x, y):
    return jax.vmap(jax.vmap(f, (None, 0)), (0, None))(x, y)


def add_lse(d):  # the oracle of ADD rows, LOGSUMEXP columns
    return d.sum(1), jax.nn.logsumexp(d, 0)


@pytest.mark.parametrize("tiles", [TILES, "auto"], ids=["tiles", "auto"])
def test_add_rows_logsumexp_columns(tiles):
    x, y = inputs()
    run = lambda x, y: ajm.pairwise(neg_sqdist, x, y, ajm.ADD, tiles=tiles, columns=ajm.LOGSUMEXP)
    got = jax.jit(run)(x, y)
    assert isinstance(got, tuple) and got[0].shape == (N,) and got[1].shape == (M,)
    assert_tree_close(got, add_lse(dense(neg_sqdist, x, y)), **TOL)
    # rows exactly what a call without columns= returns
    assert_tree_close(got[0], ajm.pairwise(neg_sqdist, x, y, ajm.ADD, tiles=tiles), **TOL)


def test_columns_none_is_unchanged():
    x, y = inputs()
    got = ajm.pairwise(neg_sqdist, x, y, ajm.ADD, tiles=TILES, columns=None)
    assert isinstance(got, jax.Array)
    plan = ajm.explain_pairwise(neg_sqdist, x, y, ajm.ADD, tiles=TILES, columns=None)
    assert plan == ajm.explain_pairwise(neg_sqdist, x, y, ajm.ADD, tiles=TILES)
    assert plan.columns is None and "columns" not in str(plan)


def test_pytree_of_monoids_for_the_columns():
    x, y = inputs()
    f = lambda xi, yj: {"s": jnp.exp(-sqdist(xi, yj)), "m": sqdist(xi, yj)}
    columns = {"s": ajm.ADD, "m": ajm.MIN_ARGMIN}
    rows, cols = ajm.pairwise(f, x, y, ajm.MAX, tiles=TILES, columns=columns)
    d = dense(f, x, y)
    assert_tree_close(rows, jax.tree.map(lambda v: v.max(1), d), **TOL)
    want = {"s": d["s"].sum(0), "m": (d["m"].min(0), d["m"].argmin(0))}
    assert_tree_close(cols, want, **TOL)


def test_value_and_grad_through_rows_and_columns():
    x, y = inputs()

    def loss(marginals, s, x, y):
        rows, cols = marginals(lambda a, b: s * neg_sqdist(a, b), x, y)
        # rows / M: sin of a sum of 53 terms is too ill-conditioned for float32's tolerance
        return jnp.sum(jnp.sin(rows / M)) + jnp.sum(jnp.cos(cols) * jnp.arange(M) / M)

    ours = lambda g, x, y: ajm.pairwise(g, x, y, ajm.ADD, tiles=TILES, columns=ajm.LOGSUMEXP)
    oracle = lambda g, x, y: add_lse(dense(g, x, y))
    got = jax.jit(jax.value_and_grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(0.7, x, y)
    want = jax.value_and_grad(lambda *a: loss(oracle, *a), argnums=(0, 1, 2))(0.7, x, y)
    assert_tree_close(got, want, **TOL)


def test_vmap_over_a_batch_of_inputs():
    x, y = inputs()
    xs = jnp.stack([x, 2 * x])
    run = lambda x: ajm.pairwise(neg_sqdist, x, y, ajm.ADD, tiles=TILES, columns=ajm.LOGSUMEXP)
    got = jax.vmap(run)(xs)
    want = jax.vmap(lambda x: add_lse(dense(neg_sqdist, x, y)))(xs)
    assert_tree_close(got, want, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_engine_plans_the_column_pass_as_the_row_pass(backend):
    x, y = inputs()
    with ajm.config(backend=backend):
        plan = ajm.explain_pairwise(neg_sqdist, x, y, ajm.ADD, tiles=TILES, columns=ajm.LOGSUMEXP)
        got = ajm.pairwise(neg_sqdist, x, y, ajm.ADD, tiles=TILES, columns=ajm.LOGSUMEXP)
    assert plan.columns is not None, str(plan)
    assert plan.columns.engine == plan.engine, str(plan)
    assert (plan.n, plan.m, plan.tiles) == (N, M, TILES)
    assert (plan.columns.n, plan.columns.m, plan.columns.tiles) == (M, N, TILES[::-1])
    assert plan.columns.reduction == "logsumexp" and plan.columns.columns is None
    assert_tree_close(got, add_lse(dense(neg_sqdist, x, y)), **TOL)


def test_auto_tiles_stay_auto_for_the_column_pass():
    x, y = inputs()
    plan = ajm.explain_pairwise(neg_sqdist, x, y, ajm.ADD, columns=ajm.ADD)
    assert plan.columns == ajm.explain_pairwise(lambda b, a: neg_sqdist(a, b), y, x, ajm.ADD)


def test_shard_spreads_each_pass_rows():
    # the column pass spreads the y rows, as pairwise(swapped f, y, x, shard=True) does:
    # each pass the tiles on a device's share of its rows (pairs.spread)
    x, y = inputs()
    kw = dict(tiles=TILES, shard=True, columns=ajm.LOGSUMEXP)
    plan = ajm.explain_pairwise(neg_sqdist, x, y, ajm.ADD, **kw)
    assert plan.engine == plan.columns.engine == "pairwise tiles (xla)", str(plan)
    for one, rows in [(plan, x), (plan.columns, y)]:
        share = -(-rows.shape[0] // jax.device_count())
        assert f"spread over the devices (shard=True), {share} on each" in one.reason, str(plan)
    got = ajm.pairwise(neg_sqdist, x, y, ajm.ADD, **kw)
    assert_tree_close(got, add_lse(dense(neg_sqdist, x, y)), **TOL)


@needs_abstract_devices
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_gpu_and_tpu_plan_the_column_pass_on_the_tile_kernel(platform):
    # planned (lowered: no compiler here) for an H100 / a TPU v5e from this CPU: "auto"
    # gives both passes the device's tiles, explicit tiles are swapped for the columns
    # (an H100 takes Mosaic GPU's tiles: 64 y rows by the least multiple of 8 x rows)
    x, y = inputs()
    kind = "mosaic_gpu" if platform == "cuda" else "tpu"
    tiles = {"mosaic_gpu": (64, 128), "tpu": (128, 256)}[kind]
    with on_abstract_device(platform):
        auto = ajm.explain_pairwise(neg_sqdist, x, y, ajm.ADD, columns=ajm.LOGSUMEXP)
        given = ajm.explain_pairwise(neg_sqdist, x, y, ajm.ADD, tiles=tiles, columns=ajm.ADD)
    for plan in (auto, auto.columns, given, given.columns):
        assert plan is not None and plan.engine == f"pairwise kernel ({kind})", str(auto)
    want = {"mosaic_gpu": ((40, 64), (56, 64)), "tpu": ((128, 128), (128, 128))}[kind]
    assert (auto.tiles, auto.columns.tiles) == want, str(auto)
    assert (given.tiles, given.columns.tiles) == (tiles, tiles[::-1]), str(given)


@pytest.mark.parametrize("columns", ["add", jnp.add, 0])
def test_columns_not_a_monoid(columns):
    x, y = inputs()
    with pytest.raises(TypeError, match="columns="):
        ajm.pairwise(neg_sqdist, x, y, ajm.ADD, columns=columns)
    with pytest.raises(TypeError, match="columns="):
        ajm.explain_pairwise(neg_sqdist, x, y, ajm.ADD, columns=columns)


def test_plan_text_shows_the_column_pass():
    x, y = inputs()
    plan = ajm.explain_pairwise(neg_sqdist, x, y, ajm.ADD, tiles=TILES, columns=ajm.ADD)
    text, rows_only = str(plan), str(ajm.explain_pairwise(neg_sqdist, x, y, ajm.ADD, tiles=TILES))
    assert text.startswith(rows_only + "\ncolumns    : a second pass"), text
    after = text[len(rows_only) :]
    assert f"    engine     : {plan.columns.engine}" in after, text
    assert "    tiles      : 16 x 8 rows" in after, text


def test_sinkhorn_marginals_in_one_call():
    # P_ij = exp((f_i + g_j - |x_i - y_j|^2) / eps): its row and column sums at once
    x, y = inputs()
    f = 0.3 * normal(2, (N,))
    g = 0.3 * normal(3, (M,))
    eps = 0.5
    plan = lambda xf, yg: jnp.exp((xf[1] + yg[1] - sqdist(xf[0], yg[0])) / eps)
    rows, cols = ajm.pairwise(plan, (x, f), (y, g), ajm.ADD, columns=ajm.ADD)
    p = jnp.exp((f[:, None] + g[None] - jnp.sum((x[:, None] - y[None]) ** 2, -1)) / eps)
    assert_tree_close((rows, cols), (p.sum(1), p.sum(0)), **TOL)
