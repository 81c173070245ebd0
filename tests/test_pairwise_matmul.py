"""The matmul tiles (``pairwise tiles (matmul)``, the CPU engine for ``f`` with wide
dot products or many values per pair) against the dense oracle.

Every reduction of the shared case list (``bench/cases/pairwise.py``) at D = 64
features, where the unrolled CPU tiles decline (131 values per pair); ragged N and M,
a tie across a y tile border; values, reverse and forward mode with respect to x, y
and a value ``f`` closes over; attention as the dot product it is, its second order
and bfloat16 inputs. The same reductions on the Pallas matmul tile kernel (both
layouts, interpreted), values and reverse mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.pairwise import REDUCTIONS, attention
from helpers import (
    assert_tree_close,
    needs_abstract_devices,
    normal,
    on_abstract_device,
    primitives,
)
from jax.sharding import AxisType

import adv_jax_math as ajm
from adv_jax_math.kernels.fused_reduce.probe import Probed
from adv_jax_math.pairs import api as pairs_api
from adv_jax_math.pairs import kernel as pairs_kernel
from adv_jax_math.pairs import matmul as pairs_matmul
from adv_jax_math.pairs.precision import keeping_inf_reverse

N, M, D, TILES = 37, 53, 64, (8, 16)
MATMUL = "pairwise tiles (matmul)"
CASES = {c.name: c for c in REDUCTIONS}


def inputs(d: int = D):
    x, y = 0.2 * normal(0, (N, d)), 0.2 * normal(1, (M, d))
    return x, y.at[16].set(y[15])  # a tie across the border of the first two y tiles


def dense(f, x, y):
    return jax.vmap(jax.vmap(f, (None, 0)), (0, None))(x, y)


@pytest.mark.parametrize("tiles", [TILES, "auto"])
@pytest.mark.parametrize("name", list(CASES))
def test_values_match_dense_oracle(name, tiles):
    case = CASES[name]
    x, y = inputs()
    plan = ajm.explain_pairwise(case.f, x, y, case.reduction, tiles=tiles)
    assert plan.engine == MATMUL, str(plan)
    got = jax.jit(lambda x, y: ajm.pairwise(case.f, x, y, case.reduction, tiles=tiles))(x, y)
    assert_tree_close(got, case.oracle(dense(case.f, x, y)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("on", ["gpu", "tpu"])
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if i % 3 == 0 else pytest.mark.slow) for i, n in enumerate(CASES)],
)
def test_kernel_interpreted_matches_dense_oracle(name, on, monkeypatch):
    # the Pallas kernel of the GPU (a program per x tile, a loop over the y tiles) and
    # of the TPU (a grid, the states in the output block), with ragged tiles
    monkeypatch.setattr(pairs_api, "INTERPRET_LAYOUT", on)
    case = CASES[name]
    x, y = inputs()
    run = lambda x, y: ajm.pairwise(case.f, x, y, case.reduction, tiles=TILES)
    oracle = lambda x, y: case.oracle(dense(case.f, x, y))
    with ajm.config(backend="interpret"):
        plan = ajm.explain_pairwise(case.f, x, y, case.reduction, tiles=TILES)
        assert f"{on} matmul tile kernel, interpreted" in plan.reason, str(plan)
        got = jax.jit(run)(x, y)
        if case.differentiable:
            loss = loss_of(case.f)
            ours = lambda *a: loss(
                lambda g, x, y: ajm.pairwise(g, x, y, case.reduction, tiles=TILES), *a
            )
            got_grad = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(0.7, x, y)
            got_fwd = jax.jit(lambda s: jax.jvp(lambda s: ours(s, x, y), (s,), (1.0,)))(0.7)
    assert_tree_close(got, oracle(x, y), rtol=2e-5, atol=2e-5)
    if case.differentiable:
        plain = lambda *a: loss(lambda g, x, y: case.oracle(dense(g, x, y)), *a)
        want = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(0.7, x, y)
        assert_tree_close(got_grad, want, rtol=2e-4, atol=2e-4)
        want_fwd = jax.jit(lambda s: jax.jvp(lambda s: plain(s, x, y), (s,), (1.0,)))(0.7)
        assert_tree_close(got_fwd, want_fwd, rtol=2e-4)


@pytest.mark.parametrize("name", ["softmax_weighted", "max", "logsumexp"])
@pytest.mark.parametrize("sizes", [(37, 53), (53, 37)])
def test_tpu_reverse_pass_is_one_kernel(name, sizes, monkeypatch):
    # the TPU's reverse pass, interpreted: one kernel over the tiles of the side with
    # the more cotangents (y here at 37 x 53, x at 53 x 37), the other side's
    # cotangents and a max's counts summed into whole arrays; ragged tiles, a tie
    monkeypatch.setattr(pairs_api, "INTERPRET_LAYOUT", "tpu")
    case, (n, m) = CASES[name], sizes
    x, y = 0.2 * normal(0, (n, D)), 0.2 * normal(1, (m, D))
    x = x.at[-1].set(x[0])
    loss = loss_of(case.f)
    ours = lambda *a: loss(lambda g, x, y: ajm.pairwise(g, x, y, case.reduction, tiles=TILES), *a)
    plain = lambda *a: loss(lambda g, x, y: case.oracle(dense(g, x, y)), *a)
    with ajm.config(backend="interpret"):
        grad = jax.grad(ours, argnums=(0, 1, 2))
        names = primitives(jax.make_jaxpr(grad)(0.7, x, y).jaxpr)
        got = jax.jit(grad)(0.7, x, y)
    assert names.count("pallas_call:adv_jax_math_matmul_tiles_reverse") == 1, names
    want = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(0.7, x, y)
    assert_tree_close(got, want, rtol=2e-4, atol=2e-4)


@needs_abstract_devices
def test_gpu_reverse_tiles_are_probed_without_spills_first(monkeypatch):
    # every tile compiled with ptxas spilling no register first (here each such
    # compile fails, as where every tile spills), then as it compiles: the largest
    seen = []

    def probe(k):
        if " reverse " in k.text:
            seen.append((k.layout.tiles, k.options))
        return Probed("spills" if k.options else None, True)

    monkeypatch.setattr(pairs_kernel, "probe", probe)
    f = attention(64).f
    q, kv = _attention_inputs(64)
    loss = lambda q, kv: jnp.sum(ajm.pairwise(f, q, kv, ajm.SOFTMAX_WEIGHTED))
    with on_abstract_device("cuda"):
        plan = ajm.explain_pairwise(f, q, kv, ajm.SOFTMAX_WEIGHTED)
        jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, kv)
    bi, bj = plan.tiles
    tiles = list(dict.fromkeys([(bi, bj), (bi, bj // 2), (bi // 2, bj // 2), (bi // 2, bj // 4)]))
    tiles = [t for t in tiles if min(t) >= 16]
    strict = [(t, (pairs_matmul.NO_SPILLS,)) for t in tiles]
    assert seen == [*strict, ((bi, bj), ())], (plan.tiles, seen)
    assert "first with no register spilled" in plan.backward, plan.backward


@needs_abstract_devices
@pytest.mark.parametrize("precision", [None, "highest"])
def test_tpu_reverse_kernel_takes_split_precision_dots(precision):
    # on a TPU a float32 dot at HIGH/HIGHEST runs in bfloat16 passes, whose transposes
    # in a Mosaic kernel lost infinities (a TPU v5e): they keep them as the forward
    # dot does (pairs.precision.keeping_inf_reverse), and the reverse pass is one kernel
    f = lambda q, kv: (jnp.dot(q, kv[0], precision=precision) / 8.0, kv[1])
    q, kv = _attention_inputs(64)
    loss = lambda q, kv: jnp.sum(ajm.pairwise(f, q, kv, ajm.SOFTMAX_WEIGHTED))
    with on_abstract_device("tpu"):
        plan = ajm.explain_pairwise(f, q, kv, ajm.SOFTMAX_WEIGHTED)
        names = primitives(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, kv).jaxpr)
    assert plan.engine == "pairwise kernel (matmul, tpu)", str(plan)
    assert "one kernel" in plan.backward, plan.backward
    assert names.count("pallas_call:adv_jax_math_matmul_tiles_reverse") == 1, names


def loss_of(f):
    """``loss(run, s, x, y)``: the sum of the sines of ``run(f scaled by s, x, y)``'s
    float leaves."""
    scaled = lambda s: lambda a, b: jax.tree.map(lambda v: v * s, f(a, b))

    def loss(run, s, x, y):
        out = run(scaled(s), x, y)
        return sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(out) if v.dtype.kind == "f")

    return loss


DIFFERENTIABLE = [c.name for c in REDUCTIONS if c.differentiable]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if i % 2 == 0 else pytest.mark.slow)
        for i, n in enumerate(DIFFERENTIABLE)
    ],
)
def test_gradients_match_dense_oracle(name):
    # w.r.t. a value f closes over, x and y; reverse and forward mode
    case = CASES[name]
    x, y = inputs()
    loss = loss_of(case.f)
    ours = lambda g, x, y: ajm.pairwise(g, x, y, case.reduction, tiles=TILES)
    oracle = lambda g, x, y: case.oracle(dense(g, x, y))
    got = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(0.7, x, y)
    want = jax.jit(jax.grad(lambda *a: loss(oracle, *a), argnums=(0, 1, 2)))(0.7, x, y)
    assert_tree_close(got, want, rtol=2e-4, atol=2e-4)
    fwd = jax.jit(lambda s: jax.jvp(lambda s: loss(ours, s, x, y), (s,), (1.0,)))(0.7)
    want_fwd = jax.jit(lambda s: jax.jvp(lambda s: loss(oracle, s, x, y), (s,), (1.0,)))(0.7)
    assert_tree_close(fwd, want_fwd, rtol=2e-4)


def _attention_inputs(d: int, dtype=jnp.float32):
    q, k, v = (normal(i, (n, d)).astype(dtype) for i, n in enumerate((N, M, M)))
    return q, (k, v)


def _dense_attention(q, kv):
    k, v = kv
    s = (q.astype(jnp.float32) @ k.astype(jnp.float32).T) / q.shape[1] ** 0.5
    return (jax.nn.softmax(s, axis=1) @ v.astype(jnp.float32)).astype(q.dtype)


@pytest.mark.parametrize("backend", ["auto", "interpret"])
def test_attention_reverse_and_second_order(backend):
    # the XLA loops, and the Pallas kernel (interpreted): its second order in XLA
    f = attention(32).f
    q, kv = _attention_inputs(32)
    with ajm.config(backend=backend):
        _attention_orders(f, q, kv)


def _attention_orders(f, q, kv):
    plan = ajm.explain_pairwise(f, q, kv, ajm.SOFTMAX_WEIGHTED, tiles=TILES)
    assert "matmul" in plan.engine + plan.reason and "f contracts 32 features" in str(plan), str(
        plan
    )
    ours = lambda q, kv: ajm.pairwise(f, q, kv, ajm.SOFTMAX_WEIGHTED, tiles=TILES)
    loss = lambda run: lambda q, kv: jnp.sum(jnp.sin(run(q, kv)))
    assert_tree_close(jax.jit(ours)(q, kv), _dense_attention(q, kv), rtol=1e-5, atol=1e-6)
    grad = lambda run: jax.jit(jax.grad(loss(run), argnums=(0, 1)))
    assert_tree_close(grad(ours)(q, kv), grad(_dense_attention)(q, kv), rtol=1e-4, atol=1e-5)
    # the reverse pass differentiated again (a Hessian-vector product)
    tangent = (0.3 * q, jax.tree.map(lambda a: 0.1 * a, kv))
    hvp = lambda run: jax.jit(lambda q, kv: jax.jvp(grad(run), (q, kv), tangent)[1])
    assert_tree_close(hvp(ours)(q, kv), hvp(_dense_attention)(q, kv), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_attention_in_half_precision(dtype):
    # half inputs, f32 accumulation: the result in the inputs' dtype, as close to the
    # f32 computation on the same (rounded) inputs as one rounding of the result
    f = attention(64).f
    q, kv = _attention_inputs(64, dtype)
    got = jax.jit(lambda q, kv: ajm.pairwise(f, q, kv, ajm.SOFTMAX_WEIGHTED, tiles=TILES))(q, kv)
    want = _dense_attention(q, kv)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=2e-2, atol=2e-2)
    loss = lambda q, kv: jnp.sum(ajm.pairwise(f, q, kv, ajm.SOFTMAX_WEIGHTED, tiles=TILES))
    dq, (dk, dv) = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv)
    want_dq, (want_dk, want_dv) = jax.grad(
        lambda q, kv: jnp.sum(_dense_attention(q, kv).astype(jnp.float32)), argnums=(0, 1)
    )(q, kv)
    for a, b in [(dq, want_dq), (dk, want_dk), (dv, want_dv)]:
        assert a.dtype == dtype
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=5e-2, atol=5e-2)


def test_declines_with_its_reason():
    x, y = inputs()
    # values that depend on the x row: each x row weighs values of its own
    paired = lambda a, b: (jnp.dot(a, b), a[:2] * b[:2])
    plan = ajm.explain_pairwise(paired, x, y, ajm.SOFTMAX_WEIGHTED)
    assert plan.engine == "pairwise scan", str(plan)
    assert "pairwise tiles (matmul): f's values of the softmax-weighted sum depend" in str(plan)
    got = ajm.pairwise(paired, x, y, ajm.SOFTMAX_WEIGHTED)
    s, v = dense(paired, x, y)
    want = jnp.einsum("nm,nmd->nd", jax.nn.softmax(s, axis=1), v)
    assert_tree_close(got, want, rtol=1e-5, atol=1e-6)
    # shard=True under jax.set_mesh: the scan engine spreads the x rows
    mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        assert ajm.explain_pairwise(jnp.dot, x, y, ajm.ADD, shard=True).engine == "pairwise scan"
    with ajm.config(backend="scan"):  # as requested
        assert ajm.explain_pairwise(jnp.dot, x, y, ajm.ADD).engine == "pairwise scan"


def test_both_marginals():
    x, y = inputs()
    f = lambda a, b: -jnp.dot(a, b)
    rows, cols = ajm.pairwise(f, x, y, ajm.LOGSUMEXP, columns=ajm.LOGSUMEXP, tiles=TILES)
    plan = ajm.explain_pairwise(f, x, y, ajm.LOGSUMEXP, columns=ajm.LOGSUMEXP, tiles=TILES)
    assert plan.engine == MATMUL and plan.columns.engine == MATMUL, str(plan)
    s = dense(f, x, y)
    assert_tree_close(rows, jax.nn.logsumexp(s, axis=1), rtol=1e-5, atol=1e-5)
    assert_tree_close(cols, jax.nn.logsumexp(s, axis=0), rtol=1e-5, atol=1e-5)


# squared distances written directly, expanded by the matmul tiles: k-NN, a Sinkhorn-like
# logsumexp and a Gaussian kernel sum, each with the difference squared another way
def _knn(a, b):
    return jnp.sum((a - b) ** 2)


def _sinkhorn(a, b):
    return -jnp.sum(jnp.square(b - a)) / 0.5


def _gaussian(a, b):
    d = a - b
    return jnp.exp(-jnp.sum(d * d) / D)


SQUARED = {
    "knn": (_knn, ajm.top_k(5, smallest=True), lambda s: (jnp.sort(s, 1)[:, :5],)),
    "sinkhorn": (_sinkhorn, ajm.LOGSUMEXP, lambda s: jax.nn.logsumexp(s, axis=1)),
    "gaussian": (_gaussian, ajm.ADD, lambda s: jnp.sum(s, axis=1)),
}
EXPANDED = "as |a|^2 + |b|^2 - 2 a.b"


@pytest.mark.parametrize("name", list(SQUARED))
def test_squared_distances_expanded_match_dense_oracle(name):
    # values, and gradients w.r.t. a value f closes over, x and y (reverse and
    # forward mode, and forward over reverse), against f on every pair
    f, red, oracle = SQUARED[name]
    x, y = inputs()
    plan = ajm.explain_pairwise(f, x, y, red, tiles=TILES)
    assert plan.engine == MATMUL and f"over {D} features {EXPANDED}" in str(plan), str(plan)
    ours = lambda g, x, y: ajm.pairwise(g, x, y, red, tiles=TILES)
    dense_of = lambda g, x, y: oracle(dense(g, x, y))
    got = jax.jit(lambda x, y: ours(f, x, y))(x, y)
    want = dense_of(f, x, y)
    if name == "knn":  # the values; the indices of the 5 nearest as the oracle's
        assert_tree_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got[1], jnp.argsort(dense(f, x, y), axis=1)[:, :5])
    else:
        assert_tree_close(got, want, rtol=1e-5, atol=1e-5)
    loss = loss_of(f)
    grad = lambda run: jax.jit(jax.grad(lambda *a: loss(run, *a), argnums=(0, 1, 2)))
    assert_tree_close(grad(ours)(0.7, x, y), grad(dense_of)(0.7, x, y), rtol=2e-4, atol=2e-4)
    fwd = lambda run: jax.jit(lambda s: jax.jvp(lambda s: loss(run, s, x, y), (s,), (1.0,)))
    assert_tree_close(fwd(ours)(0.7), fwd(dense_of)(0.7), rtol=2e-4)
    tangent = (1.0, 0.1 * x, 0.1 * y)
    hvp = lambda run: jax.jit(lambda *a: jax.jvp(grad(run), a, tangent)[1])
    assert_tree_close(hvp(ours)(0.7, x, y), hvp(dense_of)(0.7, x, y), rtol=1e-3, atol=1e-3)


def test_squared_distance_tile_is_a_matmul():
    # at D = 128 the tiles hold one dot_general over the features and no (bj, bi, D)
    # difference, x's and y's norms once per row
    x, y = inputs(128)
    f = lambda a, b: jnp.exp(-jnp.sum((a - b) ** 2) / 128)
    bi, bj = TILES
    assert ajm.explain_pairwise(f, x, y, ajm.ADD, tiles=TILES).engine == MATMUL
    for run in (
        lambda x, y: ajm.pairwise(f, x, y, ajm.ADD, tiles=TILES),
        jax.grad(lambda x, y: jnp.sum(ajm.pairwise(f, x, y, ajm.ADD, tiles=TILES)), (0, 1)),
    ):
        text = str(jax.make_jaxpr(run)(x, y))
        assert "dot_general" in text
        assert f"f32[{bj},{bi},128]" not in text and f"f32[{bi},{bj},128]" not in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", ["auto", "interpret"])
def test_a_dot_product_written_as_a_sum_of_products(backend, dtype):
    # jnp.sum(a * g(b)) over D features (bfloat16: summed in float32) is the dot product
    # it stands for: the matmul tiles, one dot_general per tile and no (bj, bi, D)
    # product; values, reverse and forward mode as f on every pair
    x, y = (0.5 * a for a in inputs())
    x, y = x.astype(dtype), y.astype(dtype)
    f = lambda a, b: jnp.sum(a * jnp.tanh(b)) + b[0]
    ours = lambda x, y: ajm.pairwise(f, x, y, ajm.LOGSUMEXP, tiles=TILES)
    plain = lambda x, y: jax.nn.logsumexp(dense(f, x, y).astype(jnp.float32), 1).astype(dtype)
    with ajm.config(backend=backend):
        plan = ajm.explain_pairwise(f, x, y, ajm.LOGSUMEXP, tiles=TILES)
        assert "matmul" in plan.engine + plan.reason and f"contracts {D} features" in str(plan)
        bi, bj = TILES
        for run in (ours, jax.grad(lambda x, y: jnp.sum(ours(x, y)), (0, 1))):
            text = str(jax.make_jaxpr(run)(x, y))
            assert "dot_general" in text and f"[{bj},{bi},{D}]" not in text, text
        got = jax.jit(lambda x, y: _derivatives(ours, x, y))(x, y)
    tol = dict(rtol=2e-4, atol=2e-4) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)
    assert_tree_close(got, _derivatives(plain, x, y), **tol)


def _derivatives(run, x, y):
    """``run(x, y)``, its jvp w.r.t. x and y, and the gradient of a sum of sines."""
    loss = lambda x, y: jnp.sum(jnp.sin(run(x, y).astype(jnp.float32)))
    jvp = jax.jvp(run, (x, y), (jnp.ones_like(x), jnp.ones_like(y)))[1]
    return run(x, y), jvp, jax.grad(loss, (0, 1))(x, y)


@pytest.mark.parametrize("d", [3, 16, 128])
def test_squared_distances_far_from_the_origin(d):
    # points 100 from the origin, their distances ~1e-4 of their norms: the k-NN
    # distances over d features stay within a few float32 roundings of float64 on the
    # same inputs, direct below 16 features, expanded centred on the y tile's mean from
    # 16 (uncentred, they lost 1e-2 and 10-30% of the neighbour sets: the module
    # docstring of pairs/matmul.py); a dot over 32 features sends f to the matmul tiles
    x, y = 100 + normal(2, (200, max(d, 32))), 100 + normal(3, (300, max(d, 32)))
    f = lambda a, b: (jnp.sum((a[:d] - b[:d]) ** 2), jnp.dot(a, b))
    red = (ajm.top_k(5, smallest=True), ajm.ADD)
    plan = ajm.explain_pairwise(f, x, y, red, tiles=(64, 128))
    form = EXPANDED if d >= 16 else "direct (fewer than 16"
    assert plan.engine == MATMUL and f"over {d} features {form}" in str(plan), str(plan)
    (got, idx), _ = ajm.pairwise(f, x, y, red, tiles=(64, 128))
    x64, y64 = np.float64(x[:, :d]), np.float64(y[:, :d])
    exact = np.sum((x64[:, None] - y64[None]) ** 2, -1)
    np.testing.assert_allclose(np.float64(got), np.sort(exact, 1)[:, :5], rtol=1e-5)
    np.testing.assert_array_equal(idx, np.argsort(exact, 1)[:, :5])


def test_keeping_inf_reverse_keeps_infinities_in_its_cotangents():
    # a TPU's float32 dot in bfloat16 passes (whose low parts, inf - inf, are NaN),
    # as Mosaic's was on a v5e, emulated on the CPU: the product and its cotangents
    # are NaN where the plain dot's are infinite, and keeping_inf_reverse gives the plain ones
    def split_dot(params, a, b):
        one = jnp.dot(a, b)  # one pass (the default precision)
        return one if params else one + jnp.dot(a - a, b - b)

    a = normal(0, (5, 8)).at[1, 3].set(jnp.inf)
    b = normal(1, (8, 6)).at[2, 4].set(-jnp.inf)
    ct = normal(2, (5, 6))
    plain_out, plain_vjp = jax.vjp(jnp.dot, a, b)
    split_out, split_vjp = jax.vjp(functools.partial(split_dot, {}), a, b)
    kept_out, kept_vjp = jax.vjp(functools.partial(keeping_inf_reverse, split_dot), a, b)
    assert jnp.isnan(split_out).any() and not jnp.isnan(plain_out).any()
    assert any(jnp.isnan(d).any() for d in split_vjp(ct))
    assert not any(jnp.isnan(d).any() for d in plain_vjp(ct))
    assert_tree_close(kept_out, plain_out, rtol=1e-6, atol=0)
    assert_tree_close(kept_vjp(ct), plain_vjp(ct), rtol=1e-6, atol=0)


@pytest.mark.parametrize("on", ["gpu", "tpu"])
def test_matmul_kernels_interpreted_every_order(on, monkeypatch):
    # jvp, grad of grad and forward over reverse (a Hessian-vector product) through the
    # matmul tile kernels, interpreted, expanded distances at HIGHEST: under jax.jvp of
    # a gradient the forward kernel's states are differentiated in forward mode, which
    # a custom_vjp refuses (the TPU's dots keep infinities by one in the reverse kernel
    # only: pairs.precision.keeping_inf_reverse)
    monkeypatch.setattr(pairs_api, "INTERPRET_LAYOUT", on)
    x, y = 0.2 * normal(0, (13, 64)), 0.2 * normal(1, (21, 64))
    f = lambda a, b: -jnp.sum((a - b) ** 2) / 8
    ours = lambda x, y: ajm.pairwise(f, x, y, ajm.LOGSUMEXP, tiles=(4, 8))
    plain = lambda x, y: jax.nn.logsumexp(dense(f, x, y), axis=1)
    loss = lambda run: lambda x, y: jnp.sum(jnp.sin(run(x, y)))
    tx, ty = jnp.cos(3 * x), jnp.sin(2 * y)

    def orders(run):
        jvp = jax.jvp(run, (x, y), (tx, ty))[1]
        grad2 = jax.grad(lambda x, y: jnp.sum(jax.grad(loss(run))(x, y) ** 2), (0, 1))(x, y)
        hvp = jax.jvp(lambda x: jax.grad(loss(run))(x, y), (x,), (tx,))[1]
        return jvp, grad2, hvp

    with ajm.config(backend="interpret"):
        plan = ajm.explain_pairwise(f, x, y, ajm.LOGSUMEXP, tiles=(4, 8))
        got = orders(ours)
    assert f"{on} matmul tile kernel, interpreted" in plan.reason, str(plan)
    assert_tree_close(got, orders(plain), rtol=1e-4, atol=1e-4)
