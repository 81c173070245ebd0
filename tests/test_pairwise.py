"""Pairwise reductions ``out_i = reduce_j f(x_i, y_j)`` against the dense oracle.

The oracle stores every pair: ``vmap(vmap(f))`` gives ``(N, M, ...)``, reduced along
axis 1 with plain JAX. Ragged N and M (no multiple of the tiles), duplicated y
rows across a tile border (ties: the first index, as jnp), every monoid, a pytree
of monoids, both engines (``pairwise scan``; ``pairwise kernel`` in interpret
mode), values and gradients with respect to x, y and a closed-over parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.pairwise import REDUCTIONS
from helpers import assert_tree_close, needs_abstract_devices, normal, on_abstract_device
from jax import lax

import adv_jax_math as ajm
from adv_jax_math.kernels.pairwise_device import DEVICE_KERNEL_NAME
from adv_jax_math.pairs import kernel as _pairwise_kernel

N, M, D, TILES = 37, 53, 3, (8, 16)
ENGINES = {
    "scan": "pairwise scan",
    "auto": "pairwise tiles (xla)",
    "interpret": "pairwise kernel (interpret)",
}


def points(n: int, seed: int) -> jax.Array:
    return normal(seed, (n, D))


def inputs():
    x, y = points(N, 0), points(M, 1)
    y = y.at[16].set(y[15])  # a tie across the border of the first two y tiles
    return x, y


def sqdist(xi, yj):
    return jnp.sum((xi - yj) ** 2)


def dense(f, x, y):
    return jax.vmap(jax.vmap(f, (None, 0)), (0, None))(x, y)


def _two_heads(xi, yj):  # two scores per pair (heads), each weighing the same values
    return jnp.stack([-sqdist(xi, yj), -jnp.abs(xi - yj).sum()]), yj[:2]


def _top_k(d, k, smallest):
    v, i = lax.top_k(-d if smallest else d, k)
    return (-v if smallest else v), i


# name: (reduction, f, oracle on the dense (N, M, ...) outputs): bench/cases/pairwise.py
CASES = {c.name: (c.reduction, c.f, c.oracle) for c in REDUCTIONS}


@pytest.mark.parametrize("backend", list(ENGINES))
@pytest.mark.parametrize("name", list(CASES))
def test_values_match_dense_oracle(name, backend):
    reduction, f, want = CASES[name]
    x, y = inputs()
    with ajm.config(backend=backend):
        plan = ajm.explain_pairwise(f, x, y, reduction, tiles=TILES)
        got = jax.jit(lambda x, y: ajm.pairwise(f, x, y, reduction, tiles=TILES))(x, y)
    assert plan.engine == ENGINES[backend] and plan.tiles == TILES, str(plan)
    assert_tree_close(got, want(dense(f, x, y)), rtol=2e-5, atol=2e-5)


DIFFERENTIABLE = [c.name for c in REDUCTIONS if c.differentiable]


def one_engine_each(names: list[str]) -> list:
    """``(name, backend)`` params: by default every name on one engine, the engines in
    turn (each on a third of the names); the rest of the product marked slow (``make
    test-slow`` runs it)."""
    engines = list(ENGINES)
    return [
        pytest.param(name, backend, marks=() if j == i % len(engines) else pytest.mark.slow)
        for i, name in enumerate(names)
        for j, backend in enumerate(engines)
    ]


def scaled_loss(f):
    """``loss(run, s, x, y)``: the sum of the sines of ``run(f scaled by s, x, y)``'s
    float leaves, for gradients w.r.t. x, y and a value ``f`` closes over."""
    scaled = lambda s: lambda a, b: jax.tree.map(lambda v: v * s, f(a, b))

    def loss(run, s, x, y):
        out = run(scaled(s), x, y)
        return sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(out) if v.dtype.kind == "f")

    return loss


@pytest.mark.parametrize(("name", "backend"), one_engine_each(DIFFERENTIABLE))
def test_gradients_match_dense_oracle(name, backend):
    # w.r.t. x, y and a parameter f closes over; reverse and forward mode
    reduction, f, want = CASES[name]
    x, y = inputs()
    loss = scaled_loss(f)
    ours = lambda g, x, y: ajm.pairwise(g, x, y, reduction, tiles=TILES)
    oracle = lambda g, x, y: want(dense(g, x, y))
    with ajm.config(backend=backend):
        got = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(0.7, x, y)
        fwd = jax.jit(lambda s: jax.jvp(lambda s: loss(ours, s, x, y), (s,), (1.0,)))(0.7)
    expect = jax.jit(jax.grad(lambda *a: loss(oracle, *a), argnums=(0, 1, 2)))(0.7, x, y)
    assert_tree_close(got, expect, rtol=2e-4, atol=2e-4)
    want_fwd = jax.jit(lambda s: jax.jvp(lambda s: loss(oracle, s, x, y), (s,), (1.0,)))(0.7)
    assert_tree_close(fwd, want_fwd, rtol=2e-4)


def test_kernel_holds_the_whole_forward():
    # interpret mode: one pallas_call, no scan or while loop outside it
    reduction, f, _ = CASES["logsumexp"]
    x, y = inputs()
    with ajm.config(backend="interpret"):
        jaxpr = jax.make_jaxpr(lambda x, y: ajm.pairwise(f, x, y, reduction, tiles=TILES))(x, y)
        text = jax.jit(lambda x, y: ajm.pairwise(f, x, y, reduction, tiles=TILES)).lower(x, y)
    outside = [e.primitive.name for e in _flat(jaxpr.jaxpr)]
    assert outside.count("pallas_call") == 1, outside
    assert not {"scan", "while"} & set(outside), outside
    assert DEVICE_KERNEL_NAME in text.as_text()  # the tile kernel GPUs run, interpreted


@pytest.mark.parametrize(
    "name, backend",
    [("logsumexp", "interpret"), ("max", "interpret"), ("top_k", "interpret"), ("top_k", "auto")],
)
def test_second_order_through_the_kernels(name, backend):
    # the reverse pass's own derivative: the kernel's states differentiated in plain JAX
    # (top_k: its values were constants there, so a loss nonlinear in them was wrong)
    reduction, f, want = CASES[name]
    x, y = points(9, 0), points(11, 1)
    loss = lambda run: lambda x: jnp.sum(jnp.sin(jax.tree.leaves(run(x))[0]))
    ours = loss(lambda x: ajm.pairwise(f, x, y, reduction, tiles=(4, 4)))
    with ajm.config(backend=backend):
        got = jax.jit(lambda x: (jax.hessian(ours)(x), jax.jvp(jax.grad(ours), (x,), (x,))))(x)
    oracle = loss(lambda x: want(dense(f, x, y)))
    expect = jax.jit(lambda x: (jax.hessian(oracle)(x), jax.jvp(jax.grad(oracle), (x,), (x,))))(x)
    assert_tree_close(got, expect, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_kernels_hold_the_whole_gradient(name):
    # value_and_grad w.r.t. x, y and a closed-over parameter: the forward kernel, a
    # tally for a max/min, a pass over x tiles and one over y tiles; no loop outside
    reduction, f, _ = CASES[name]
    x, y = inputs()

    def loss(s, x, y):
        out = ajm.pairwise(lambda a, b: jax.tree.map(lambda v: v * s, f(a, b)), x, y, reduction)
        return sum(jnp.sum(v) for v in jax.tree.leaves(out) if v.dtype.kind == "f")

    with ajm.config(backend="interpret"):
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(0.7, x, y)
        only_x = jax.make_jaxpr(jax.grad(loss, argnums=1))(0.7, x, y)
    outside = [e.primitive.name for e in _flat(jaxpr.jaxpr)]
    tallies = int(name in ("max", "min", "min_argmin", "max_argmax", "pytree"))
    assert outside.count("pallas_call") == 3 + tallies, outside
    # the tile kernel GPUs and TPUs run, forward and backward (vectors per pair too)
    kernels = {e.params["name"] for e in _flat(jaxpr.jaxpr) if e.primitive.name == "pallas_call"}
    assert kernels == {DEVICE_KERNEL_NAME}, kernels
    assert not {"scan", "while"} & set(outside), outside
    # no pass over y tiles for a gradient w.r.t. x alone
    assert [e.primitive.name for e in _flat(only_x.jaxpr)].count("pallas_call") == 2 + tallies


def _flat(jaxpr):
    """Equations of ``jaxpr``, calls (``pjit``, custom derivatives) entered, kernels not."""
    for e in jaxpr.eqns:
        body = e.params.get("jaxpr", e.params.get("call_jaxpr"))
        if e.primitive.name != "pallas_call" and body is not None:
            yield from _flat(getattr(body, "jaxpr", body))
        else:
            yield e


@pytest.mark.parametrize("backend", list(ENGINES))
def test_tiles_of_one_row_and_of_everything(backend):
    reduction, f, want = CASES["min_argmin"]
    x, y = inputs()
    with ajm.config(backend=backend):
        for tiles in [(1, 1), (N, M), (64, 64), (5, 52)]:
            got = ajm.pairwise(f, x, y, reduction, tiles=tiles)
            assert_tree_close(got, want(dense(f, x, y)))


def test_explain_names_engine_tiles_and_rejections():
    reduction, f, _ = CASES["logsumexp"]
    x, y = inputs()
    plan = ajm.explain_pairwise(f, x, y, reduction)
    text = str(plan)
    assert plan.engine == "pairwise tiles (xla)" and "every value a 53 x 37 tile" in text, text
    assert plan.tiles == (N, M) and "1 x tile(s), 1 y tile(s)" in text, text
    assert "rejected   : pairwise kernel: only on request on cpu (backend='interpret')" in text
    assert "rejected   : pairwise scan: f on tiles of pairs" in text, text
    vector = ajm.explain_pairwise(*CASES["softmax_weighted"][1:2], x, y, ajm.SOFTMAX_WEIGHTED)
    assert vector.engine == "pairwise tiles (xla)", str(vector)  # (2,) values per pair
    # "auto" tiles: 2^18 pairs, y in tiles of 2048 rows; for a top-k on the CPU tiles
    # y split evenly into tiles of at most 16384 rows (a multiple of 8), 2^21 pairs
    rows = lambda n: jax.ShapeDtypeStruct((n, D), jnp.float32)
    assert ajm.explain_pairwise(f, rows(10_000), rows(5_000), reduction).tiles == (128, 2048)
    knn = lambda n, m: ajm.explain_pairwise(sqdist, rows(n), rows(m), ajm.top_k(3)).tiles
    assert knn(10_000, 5_000) == (256, 5000) and knn(100_000, 10_007) == (128, 10_007)
    assert knn(10, 100_000) == (10, 14288)
    with ajm.config(backend="scan"):
        assert knn(10_000, 5_000) == (128, 2048)


MATMUL = "pairwise tiles (matmul)"


@pytest.mark.parametrize(
    ("d", "f", "engine", "why"),
    [
        (3, lambda a, b: -sqdist(a, b), "pairwise tiles (xla)", "pairwise scan: f on tiles"),
        (48, lambda a, b: -sqdist(a, b), "pairwise tiles (xla)", "pairwise scan: f on tiles"),
        (8, lambda a, b: a @ b, "pairwise tiles (xla)", "pairwise scan: f on tiles"),
        (16, lambda a, b: a @ b, MATMUL, "f contracts 16 features in a dot product"),
        (64, lambda a, b: -sqdist(a, b), MATMUL, "values per pair (over 128"),
    ],
)
def test_cpu_tiles_where_unrolling_pays(d, f, engine, why):
    # measured on XLA:CPU: a dot over 16+ features is a matmul on the matmul tiles
    x, y = jnp.ones((300, d)), jnp.ones((200, d))
    plan = ajm.explain_pairwise(f, x, y, ajm.LOGSUMEXP)
    assert plan.engine == engine and why in str(plan), str(plan)
    assert_tree_close(
        ajm.pairwise(f, x, y, ajm.LOGSUMEXP), jax.nn.logsumexp(dense(f, x, y), 1), rtol=1e-5
    )


def _concatenated(xi, yj):  # values made by a concatenate: split in the reverse pass
    return -sqdist(xi, yj), jnp.concatenate([yj, yj[:1] ** 2])


@pytest.mark.parametrize("name", ["softmax_weighted", "softmax_two_heads", "concatenated"])
def test_cpu_reverse_pass_is_tiled(name, monkeypatch):
    # every pass of value_and_grad on the CPU tiles, none falling back to the plain
    # loops (3-7x slower: a split in the reverse pass did, until unrolled)
    problems = []
    real = _pairwise_kernel.tile_problem
    record = lambda run, args: problems.append(real(run, args)) or problems[-1]
    monkeypatch.setattr(_pairwise_kernel, "tile_problem", record)
    reduction, f, want = CASES["softmax_weighted" if name == "concatenated" else name]
    f = _concatenated if name == "concatenated" else f
    x, y = inputs()
    loss = lambda run: lambda x, y: sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(run(x, y)))
    got = jax.value_and_grad(loss(lambda x, y: ajm.pairwise(f, x, y, reduction)), (0, 1))(x, y)
    assert problems and all(p is None for p in problems), problems
    expect = jax.jit(jax.value_and_grad(loss(lambda x, y: want(dense(f, x, y))), (0, 1)))(x, y)
    assert_tree_close(got, expect, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "interpret"])
@pytest.mark.parametrize(
    ("reduction", "want"),
    [
        (ajm.ADD, lambda d: d.sum(1)),
        (ajm.LOGSUMEXP, lambda d: jax.nn.logsumexp(d, 1)),
        (ajm.MIN_ARGMIN, lambda d: (d.min(1), d.argmin(1))),
    ],
)
def test_values_of_shape_one_per_pair_are_tiled(reduction, want, backend):
    # KeOps' Vj(1) convention: b as (M, 1) rows, f returning a (1,) value per pair
    x, y = inputs()
    b = normal(2, (M, 1))
    f = lambda xi, yb: jnp.exp(-sqdist(xi, yb[0])) * yb[1]
    run = lambda x, b: ajm.pairwise(f, x, (y, b), reduction, tiles=TILES)
    oracle = lambda x, b: want(dense(f, x, (y, b)))
    loss = lambda run: (
        lambda x, b: sum(
            jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(run(x, b)) if v.dtype.kind == "f"
        )
    )
    with ajm.config(backend=backend):
        plan = ajm.explain_pairwise(f, x, (y, b), reduction, tiles=TILES)
        got = run(x, b)
        grads = jax.grad(loss(run), (0, 1))(x, b)
    assert plan.engine == ENGINES[backend], str(plan)
    assert "interpret kernel (" not in str(plan), str(plan)  # the tile kernel, not its fallback
    assert_tree_close(got, oracle(x, b), rtol=2e-5, atol=2e-5)
    assert_tree_close(grads, jax.jit(jax.grad(loss(oracle), (0, 1)))(x, b), rtol=1e-4, atol=1e-5)


@needs_abstract_devices
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_gpu_and_tpu_plans_take_the_tile_kernel(platform):
    # planned (and lowered: no compiler here) for an H100 / a TPU v5e from this CPU
    reduction, f, _ = CASES["logsumexp"]
    x, y = inputs()
    with on_abstract_device(platform):
        plan = ajm.explain_pairwise(f, x, y, reduction)
        refused = ajm.explain_pairwise(f, x, y, reduction, tiles=(48, 100))
        vector = ajm.explain_pairwise(*CASES["softmax_weighted"][1:2], x, y, ajm.SOFTMAX_WEIGHTED)
        scores = ajm.explain_pairwise(_two_heads, x, y, ajm.SOFTMAX_WEIGHTED)
        q, k = jnp.ones((N, 64)), jnp.ones((M, 64))
        dots = ajm.explain_pairwise(lambda a, b: a @ b, q, k, ajm.LOGSUMEXP)
        large = ajm.explain_pairwise(f, jnp.ones((4096, D)), jnp.ones((4096, D)), reduction)
    kind = "gpu" if platform == "cuda" else "tpu"
    tile = "mosaic_gpu" if platform == "cuda" else "tpu"  # an H100 takes Mosaic GPU's tiles
    assert plan.engine == f"pairwise kernel ({tile})", str(plan)
    # the default tiles, no larger than the least that hold the rows (37 x 53)
    assert large.tiles == {"gpu": (64, 64), "tpu": (512, 256)}[kind], str(large)
    assert plan.tiles == {"gpu": (40, 64), "tpu": (128, 128)}[kind], str(plan)  # (Mosaic GPU's)
    # where the kernel refuses: the matmul tiles' loops in plain XLA
    assert refused.engine == MATMUL and "tiles=(48, 100)" in str(refused), str(refused)
    # (2,) values per pair, two heads: softmax-weighted sums (on Mosaic GPU too)
    assert vector.engine == f"pairwise kernel ({tile})", str(vector)
    assert scores.engine == f"pairwise kernel ({tile})", str(scores)
    # a dot over 64 features: the matmul tile kernel
    assert dots.engine == f"pairwise kernel (matmul, {kind})", str(dots)
    assert "contracts 64 features" in str(dots), str(dots)


@pytest.mark.parametrize("backend", list(ENGINES))
def test_empty_sides_give_plain_jax_answers(backend):
    x, y = inputs()
    with ajm.config(backend=backend):
        out = ajm.pairwise(sqdist, x[:0], y, ajm.MIN)
        assert out.shape == (0,)
        total = ajm.pairwise(sqdist, x, y[:0], ajm.ADD)
        assert_tree_close(total, jnp.zeros(N))


def test_bad_input_is_named():
    x, y = inputs()
    with pytest.raises(ValueError, match=r"k=60 .*53"):
        ajm.pairwise(sqdist, x, y, ajm.top_k(60))
    with pytest.raises(TypeError, match="not a Monoid"):
        ajm.pairwise(sqdist, x, y, jnp.add)
    with pytest.raises(ValueError, match="same leading"):
        ajm.pairwise(sqdist, {"a": x, "b": x[:5]}, y, ajm.ADD)
    with pytest.raises(ValueError, match=r"tiles=\(0, 4\)"):
        ajm.pairwise(sqdist, x, y, ajm.ADD, tiles=(0, 4))
    with pytest.raises(TypeError):  # x and y with different feature sizes: f's own error
        ajm.pairwise(sqdist, x, y[:, :2], ajm.ADD)


@pytest.mark.parametrize("backend", list(ENGINES))
def test_nan_in_y_as_plain_jax(backend):
    x, y = inputs()
    y = y.at[20].set(jnp.nan)
    with ajm.config(backend=backend):
        for name in ("min_argmin", "logsumexp", "add"):
            reduction, f, want = CASES[name]
            got = ajm.pairwise(f, x, y, reduction, tiles=TILES)
            np.testing.assert_array_equal(
                np.isnan(np.asarray(jax.tree.leaves(got)[0])),
                np.isnan(np.asarray(jax.tree.leaves(want(dense(f, x, y)))[0])),
            )
            assert_tree_close(got, want(dense(f, x, y)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", list(ENGINES))
def test_k_nearest_with_a_nan_row_sorted_as_plain_jax(backend):
    """A NaN distance ranks last for ``top_k(smallest=True)`` on every engine and tile:
    computed in a tile, ``-(0.7 * s)`` may come out as ``-0.7 * s``, a NaN of the other
    sign, which ranked first in the tiles' folds and last in their merges (unsorted
    results, some of the k smallest missing)."""
    x, y = inputs()
    y = y.at[20].set(jnp.nan)
    f = lambda a, b: 0.7 * sqdist(a, b)
    want = _top_k(dense(f, x, y), 8, True)
    with ajm.config(backend=backend):
        got = ajm.pairwise(f, x, y, ajm.top_k(8, smallest=True), tiles=TILES)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert_tree_close(got[0], want[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", list(ENGINES))
def test_k_nearest_gradient_with_x64(x64, backend):
    # the tile kernel read the int32 literals of top_k's reverse pass as Python ints
    # (int64 under x64): lax.eq of int32 and int64 raised
    x, y = (jnp.asarray(np.asarray(p), jnp.float64) for p in (points(6, 0), points(9, 1)))
    loss = lambda run: lambda x: jnp.sum(run(x)[0] ** 2)
    ours = loss(lambda x: ajm.pairwise(sqdist, x, y, ajm.top_k(3, smallest=True)))
    with ajm.config(backend=backend):
        got = jax.grad(ours)(x)
    want = jax.grad(loss(lambda x: _top_k(dense(sqdist, x, y), 3, True)))(x)
    assert_tree_close(got, want, rtol=1e-10, atol=1e-10)


def test_gradient_memory_is_flat_at_two_to_the_fourteen():
    # value_and_grad of a pairwise logsumexp at N = M = 2^14 on the default engine:
    # compiled temp <= 48 MiB (the dense gradient holds N x M floats: 1 GiB and more)
    term = lambda xi, yj: -jnp.sum((xi - yj) ** 2)
    loss = lambda x, y: jnp.sum(ajm.pairwise(term, x, y, ajm.LOGSUMEXP))
    pts = jax.ShapeDtypeStruct((1 << 14, D), jnp.float32)
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(pts, pts).compile()
    assert compiled.memory_analysis().temp_size_in_bytes <= 48 * 2**20


# each device's 10 of the 37 x rows on the engine planned for them (pairs.spread): by
# default the tiles in XLA's loops, the kernel where asked for
SPREAD = {"auto": "pairwise tiles (xla)", "interpret": "pairwise kernel (interpret)"}


@pytest.mark.parametrize("backend", list(SPREAD))
@pytest.mark.parametrize("name", ["logsumexp", "min_argmin", "k_nearest"])
def test_shard_spreads_x_rows_over_devices(name, backend):
    if jax.device_count() != 4:
        pytest.skip("needs the 4 virtual CPU devices of conftest")
    reduction, f, want = CASES[name]
    x, y = inputs()
    with ajm.config(backend=backend):
        plan = ajm.explain_pairwise(f, x, y, reduction, tiles=TILES, shard=True)
        assert plan.engine == SPREAD[backend], str(plan)
        assert "spread over the devices (shard=True), 10 on each" in plan.reason, str(plan)
        run = lambda x, y: ajm.pairwise(f, x, y, reduction, tiles=TILES, shard=True)
        assert_tree_close(jax.jit(run)(x, y), want(dense(f, x, y)), rtol=2e-5, atol=2e-5)
        loss = lambda run, x, y: jnp.sum(jnp.sin(jax.tree.leaves(run(x, y))[0]))
        got = jax.jit(jax.grad(lambda x, y: loss(run, x, y), (0, 1)))(x, y)
    plain = lambda x, y: want(dense(f, x, y))
    expect = jax.jit(jax.grad(lambda x, y: loss(plain, x, y), (0, 1)))(x, y)
    assert_tree_close(got, expect, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("backend", list(ENGINES))
def test_heads_with_special_rows_match_jax(backend):
    # two softmax heads over a vector, each folded on its own tile: a NaN x row, and an
    # x row whose first head's scores are all -inf (NaN, as jax.nn.softmax gives)
    x = jnp.array([[0.0, 0.0], [1.0, 1.0], [jnp.nan, 0.0], [2.0, -1.0]])
    y = normal(1, (7, 2))

    def f(a, b):
        s = jnp.where(a[0] > 1.5, -jnp.inf, -jnp.sum((a - b) ** 2))
        return jnp.stack([s, -jnp.sum(jnp.abs(a - b))]), jnp.concatenate([b, b[:1]])

    d = dense(f, x, y)
    want = jnp.einsum("nms,nmk->nsk", jax.nn.softmax(d[0], 1), d[1])
    with ajm.config(backend=backend):
        got = ajm.pairwise(f, x, y, ajm.SOFTMAX_WEIGHTED, tiles=(2, 4))
    assert int(jnp.isnan(want).sum()) == 9  # the NaN row, and the -inf head of row 3
    assert_tree_close(got, want, rtol=1e-5, atol=1e-5)


# With jax_disable_most_optimizations (LLVM at -O0) XLA:CPU computed a tile's values in
# the tally's three reductions a last bit apart: a count of 0 for a max whose first
# row was found, and a NaN gradient where plain JAX's is finite (these data). The CPU
# tiles now tally values computed once (an optimization barrier, Tally.fold_fast). The
# interpret kernel folds as the device kernels do, where Pallas lowers no barrier: at
# -O0 it still gives NaN rows (not wrong values).
@pytest.mark.parametrize("backend", ["auto", "scan"])
def test_max_gradient_with_most_optimizations_disabled(backend):
    f = lambda a, b: -sqdist(a, b)
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.normal(size=(n, 3)), jnp.float32) for n in (37, 53))
    loss = lambda run: lambda x: jnp.sum(jnp.sin(run(x)))
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        with ajm.config(backend=backend):
            got = jax.grad(loss(lambda x: ajm.pairwise(f, x, y, ajm.MAX)))(x)
        expect = jax.grad(loss(lambda x: dense(f, x, y).max(1)))(x)
    finally:
        jax.config.update("jax_disable_most_optimizations", False)
    assert_tree_close(got, expect, rtol=2e-4, atol=2e-4)


@needs_abstract_devices
def test_values_wide_per_pair_run_in_xla_loops_on_a_tpu():
    # an L1 distance over 64 features beside a squared one: a (bj, bi, 64) difference per
    # tile; on a TPU several values per pair take XLA's loops (choose.TPU_WIDE_PAIRS,
    # measured with a score per head), given tiles kept; attention's one score per pair
    # keeps the matmul tile kernel at its tiles
    q, k = jnp.ones((4096, 64)), jnp.ones((4096, 64))
    with on_abstract_device("tpu"):
        wide = ajm.explain_pairwise(_two_heads, q, k, ajm.SOFTMAX_WEIGHTED)
        given = ajm.explain_pairwise(_two_heads, q, k, ajm.SOFTMAX_WEIGHTED, tiles=(256, 256))
        attention = ajm.explain_pairwise(lambda a, b: (a @ b, b), q, k, ajm.SOFTMAX_WEIGHTED)
    assert wide.engine == "pairwise tiles (matmul)", str(wide)
    assert "the matmul tile kernel: f makes 64 values per pair" in str(wide), str(wide)
    assert given.tiles == (256, 256), str(given)
    assert attention.engine == "pairwise kernel (matmul, tpu)", str(attention)
    assert attention.tiles == (512, 1024) and "values per pair" not in attention.reason
