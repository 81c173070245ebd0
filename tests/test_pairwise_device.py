"""The pairwise tile kernel for GPUs and TPUs (``kernels/pairwise_device.py``), run
in interpret mode on CPU: both layouts against the dense plain-JAX oracle, ragged N
and M, ties across tile borders, closed-over constants, vectors per pair; and what
it does not tile (a primitive the unrolled evaluator lacks) refused by name. The
compiles for real targets are ``bench/accel/pairwise_targets.py`` (``make
accel-pairwise``).
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close, normal
from test_pairwise import CASES, dense, inputs

import adv_jax_math as ajm
from adv_jax_math.kernels.pairwise_device import Layout, device_states
from adv_jax_math.kernels.unrolled import NotUnrolled
from adv_jax_math.pairs import api as pairs_api
from adv_jax_math.pairs.kernel import recognized

TILED = [name for name in CASES if name != "pytree"]


def run(f, x, y, reduction, kind, tiles=(8, 16)):
    red = recognized(f, x, y, reduction, tiles[1])
    row = jax.ShapeDtypeStruct(x.shape[1:], x.dtype), jax.ShapeDtypeStruct(y.shape[1:], y.dtype)
    pair = lambda xi, yj: [s[0] for s in red.prologue(jax.tree.map(lambda v: v[None], f(xi, yj)))]
    closed = jax.make_jaxpr(pair)(*row)
    states = device_states(
        closed.jaxpr, red, closed.consts, [x], [y], Layout(kind, tiles, interpret=True)
    )
    rows = [jax.ShapeDtypeStruct((1, *a.shape), a.dtype) for a in closed.out_avals]
    items = [leaf.items(red.reads(rows, leaf)) for leaf in red.leaves]
    one = lambda *s: red.finish(
        [leaf.result(q, it) for leaf, q, it in zip(red.leaves, s, items, strict=True)]
    )
    return jax.vmap(one)(*states)


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
@pytest.mark.parametrize("name", TILED)
def test_tiles_match_dense_oracle(name, kind):
    reduction, f, want = CASES[name]
    x, y = inputs()  # 37 x 53 rows: neither a multiple of the tiles; a tie at rows 15/16
    assert_tree_close(run(f, x, y, reduction, kind), want(dense(f, x, y)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_closed_over_constants_and_features_unrolled(kind):
    # a matrix and a bandwidth closed over; indexing, dot and norm inside f
    x, y = inputs()
    w = normal(3, (3, 3))
    f = lambda a, b: jnp.exp(-jnp.linalg.norm(a @ w - b) / 0.7) + a[0] * b[2]
    got = run(f, x, y, ajm.LOGSUMEXP, kind)
    assert_tree_close(got, jax.nn.logsumexp(dense(f, x, y), 1), rtol=2e-5, atol=2e-5)
    # pad, iota and a weighted logsumexp's two values per pair
    g = lambda a, b: (jnp.sum(jnp.pad(a - b, (1, 2)) ** 2 * jnp.arange(6.0)), b[0] ** 2)
    got = run(g, x, y, ajm.WEIGHTED_LOGSUMEXP, kind)
    score, weight = dense(g, x, y)
    assert_tree_close(got, jax.nn.logsumexp(score, 1, b=weight), rtol=2e-5, atol=2e-5)


def test_calls_are_unrolled_through():
    # jit, a custom derivative and jax.checkpoint (remat2): one list of calls entered
    x, y = inputs()
    dist = jax.custom_jvp(lambda u, v: jnp.sum((u - v) ** 2))
    dist.defjvps(lambda t, _, u, v: 2 * jnp.sum((u - v) * t), None)
    f = lambda a, b: jax.checkpoint(jax.jit(dist))(a, b)
    got = run(f, x, y, ajm.MIN, "tpu")
    assert_tree_close(got, jnp.min(dense(f, x, y), 1), rtol=2e-5, atol=2e-5)


def test_what_is_not_tiled_is_refused_by_name():
    x, y = inputs()
    with pytest.raises(NotUnrolled, match="cumsum"):
        run(lambda a, b: jnp.cumsum(a - b)[-1], x, y, ajm.ADD, "gpu")


@pytest.mark.parametrize(
    "name", ["logsumexp", "min_argmin", "k_nearest", "softmax_weighted", "softmax_two_heads"]
)
def test_tpu_layout_gradients_match_dense_oracle(name, monkeypatch):
    # backend="interpret" runs the GPU layout; the TPU one (a grid over y tiles, states
    # in the output block) runs the same reverse-pass sums
    monkeypatch.setattr(pairs_api, "INTERPRET_LAYOUT", "tpu")
    reduction, f, want = CASES[name]
    x, y = inputs()
    loss = lambda run: (
        lambda x, y: sum(
            jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(run(x, y)) if v.dtype.kind == "f"
        )
    )
    ours = loss(lambda x, y: ajm.pairwise(f, x, y, reduction, tiles=(8, 16)))
    with ajm.config(backend="interpret"):
        assert "tpu tile kernel" in ajm.explain_pairwise(f, x, y, reduction).reason
        got = jax.value_and_grad(ours, (0, 1))(x, y)
    expect = jax.value_and_grad(loss(lambda x, y: want(dense(f, x, y))), (0, 1))(x, y)
    assert_tree_close(got, expect, rtol=2e-4, atol=2e-4)
