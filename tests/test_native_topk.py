"""The native top-k fold (kernels/cpu/topk.cc through adv_jax_math.kernels.native) and
the matmul tiles that fold k-NN's tiles with it on the CPU.

Oracles: a NumPy sort of every candidate by the documented order (IEEE total order,
NaN above +inf, ties to the lower row) and ``lax.top_k``; for the tiles, the same call
with the native kernels off and the dense ``lax.top_k`` of the distances.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close

import adv_jax_math as ajm
from adv_jax_math.kernels import native as _native

EMPTY = np.iinfo(np.int32).max


@pytest.fixture(autouse=True)
def loaded() -> None:
    if os.environ.get("ADV_JAX_MATH_NATIVE", "").strip().lower() == "off":
        pytest.skip("ADV_JAX_MATH_NATIVE=off")
    ok, why = _native.status()
    assert ok, f"native library did not load: {why}"


def order_key(v: np.ndarray, smallest: bool) -> np.ndarray:
    """The documented rank of float32 values, higher is better (NumPy, int64)."""
    bits = np.asarray(v, np.float32).view(np.int32).astype(np.int64)
    key = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = np.where(np.isnan(v), 0x7FFFFFFF, key)
    return -key - 1 if smallest else key


def oracle(values, idx, alive, vals, rows, smallest):
    """The k best of the state's filled slots and the block's alive rows, per item."""
    k, t = vals.shape
    out_v, out_r = np.zeros((k, t), np.float32), np.full((k, t), EMPTY, np.int32)
    for i in range(t):
        cand = [(v, r) for v, r in zip(vals[:, i], rows[:, i], strict=True) if r != EMPTY]
        cand += [(v, r) for v, r, a in zip(values[:, i], idx, alive, strict=True) if a]
        cand.sort(key=lambda c: (-order_key(np.float32(c[0]), smallest), c[1]))
        for s, (v, r) in enumerate(cand[:k]):
            out_v[s, i], out_r[s, i] = v, r
    return out_v, out_r


def special_block(rng, rows: int, items: int) -> np.ndarray:
    """Values with many ties, signed zeros, infinities and NaN."""
    pool = np.array([0.0, -0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, np.nan, 1e30, -1e-30], np.float32)
    v = rng.integers(-3, 4, (rows, items)).astype(np.float32)
    special = rng.random((rows, items)) < 0.3
    return np.where(special, rng.choice(pool, (rows, items)), v).astype(np.float32)


def state(rng, k: int, items: int, smallest: bool, below: int):
    """A state of rows below ``below`` (the oracle's fold of a random block), with
    some of each item's last slots emptied."""
    block = special_block(rng, 2 * k, items)
    idx = rng.permutation(below)[: 2 * k].astype(np.int32)
    empty = np.zeros((k, items), np.float32), np.full((k, items), EMPTY, np.int32)
    vals, rows = oracle(block, idx, np.ones(2 * k, bool), *empty, smallest)
    kept = np.arange(k)[:, None] < rng.integers(0, k + 1, items)
    return np.where(kept, vals, 0).astype(np.float32), np.where(kept, rows, EMPTY).astype(np.int32)


@pytest.mark.parametrize("alive_share", [0.8, 1.0])
@pytest.mark.parametrize("smallest", [False, True])
@pytest.mark.parametrize("k", [1, 3, 8, 13])
def test_fold_matches_the_sorted_oracle(smallest, k, alive_share):
    rng = np.random.default_rng(k + 10 * smallest + int(100 * alive_share))
    # items not a multiple of the kernel's 8 lanes, rows not of its 4-row tests
    rows, items = 37, 21
    values = special_block(rng, rows, items)
    idx = (100 + rng.permutation(rows)).astype(np.int32)  # not in order
    alive = (rng.random(rows) < alive_share).astype(np.int32)
    vals, srows = state(rng, k, items, smallest, 100)
    got = jax.jit(_native.topk_fold, static_argnames="smallest")(
        values, idx, alive, vals, srows, smallest=smallest
    )
    want = oracle(values, idx, alive.astype(bool), vals, srows, smallest)
    np.testing.assert_array_equal(np.asarray(got[1]), want[1])
    # bit for bit: -0.0 against +0.0, NaN where NaN
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.int32), want[0].view(np.int32))


def test_fold_matches_lax_top_k_and_batches_under_vmap():
    rng = np.random.default_rng(0)
    b, rows, items, k = 3, 50, 40, 5
    values = rng.integers(0, 20, (b, rows, items)).astype(np.float32)  # ties
    empty = np.zeros((b, k, items), np.float32), np.full((b, k, items), EMPTY, np.int32)
    idx = np.broadcast_to(np.arange(rows, dtype=np.int32), (b, rows))
    alive = np.ones((b, rows), np.int32)
    fold = jax.vmap(lambda *a: _native.topk_fold(*a, smallest=False))
    vals, rows_ = jax.jit(fold)(values, idx, alive, *empty)
    want_v, want_r = jax.lax.top_k(np.moveaxis(values, 1, -1), k)  # ties to the lower row
    np.testing.assert_array_equal(np.asarray(rows_), np.moveaxis(np.asarray(want_r), -1, 1))
    np.testing.assert_array_equal(np.asarray(vals), np.moveaxis(np.asarray(want_v), -1, 1))


@pytest.mark.parametrize("smallest", [False, True])
def test_fold_over_threads_matches_one_thread_and_lax_top_k(monkeypatch, smallest):
    # 2 x 400 rows x 203 items: past the kernel's 2^16 elements, each batch element's
    # items in one chunk per XLA CPU thread (the last one ragged)
    rng = np.random.default_rng(7)
    b, rows, items, k = 2, 400, 203, 10
    values = rng.standard_normal((b, rows, items)).astype(np.float32)
    values[:, ::7] = np.round(values[:, ::7])  # ties
    empty = np.zeros((b, k, items), np.float32), np.full((b, k, items), EMPTY, np.int32)
    idx = np.broadcast_to(np.arange(rows, dtype=np.int32), (b, rows))
    alive = np.ones((b, rows), np.int32)
    fold = jax.jit(jax.vmap(lambda *a: _native.topk_fold(*a, smallest=smallest)))
    got = fold(values, idx, alive, *empty)
    monkeypatch.setenv("ADV_JAX_MATH_NATIVE_THREADS", "1")  # read by the kernel per call
    one = fold(values, idx, alive, *empty)
    sign = -1 if smallest else 1
    want_v, want_r = jax.lax.top_k(sign * np.moveaxis(values, 1, -1), k)
    for a in (got, one):
        np.testing.assert_array_equal(np.asarray(a[1]), np.moveaxis(np.asarray(want_r), -1, 1))
        np.testing.assert_array_equal(
            np.asarray(a[0]), sign * np.moveaxis(np.asarray(want_v), -1, 1)
        )


def test_fold_rejects_mismatched_shapes():
    v = np.zeros((4, 3), np.float32)
    i = np.zeros(4, np.int32)
    state = np.zeros((2, 5), np.float32), np.zeros((2, 5), np.int32)  # 5 items, not 3
    with pytest.raises(Exception, match=r"need values \(\*B, R, T\).*state \(\*B, K, T\)"):
        jax.block_until_ready(
            jax.jit(_native.topk_fold, static_argnames="smallest")(v, i, i, *state, smallest=True)
        )


def sqdist(a, b):
    return jnp.sum((a - b) ** 2)


def knn(x, y, k=10, tiles="auto"):
    return ajm.pairwise(sqdist, x, y, ajm.top_k(k, smallest=True), tiles=tiles)


def points(n, m, d=128, seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, d)), jax.random.normal(ky, (m, d))


TILES = {3: "pairwise tiles (xla)", 128: "pairwise tiles (matmul)"}  # by the features


@pytest.mark.parametrize("d", list(TILES))
def test_cpu_tiles_fold_top_k_natively_and_agree_with_it_off(d):
    x, y = points(300, 2100, d)
    call = lambda x, y: knn(x, y)
    assert ajm.explain_pairwise(sqdist, x, y, ajm.top_k(10, smallest=True)).engine == TILES[d]
    assert _native.TOPK_TARGET in jax.jit(call).lower(x, y).as_text()
    plan = ajm.explain_pairwise(sqdist, x, y, ajm.top_k(10, smallest=True))
    assert "top_k folded by the native kernel" in plan.reason, plan.reason
    got = jax.jit(call)(x, y)
    with ajm.config(native="off"):
        assert _native.TOPK_TARGET not in jax.jit(call).lower(x, y).as_text()
        plan = ajm.explain_pairwise(sqdist, x, y, ajm.top_k(10, smallest=True))
        assert "top_k by lax.top_k and merges (native kernel not used: disabled" in plan.reason
        off = jax.jit(call)(x, y)
    # the same tiles and values: the same selection, bit for bit
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(off[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(off[0]))
    # and the dense oracle's (distances computed directly)
    d = jnp.sum((x[:, None] - y[None]) ** 2, -1)
    want_v, want_i = jax.lax.top_k(-d, 10)
    assert float(jnp.mean(jnp.all(got[1] == want_i, 1))) > 0.99  # near ties may swap
    np.testing.assert_allclose(np.asarray(got[0]), -np.asarray(want_v), rtol=2e-5)


# by default each mode on one of the tiles, each tiles at least once (the rest slow)
@pytest.mark.parametrize(
    "mode, d",  # d: the unrolled tiles (3), the matmul tiles (32)
    [
        pytest.param(mode, d, marks=() if (i + j) % 2 == 0 else pytest.mark.slow)
        for i, mode in enumerate(["grad", "jvp", "hvp"])
        for j, d in enumerate([3, 32])
    ],
)
def test_derivatives_through_the_native_fold_match_it_off(mode, d):
    # f closes over a traced scale s; ragged tiles (the last y tile's rows weighted
    # out); forward over reverse traces the fold's rule apart from its primal
    x, y = points(130, 700, d=d, seed=1)
    knn_of = lambda run: lambda s, x, y: run(lambda a, b: s * sqdist(a, b), x, y)[0]
    ours = knn_of(
        lambda f, x, y: ajm.pairwise(f, x, y, ajm.top_k(4, smallest=True), tiles=(32, 48))
    )
    pairs = lambda f, x, y: jax.vmap(jax.vmap(f, (None, 0)), (0, None))(x, y)
    dense = knn_of(lambda f, x, y: (-jax.lax.top_k(-pairs(f, x, y), 4)[0],))
    loss = lambda run: lambda *a: jnp.sum(jnp.sin(run(*a)))
    args, tangent = (0.7, x, y), (1.0, jnp.cos(x), 0.5 * y)
    derivative = {
        "grad": lambda run: jax.grad(loss(run), (0, 1, 2)),
        "jvp": lambda run: lambda *a: jax.jvp(run, a, tangent),
        "hvp": lambda run: lambda *a: jax.jvp(jax.grad(loss(run), (0, 1, 2)), a, tangent)[1],
    }[mode]
    got = jax.jit(derivative(ours))(*args)
    with ajm.config(native="off"):
        off = jax.jit(derivative(ours))(*args)
    assert_tree_close(got, off, rtol=1e-6, atol=1e-6)
    assert_tree_close(got, derivative(dense)(*args), rtol=2e-3, atol=2e-3)


def test_vmapped_pairwise_top_k_on_the_native_fold():
    x, y = points(2 * 150, 900, d=24, seed=2)
    x = x.reshape(2, 150, 24)
    got = jax.jit(jax.vmap(lambda x: knn(x, y, 3)))(x)
    with ajm.config(native="off"):
        off = jax.vmap(lambda x: knn(x, y, 3))(x)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(off[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(off[0]))


def test_largest_with_infinities_and_nan_rows():
    # scores x.y, largest first; rows of y with NaN and inf: the order of lax.top_k
    x, y = points(64, 500, d=16, seed=3)
    y = y.at[7].set(jnp.nan).at[11].set(jnp.inf).at[13].set(-jnp.inf)
    f = lambda a, b: jnp.dot(a, b)
    got = jax.jit(lambda x, y: ajm.pairwise(f, x, y, ajm.top_k(5)))(x, y)
    with ajm.config(native="off"):
        off = jax.jit(lambda x, y: ajm.pairwise(f, x, y, ajm.top_k(5)))(x, y)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(off[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(off[0]))
    scores = jax.vmap(jax.vmap(f, (None, 0)), (0, None))(x, y)  # f on every pair
    # top_k ranks every NaN above +inf whatever its sign bit (inf - inf is -NaN on
    # x86, which lax.top_k ranks last)
    scores = jnp.where(jnp.isnan(scores), jnp.nan, scores)
    want_v, want_i = jax.lax.top_k(scores, 5)
    np.testing.assert_array_equal(np.asarray(got[1])[:, :3], np.asarray(want_i)[:, :3])
    assert np.isnan(np.asarray(got[0])[:, :3]).all()
    np.testing.assert_allclose(np.asarray(got[0])[:, 3:], np.asarray(want_v)[:, 3:], rtol=1e-5)


def test_only_the_cpu_lowering_calls_the_kernel():
    # the tiles' plan is the CPU's; lowered for a GPU or TPU (jax.export), the fold is
    # the plain-JAX one (lax.platform_dependent): no custom call the device lacks
    x, y = points(300, 2100)
    call = jax.jit(lambda x, y: knn(x, y))
    checks = [jax.export.DisabledSafetyCheck.custom_call(_native.TOPK_TARGET)]
    lowered = lambda platforms: jax.export.export(
        call, platforms=platforms, disabled_checks=checks
    )(x, y).mlir_module()
    assert _native.TOPK_TARGET in lowered(["cpu"])
    assert _native.TOPK_TARGET not in lowered(["tpu"])
    assert _native.TOPK_TARGET not in lowered(["cuda"])
    both = lowered(["cpu", "tpu"])  # one module, the branch chosen by the platform
    assert _native.TOPK_TARGET in both and "stablehlo.case" in both
