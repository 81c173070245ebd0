"""A chunked reduction that is a pairwise one takes the pairwise tiles.

``batch_map(lambda yc: g(x, yc), y, b, reduction=M)`` with ``g`` returning ``(rows, N,
...)`` blocks and ``x`` a value it closes over (N-body's targets) is
``pairwise(f, x, y, M)``: ``_pair_rows`` proves it from the chunk's jaxpr and makes
``f(xi, yj)`` by evaluating that jaxpr at one row of each. Values and gradients (with
respect to x, y and another closed-over value; reverse and forward mode) against the
dense plain-JAX oracle for every monoid whose result is laid out per x row, the forms
written with ``jnp.add`` and a ``chunk_reduction``, x rows on another axis, and every
form that is not pairwise computed by the scan engine, with the reason in ``explain``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close, normal
from test_pairwise import CASES, dense, inputs, scaled_loss, sqdist

import adv_jax_math as ajm

B = 16  # rows per chunk: 53 y rows are 4 chunks, the last overlapping
# monoids whose result is one per x row: not a top-k (its k slots come first), nor a
# softmax-weighted sum (each x row's score is a head weighing every x row's values)
NAMES = [name for name in CASES if "top_k" not in name and "softmax" not in name]
NAMES.remove("k_nearest")


def blocks(f, x):
    """``f`` written for one pair, as a user writes the chunk: ``(rows, N, ...)``."""
    return lambda yc: jax.vmap(lambda yj: jax.vmap(lambda xi: f(xi, yj))(x))(yc)


def chunked(f, reduction, x, y, b=B):
    return ajm.batch_map(blocks(f, x), y, b, reduction=reduction)


def engine(f, reduction, x, y, b=B):
    return ajm.explain(blocks(f, x), y, b, reduction=reduction)


@pytest.mark.parametrize("name", NAMES)
def test_values_match_dense_oracle(name):
    reduction, f, want = CASES[name]
    x, y = inputs()
    plan = engine(f, reduction, x, y)
    assert plan.engine == "pairwise", str(plan)
    assert "closes over an array (37, 3) whose 37 rows pair with the chunk's rows" in plan.reason
    got = jax.jit(lambda x, y: chunked(f, reduction, x, y))(x, y)
    assert_tree_close(got, want(dense(f, x, y)), rtol=2e-5, atol=2e-5)
    with ajm.config(backend="scan"):  # the same call on the scan engine
        assert engine(f, reduction, x, y).engine == "scan"
        assert_tree_close(got, chunked(f, reduction, x, y), rtol=2e-5, atol=2e-5)


DIFFERENTIABLE = [name for name in NAMES if name not in ("argmin", "argmax")]


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradients_match_dense_oracle(name):
    # w.r.t. x (the constant read as the pairwise x), y and another closed-over value
    reduction, f, want = CASES[name]
    x, y = inputs()
    loss = scaled_loss(f)
    ours = lambda g, x, y: chunked(g, reduction, x, y)
    oracle = lambda g, x, y: want(dense(g, x, y))
    got = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(0.7, x, y)
    expect = jax.jit(jax.grad(lambda *a: loss(oracle, *a), argnums=(0, 1, 2)))(0.7, x, y)
    assert_tree_close(got, expect, rtol=2e-4, atol=2e-4)
    jvp = lambda run: jax.jit(lambda x: jax.jvp(lambda x: loss(run, 0.7, x, y), (x,), (x * x,)))
    assert_tree_close(jvp(ours)(x), jvp(oracle)(x), rtol=2e-4)


def field(targets, sources):
    """N-body as users write it: ``(rows, T, 3)``, a cross product and a norm."""
    d = targets[None, :, :] - sources[:, None, :]
    inv_r3 = jax.lax.rsqrt(jnp.sum(d * d, axis=-1, keepdims=True) + 1e-2) ** 3
    return jnp.cross(d, sources[:, None, :]) * inv_r3


@pytest.mark.parametrize("n", [1000, 999, 17])
def test_nbody_with_add_and_a_chunk_reduction(n):
    targets, sources = inputs()[0], normal(2, (n, 3))

    def run(targets, sources, b):
        fun = lambda s: field(targets, s)
        kw = dict(reduction=jnp.add, chunk_reduction=jnp.add.reduce)
        return ajm.batch_map(fun, sources, b, **kw), ajm.explain(fun, sources, b, **kw)

    for b in (64, 128, 1000):
        got, plan = run(targets, sources, b)
        assert plan.engine == "pairwise", str(plan)
        want = field(targets, sources).sum(0)  # float32 sums of terms up to 1e3
        assert_tree_close(got, want, rtol=2e-5, atol=1e-6 * n * jnp.abs(want).max())
    # the tiles hold at most a chunk's pairs: batch_size rows by every target
    assert f"tiles of 37 x rows by {min(n, 64)} rows" in run(targets, sources, 64)[1].reason
    loss = lambda t, s: jnp.sum(run(t, s, 128)[0] ** 2)
    got = jax.grad(loss, argnums=(0, 1))(targets, sources)
    expect = jax.grad(lambda t, s: jnp.sum(field(t, s).sum(0) ** 2), argnums=(0, 1))
    assert_tree_close(got, expect(targets, sources), rtol=2e-4, atol=1e-5 * n)


def test_two_constants_with_the_same_rows_and_x_rows_on_another_axis():
    # targets with positions and charges (both x), output (rows, 2, T)
    x, y = inputs()
    q = jnp.linspace(0.5, 1.5, x.shape[0])
    fun = lambda yc: jnp.stack(
        [q * jnp.exp(-((x[None] - yc[:, None]) ** 2).sum(-1)), q * (yc[:, None, 0] - x[:, 0])],
        axis=1,
    )
    plan = ajm.explain(fun, y, B, reduction=ajm.LOGSUMEXP)
    assert plan.engine == "pairwise" and "an array (37, 3) and an array (37,)" in plan.reason
    want = jax.nn.logsumexp(fun(y), 0)
    assert_tree_close(ajm.batch_map(fun, y, B, reduction=ajm.LOGSUMEXP), want, rtol=2e-5)


REFUSED = {
    # the x rows are mixed: centred on their mean
    "reduce_sum reduces over x rows": lambda x, yc: -(((x - x.mean(0)) - yc[:, None]) ** 2).sum(-1),
    # a position-dependent term along the x rows
    "meets x rows with a position-dependent axis": lambda x, yc: (
        yc[:, None, 0] * x[:, 0] + jnp.arange(x.shape[0])
    ),
    # a custom derivative rule on the pairs cannot be evaluated at one row
    "custom_jvp_call on rows": lambda x, yc: jax.nn.relu(yc[:, None, 0] - x[:, 0]),
}


@pytest.mark.parametrize("why", list(REFUSED))
def test_forms_that_are_not_pairwise_run_on_the_scan_engine(why):
    x, y = inputs()
    fun = lambda yc: REFUSED[why](x, yc)
    plan = ajm.explain(fun, y, B, reduction=ajm.ADD)
    assert plan.engine == "scan" and why in dict(plan.rejected)["pairwise"], str(plan)
    assert_tree_close(ajm.batch_map(fun, y, B, reduction=ajm.ADD), fun(y).sum(0), rtol=2e-5)


def test_results_not_laid_out_per_x_row_and_whole_sums_stay_chunked():
    x, y = inputs()
    fun = blocks(sqdist, x)
    plan = ajm.explain(fun, y, B, reduction=ajm.top_k(3))  # (3, N): the k slots first
    assert plan.engine == "scan", str(plan)
    assert "top_k(3)'s result is not laid out per x row" in dict(plan.rejected)["pairwise"]
    values, idx = ajm.batch_map(fun, y, B, reduction=ajm.top_k(3))
    want = tuple(jax.lax.top_k(dense(sqdist, x, y), 3))
    assert_tree_close((values.T, idx.T), want)
    whole = ajm.explain(fun, y, B, reduction=jnp.add, chunk_reduction=jnp.sum)
    assert whole.engine == "scan" and "reduces every axis" in dict(whole.rejected)["pairwise"]
    # a softmax-weighted sum: each x row's score a head weighing every x row's values
    scores = blocks(CASES["softmax_weighted"][1], x)
    heads = ajm.explain(scores, y, B, reduction=ajm.SOFTMAX_WEIGHTED)
    assert "softmax_weighted's result is not laid out" in dict(heads.rejected)["pairwise"]


@pytest.mark.parametrize("k", [5, 7])
def test_a_top_k_with_as_many_slots_as_x_rows_stays_chunked(k):
    # (k, T) with k == T has the shape of a result per x row, its values are not (a
    # check by shapes alone, growing the x rows to 7, took k = T = 7 for one)
    x, y = inputs()
    x = x[:k]
    fun = blocks(sqdist, x)
    plan = ajm.explain(fun, y, B, reduction=ajm.top_k(k))
    assert plan.engine == "scan", str(plan)
    assert "not laid out per x row" in dict(plan.rejected)["pairwise"], str(plan)
    values, idx = ajm.batch_map(fun, y, B, reduction=ajm.top_k(k))
    want = tuple(jax.lax.top_k(dense(sqdist, x, y), k))
    assert_tree_close((values.T, idx.T), want)


def test_a_loop_on_constants_in_the_chunk():
    # evaluated at one pair as one equation, it warned (an error here) that its jaxpr
    # had no debug info; the tiles, which cannot unroll it, then decline
    x, y = inputs()
    scale = lambda: jax.lax.fori_loop(0, 3, lambda k, c: c + k, 0.5)
    fun = lambda yc: blocks(sqdist, x)(yc) * scale()
    plan = ajm.explain(fun, y, B, reduction=ajm.ADD)
    assert "scan is not unrolled" in dict(plan.rejected)["pairwise"], str(plan)
    got = ajm.batch_map(fun, y, B, reduction=ajm.ADD)
    assert_tree_close(got, dense(sqdist, x, y).sum(1) * 3.5, rtol=2e-5)


def _kernel(x, yc):
    return jnp.exp(-(((yc[:, None] - x[None]) ** 2).sum(-1)))


SIZED = {  # a fun that computes with its chunk's size, on 17 rows: 4 chunks of 4, then 1
    "branch on the size": lambda x, yc: _kernel(x, yc) * (2.0 if yc.shape[0] > 1 else 1.0),
    "squeeze without an axis": lambda x, yc: jnp.squeeze(_kernel(x, yc)[..., None]),
    "divides by the size": lambda x, yc: _kernel(x, yc) / yc.shape[0],
}


@pytest.mark.parametrize("name", list(SIZED))
def test_a_fun_of_its_chunk_size_is_computed_as_written(name):
    # the pairs would evaluate the chunks' jaxpr on the remainder's rows too
    x, y = inputs()
    y = y[:17]
    fun = lambda yc: SIZED[name](x, yc)
    plan = ajm.explain(fun, y, 4, reduction=ajm.ADD)
    assert plan.policy is ajm.Policy.REMAINDER and plan.remainder == 1, str(plan)
    assert "computes with its chunk's size" in dict(plan.rejected)["pairwise"], str(plan)
    want = sum(fun(y[i : i + 4]).sum(0) for i in range(0, 17, 4))
    assert_tree_close(ajm.batch_map(fun, y, 4, reduction=ajm.ADD), want, rtol=2e-5)
    # without it, the same remainder of one row takes the tiles
    assert engine(lambda a, b: jnp.exp(-sqdist(a, b)), ajm.ADD, x, y, 4).engine == "pairwise"


def test_under_vmap_and_on_meshes():
    f, x, y = CASES["logsumexp"][1], *inputs()
    want = jax.nn.logsumexp(dense(f, x, y), 1)
    run = lambda x, y: chunked(f, ajm.LOGSUMEXP, x, y)
    # a batch of x sets, vmapped over the whole call
    got = jax.vmap(run, (0, None))(jnp.stack([x, 2 * x]), y)
    assert_tree_close(got[0], want, rtol=2e-5, atol=2e-5)
    assert_tree_close(got[1], jax.nn.logsumexp(dense(f, 2 * x, y), 1), rtol=2e-5, atol=2e-5)
    for kind in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
        mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(kind,))
        with jax.set_mesh(mesh):
            assert engine(f, ajm.LOGSUMEXP, x, y).engine == "pairwise"
            assert_tree_close(jax.jit(run)(x, y), want, rtol=2e-5, atol=2e-5)


def test_sharded_calls_and_other_backends_are_not_taken():
    f, x, y = CASES["add"][1], *inputs()
    plan = ajm.explain(blocks(f, x), y, B, reduction=ajm.ADD, shard=True)
    assert plan.engine == "shard" and plan.shard.local.engine == "scan", str(plan)
    assert dict(plan.shard.local.rejected)["pairwise"] == "not over a mesh"
    with ajm.config(backend="interpret"):
        plan = engine(f, ajm.ADD, x, y)
    # the interpret kernel where it runs (jax 0.9 declines this one: then scan, not pairwise)
    assert plan.engine in ("interpret", "scan"), str(plan)
    assert dict(plan.rejected).get("pairwise", "not requested (backend='interpret')") == (
        "not requested (backend='interpret')"
    )


def test_auto_batch_size_takes_the_tiles_own_size(monkeypatch):
    # the tiles keep their own "auto" size, so the autotuner, which sizes the scan
    # engine's chunks, compiles and times nothing (it timed chunks that never ran)
    from adv_jax_math.plan import autotune as _autotune

    def timed(*args):
        raise AssertionError("a chunk program was built for a call the tiles run")

    monkeypatch.setattr(_autotune, "ChunkProgram", timed)
    f, x, y = CASES["add"][1], *inputs()
    plan = engine(f, ajm.ADD, x, y, b="auto")
    assert plan.engine == "pairwise" and "tiles of 37 x rows by 53 rows" in plan.reason
    assert plan.autotune.candidates == () and "tiles size themselves" in str(plan), str(plan)
    assert "at their own size" in plan.notes[-1], str(plan)
    assert_tree_close(chunked(f, ajm.ADD, x, y, "auto"), dense(f, x, y).sum(1), rtol=2e-5)
    loss = lambda x, y, b: jnp.sum(jnp.sin(chunked(f, ajm.ADD, x, y, b)))
    want = jax.grad(lambda x, y: jnp.sum(jnp.sin(dense(f, x, y).sum(1))), (0, 1))(x, y)
    assert_tree_close(jax.grad(loss, (0, 1))(x, y, "auto"), want, rtol=2e-5, atol=2e-5)
    scan = ajm.config(backend="scan")  # not the tiles: autotuned as usual
    with scan, pytest.raises(AssertionError, match="chunk program was built"):
        engine(f, ajm.ADD, x, y, b="auto")
