"""The monoid objects whose state is not their result (arg-extrema, top-k, softmax-
weighted sums, means and variances), table-driven against their plain-JAX
expressions: every engine (scan, the kernel in interpret mode, 4 devices), n
divisible, not, 0 and 1, float32 / bfloat16 / int32 / float64 under x64, pytree
leaves, exact ties across chunk borders and in the overlapped rows, gradients
against ``jax.grad`` of the oracle. Indices and selections are compared exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, enable_x64, engine
from jax import lax

import adv_jax_math as ajm


def top_k_oracle(k, smallest=False):
    def f(y):
        yt = jnp.moveaxis(y, 0, -1)
        v, i = lax.top_k(-yt if smallest else yt, k)
        return jnp.moveaxis(-v if smallest else v, -1, 0), jnp.moveaxis(i, -1, 0)

    return f


# name: (monoid, oracle of fun's output, accepts integers)
TABLE = {
    "ARGMIN": (ajm.ARGMIN, lambda y: jnp.argmin(y, 0), True),
    "ARGMAX": (ajm.ARGMAX, lambda y: jnp.argmax(y, 0), True),
    "MIN_ARGMIN": (ajm.MIN_ARGMIN, lambda y: (jnp.min(y, 0), jnp.argmin(y, 0)), True),
    "MAX_ARGMAX": (ajm.MAX_ARGMAX, lambda y: (jnp.max(y, 0), jnp.argmax(y, 0)), True),
    "top_k(3)": (ajm.top_k(3), top_k_oracle(3), True),
    "top_k(3, smallest)": (ajm.top_k(3, smallest=True), top_k_oracle(3, True), True),
    "MEAN": (ajm.MEAN, lambda y: jnp.mean(y, 0), True),
    "VAR": (ajm.VAR, lambda y: jnp.var(y, 0), True),
    "var(ddof=1)": (ajm.var(ddof=1), lambda y: jnp.var(y, 0, ddof=1), True),
    "MEAN_VAR": (ajm.MEAN_VAR, lambda y: (jnp.mean(y, 0), jnp.var(y, 0)), True),
}
ENGINES = ["scan", "interpret", "shard"]
B = 8
SIZES = [24, 29, 1]  # divisible by B, overlapping chunks, one row


def one_engine_each(names: list[str], start: int = 0) -> list:
    """``(name, engine_name)`` params: by default every name on one engine, the engines
    in turn from ``start`` (each on a third of the names); the rest of the product
    marked slow (``make test-slow`` runs it)."""
    return [
        pytest.param(name, e, marks=() if j == (i + start) % len(ENGINES) else pytest.mark.slow)
        for i, name in enumerate(names)
        for j, e in enumerate(ENGINES)
    ]


def data(n, dtype, seed=0):
    """Values with ties: a few distinct values repeated across rows and columns."""
    rng = np.random.default_rng(seed)
    y = rng.integers(-4, 5, (n, 3)).astype(np.float32) + rng.normal(size=(n, 3)) * (seed % 2)
    return jnp.asarray(y, dtype)


def fun(x):
    return x * 2 + 1


def tolerance(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)


def check(name, got, want, dtype):
    # indices exact, values within the dtype's tolerance (each leaf's own dtype)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g, w)
        if jnp.issubdtype(w.dtype, jnp.integer):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
        else:
            assert_tree_close(g, w, **tolerance(dtype))


@pytest.mark.parametrize(("name", "engine_name"), one_engine_each(list(TABLE)))
def test_matches_plain_jax(name, engine_name):
    monoid, oracle, ints = TABLE[name]
    with engine(engine_name) as kw:
        for n in SIZES:
            if isinstance(monoid, type(ajm.top_k(1))) and n < monoid.k:
                with pytest.raises(ValueError, match="at least k=3 rows"):
                    ajm.batch_map(fun, data(n, jnp.float32), B, reduction=monoid, **kw)
                continue
            x = data(n, jnp.float32, seed=n)
            check(
                name, ajm.batch_map(fun, x, B, reduction=monoid, **kw), oracle(fun(x)), jnp.float32
            )
        for dtype in [jnp.bfloat16] + ([jnp.int32] if ints else []):
            x = data(29, dtype, seed=3)
            check(name, ajm.batch_map(fun, x, B, reduction=monoid, **kw), oracle(fun(x)), dtype)
        with enable_x64():
            x = data(29, jnp.float64, seed=5)
            got = ajm.batch_map(fun, x, B, reduction=monoid, **kw)
            assert_tree_close(got, oracle(fun(x)))  # float64 values, int64 indices


@pytest.mark.parametrize("name", list(TABLE))
def test_zero_rows(name):
    monoid, oracle, _ = TABLE[name]
    x = jnp.zeros((0, 3))
    try:
        want = oracle(fun(x))
    except (ValueError, IndexError, TypeError):
        with pytest.raises(ValueError, match=r"zero rows|at least k"):
            ajm.batch_map(fun, x, B, reduction=monoid)
        return
    assert_tree_close(ajm.batch_map(fun, x, B, reduction=monoid), want)  # NaN means


@pytest.mark.parametrize("engine_name", ENGINES)
def test_ties_across_chunk_borders_and_overlapped_rows(engine_name):
    # 29 rows in chunks of 8 start at 0, 8, 16 and 21: rows 21-23 are in two chunks.
    y = np.zeros((29, 2), np.float32)
    y[:, 0] = 5.0
    y[[7, 8, 22], 0] = -3.0  # min tied at a chunk border and in the overlap
    y[:, 1] = np.arange(29) % 4  # max 3 tied at rows 3, 7, 11, ..., 27 (overlap: 23)
    y = jnp.asarray(y)
    with engine(engine_name) as kw:
        got = ajm.batch_map(lambda t: t, y, B, reduction=ajm.MIN_ARGMIN, **kw)
        check("min", got, (jnp.min(y, 0), jnp.argmin(y, 0)), jnp.float32)
        got = ajm.batch_map(lambda t: t, y, B, reduction=ajm.top_k(5), **kw)
        check("top_k", got, top_k_oracle(5)(y), jnp.float32)  # lower rows first, none twice
        got = ajm.batch_map(lambda t: t, y, B, reduction=ajm.top_k(4, smallest=True), **kw)
        check("top_k smallest", got, top_k_oracle(4, True)(y), jnp.float32)
        grad = jax.grad(
            lambda v: ajm.batch_map(lambda t: t, v, B, reduction=ajm.MIN_ARGMIN, **kw)[0].sum()
        )
        assert_tree_close(grad(y), jax.grad(lambda v: jnp.min(v, 0).sum())(y))  # 1/3 each


DIFFERENTIABLE = ["MIN_ARGMIN", "MAX_ARGMAX", "top_k(3)", "MEAN", "VAR", "var(ddof=1)", "MEAN_VAR"]


@pytest.mark.parametrize(("name", "engine_name"), one_engine_each(DIFFERENTIABLE, start=1))
def test_gradients_match_jax_grad(name, engine_name):
    monoid, oracle, _ = TABLE[name]
    x = data(29, jnp.float32, seed=1)
    w = jnp.array([0.5, -1.0, 2.0])
    floats = lambda out: sum(
        jnp.sum(v * (i + 1)) for i, v in enumerate(jax.tree.leaves(out)) if v.dtype == jnp.float32
    )
    with engine(engine_name) as kw:
        ours = lambda x, w: floats(
            ajm.batch_map(lambda t: jnp.sin(t * w), x, B, reduction=monoid, **kw)
        )
        got = jax.grad(ours, argnums=(0, 1))(x, w)
        fwd = jax.jvp(lambda w: ours(x, w), (w,), (jnp.ones(3),))
    plain = lambda x, w: floats(oracle(jnp.sin(x * w)))
    assert_tree_close(got, jax.grad(plain, argnums=(0, 1))(x, w), rtol=1e-4, atol=1e-4)
    assert_tree_close(
        fwd, jax.jvp(lambda w: plain(x, w), (w,), (jnp.ones(3),)), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("return_lse", [False, True])
def test_softmax_weighted(engine_name, return_lse):
    monoid = ajm.softmax_weighted(return_lse=return_lse)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(29, 3)), jnp.float32)
    vals = jnp.asarray(rng.normal(size=(29, 5)), jnp.float32)

    def attend(kv, q):  # (scores (n, queries), values (n, d))
        k, v = kv
        return k @ q.T, v

    def plain(kv, q):
        s, v = attend(kv, q)
        out = jnp.tensordot(jax.nn.softmax(s, 0), v, ([0], [0]))
        return (out, jax.nn.logsumexp(s, 0)) if return_lse else out

    with engine(engine_name) as kw:
        ours = lambda kv, q: ajm.batch_map(lambda r: attend(r, q), kv, B, reduction=monoid, **kw)
        assert_tree_close(ours((keys, vals), q), plain((keys, vals), q), rtol=1e-5, atol=1e-5)
        loss = lambda f: lambda kv, q: sum(jnp.sum(o**2) for o in jax.tree.leaves(f(kv, q)))
        got = jax.grad(loss(ours), argnums=(0, 1))((keys, vals), q)
    want = jax.grad(loss(plain), argnums=(0, 1))((keys, vals), q)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-4)
    empty = ajm.batch_map(lambda r: attend(r, q), (keys[:0], vals[:0]), B, reduction=monoid)
    assert_tree_close(empty, plain((keys[:0], vals[:0]), q))  # a sum over no rows: zeros


def test_pytree_leaves_and_pytrees_of_monoids():
    x = data(29, jnp.float32, seed=2)
    two = lambda t: {"a": t * 2, "b": t[:, 0] - 1}
    got = ajm.batch_map(two, x, B, reduction=ajm.ARGMAX)  # one monoid for every leaf
    check("leaves", got, jax.tree.map(lambda y: jnp.argmax(y, 0), two(x)), jnp.float32)
    got = ajm.batch_map(two, x, B, reduction={"a": ajm.MEAN_VAR, "b": ajm.top_k(2, smallest=True)})
    want = {
        "a": (jnp.mean(two(x)["a"], 0), jnp.var(two(x)["a"], 0)),
        "b": top_k_oracle(2, True)(two(x)["b"]),
    }
    check("pytree", got, want, jnp.float32)
    with pytest.raises(ValueError, match="prefix"):
        ajm.batch_map(two, x, B, reduction={"a": ajm.MEAN, "c": ajm.MEAN})


def test_variance_of_data_with_a_large_offset():
    # 2^18 float32 values around 1000: Welford per chunk and Chan's merge keep the
    # error at jnp.var's (the naive E[y^2] - E[y]^2 loses every digit).
    y = 1000.0 + np.random.default_rng(0).normal(size=2**18).astype(np.float32)
    exact = np.var(y.astype(np.float64))
    ours = float(ajm.batch_map(lambda t: t, jnp.asarray(y), 4096, reduction=ajm.VAR))
    plain = float(jnp.var(jnp.asarray(y)))
    assert abs(ours - exact) / exact <= max(2 * abs(plain - exact) / exact, 1e-6)


def test_look_alikes_name_the_monoid_to_use():
    x = data(29, jnp.float32)
    with pytest.raises(ValueError, match=r"not associative.*adv_jax_math\.MEAN"):
        ajm.explain(
            fun, x, B, reduction=lambda a, b: (a + b) / 2, chunk_reduction=lambda y: jnp.mean(y, 0)
        )
    arg = ajm.explain(fun, x, B, reduction=jnp.minimum, chunk_reduction=lambda y: jnp.argmin(y, 0))
    assert "adv_jax_math.ARGMIN" in arg.recognition, str(arg)
    topk = ajm.explain(
        fun, x, B, reduction=jnp.maximum, chunk_reduction=lambda y: lax.top_k(y.T, 2)[0]
    )
    assert "top_k" in topk.recognition, str(topk)


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("smallest", [False, True])
def test_top_k_scan_chunks_equal_lax_top_k(dtype, smallest):
    """The scan engine's one-lax.top_k fold (``TopK.fold_fast``), the overlapping last
    chunk's repeated rows left out, equals lax.top_k: ties everywhere, and a column of
    the lowest key but its last row, where a repeated row would be selected (and
    counted twice) unless the exact fold serves that chunk."""
    rng = np.random.default_rng(0)
    for n, batch, k in [(37, 8, 3), (64, 16, 3), (1003, 100, 5), (10, 4, 3), (5, 4, 4)]:
        y = rng.integers(-3, 3, size=(n, 4)).astype(dtype)
        ints = dtype == np.int32
        lowest = np.iinfo(np.int32).min if ints else -np.inf
        highest = np.iinfo(np.int32).max if ints else np.inf
        y[:, 3] = highest if smallest else lowest  # the lowest key (no -y: it wraps)
        y[-1, 3] = 1
        with ajm.config(backend="scan", remainder="overlap"):
            got = ajm.batch_map(
                lambda t: t, jnp.asarray(y), batch, reduction=ajm.top_k(k, smallest)
            )
        _, indices = lax.top_k(jnp.asarray(-y if smallest else y).T, k)  # the definition
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(indices).T)
        np.testing.assert_array_equal(
            np.asarray(got[0]), np.asarray(y)[np.asarray(indices).T, np.arange(4)]
        )


def test_top_k_fast_fold_never_selects_a_left_out_row():
    """A block whose left-out (weight 0) rows would be among the k selected by one
    lax.top_k: the fast fold gives the exact fold's state (the exact fold serves)."""
    monoid = ajm.top_k(4)
    y = jnp.array([[7], [np.iinfo(np.int32).min], [np.iinfo(np.int32).min], [3], [2]], jnp.int32)
    idx, w = jnp.arange(5), jnp.array([0.0, 0.0, 1.0, 1.0, 1.0])
    fast, exact = monoid.fold_fast([y], idx, w), monoid.fold([y], idx, w)
    assert_tree_close(fast, exact)
    assert 0 not in np.asarray(jnp.stack(fast[1])) and 1 not in np.asarray(jnp.stack(fast[1]))


@pytest.mark.parametrize("smallest", [False, True])
def test_top_k_fast_fold_of_fewer_rows_than_k(smallest):
    """A block of fewer live rows than k (a left-out row among them): the fast fold
    selects the live rows as lax.top_k does and leaves the other slots empty (value
    0, row ``iinfo.max``), as the exact fold and ``init`` do."""
    monoid = ajm.top_k(5, smallest)
    y = np.array([[2.0, np.nan], [9.0, 1.0], [-0.0, 0.0]], np.float32)
    idx, w = jnp.array([10, 11, 12]), jnp.array([1.0, 0.0, 1.0])
    values, rows = jax.jit(monoid.fold_fast)([jnp.asarray(y)], idx, w)
    live = y[[0, 2]]
    _, pos = lax.top_k(jnp.asarray(-live if smallest else live).T, 2)
    empty = np.iinfo(np.int32).max
    np.testing.assert_array_equal(np.stack(rows)[:2], np.array([10, 12])[np.asarray(pos).T])
    np.testing.assert_array_equal(np.stack(rows)[2:], np.full((3, 2), empty))
    got = np.stack(values)
    np.testing.assert_array_equal(got[:2], np.take_along_axis(live, np.asarray(pos).T, 0))
    np.testing.assert_array_equal(got[2:], np.zeros((3, 2), np.float32))


def _equations(jaxpr) -> int:
    """Equations of ``jaxpr`` and of the jaxprs inside it (loop bodies, branches)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                n += _equations(sub) if hasattr(sub, "eqns") else 0
    return n


@pytest.mark.parametrize("route", ["batch_map", "pairwise"])
def test_top_k_merges_out_of_kernels_stay_small(route):
    """Outside kernels top-k's states merge by whole-array rounds (``merge_fast``), a
    few equations per doubling of k: the network unrolled slot by slot (k/2 log2 k
    compare-exchanges) took XLA 48 s to compile pairwise top_k(32). Tiles of fewer
    rows than k fold by one lax.top_k too, not k passes of max-and-remove. Counted,
    not timed: at k = 32 the unrolled merge alone is over 4000 equations."""
    y = jnp.zeros((90, 3), jnp.float32)  # the last tile part padding (rows left out)
    sq = lambda a, b: jnp.sum((a - b) ** 2)

    def size(k):
        red = ajm.top_k(k, smallest=True)
        if route == "batch_map":
            fun = lambda y: ajm.batch_map(lambda t: t, y, 64, reduction=red)
        else:
            fun = lambda y: ajm.pairwise(sq, y[:5], y, red, tiles=(8, 16))  # rows < k
        return _equations(jax.make_jaxpr(fun)(y).jaxpr)

    small, large = size(2), size(32)
    assert large < small + 1000, (small, large)
