"""Reverse mode of the fused engine as backward kernels (interpret mode on CPU):
gradients equal ``jax.grad`` of the unchunked computation for every monoid, with
respect to closed-over values and to the mapped inputs; the gradient program holds
the backward kernel and no loop outside kernels; ties split evenly, NaN propagates,
a recomputation that selects other tied rows than the tally gives NaN, not a wrong
number; forward mode and second order still equal plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, needs_kernel, primitives
from jax import lax

import adv_jax_math as ajm
from adv_jax_math.kernels.fused_reduce import backward
from adv_jax_math.monoids import shifted

pytestmark = needs_kernel

B = 8
BACKWARD = backward.BACKWARD_NAME


def top_k_values(k):
    return lambda y: jnp.moveaxis(lax.top_k(jnp.moveaxis(y, 0, -1), k)[0], -1, 0)


# name: (reduction= of batch_map, plain JAX on fun's whole output, float parts only)
CASES = {
    "ADD": (ajm.ADD, lambda y: jnp.sum(y, 0)),
    "add over all axes": (
        dict(reduction=jnp.add, chunk_reduction=lambda y: y.sum()),
        lambda y: jnp.sum(y),
    ),
    "MAX": (ajm.MAX, lambda y: jnp.max(y, 0)),
    "max over all axes": (
        dict(reduction=jnp.maximum, chunk_reduction=lambda y: y.max()),
        lambda y: jnp.max(y),
    ),
    "MIN": (ajm.MIN, lambda y: jnp.min(y, 0)),
    "LOGSUMEXP": (ajm.LOGSUMEXP, lambda y: jax.nn.logsumexp(y, 0)),
    "logsumexp over all axes": (
        dict(reduction=jnp.logaddexp, chunk_reduction=lambda y: jax.nn.logsumexp(y)),
        lambda y: jax.nn.logsumexp(y),
    ),
    "MIN_ARGMIN": (ajm.MIN_ARGMIN, lambda y: jnp.min(y, 0)),
    "MAX_ARGMAX": (ajm.MAX_ARGMAX, lambda y: jnp.max(y, 0)),
    "top_k(3)": (ajm.top_k(3), top_k_values(3)),
    "MEAN": (ajm.MEAN, lambda y: jnp.mean(y, 0)),
    "VAR": (ajm.VAR, lambda y: jnp.var(y, 0)),
    "MEAN_VAR": (ajm.MEAN_VAR, lambda y: (jnp.mean(y, 0), jnp.var(y, 0))),
}


def floats(out):
    """A scalar loss of a result's float parts, each weighted differently."""
    leaves = [v for v in jax.tree.leaves(out) if jnp.issubdtype(v.dtype, jnp.floating)]
    return sum(
        jnp.sum(v * jnp.cos(jnp.arange(v.size).reshape(v.shape) + i)) for i, v in enumerate(leaves)
    )


def ours(reduction, fun, x, batch=B):
    kw = reduction if isinstance(reduction, dict) else dict(reduction=reduction)
    with ajm.config(backend="interpret"):
        return ajm.batch_map(fun, x, batch, **kw)


def grad_program(loss, *args):
    with ajm.config(backend="interpret"):
        return primitives(
            jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(args)))))(*args).jaxpr
        )


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("n", [29, 32])  # a ragged last block, and none
def test_gradients_equal_plain_jax(name, n):
    reduction, plain = CASES[name]
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    w = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    fun = lambda w: lambda t: jnp.sin(t * w) + 0.1 * t

    loss = lambda x, w: floats(ours(reduction, fun(w), x))
    got = jax.grad(loss, argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: floats(plain(fun(w)(x))), argnums=(0, 1))(x, w)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-5)
    prims = grad_program(loss, x, w)
    assert f"pallas_call:{BACKWARD}" in prims, prims
    assert not {"scan", "while"} & set(prims), prims  # the whole reverse pass is kernels


def test_softmax_weighted_gradients():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    kv = tuple(jnp.asarray(rng.normal(size=(29, d)), jnp.float32) for d in (3, 5))
    attend = lambda q: lambda r: (r[0] @ q.T, r[1])
    loss = lambda kv, q: floats(ours(ajm.softmax_weighted(return_lse=True), attend(q), kv))

    def plain(kv, q):
        s, v = attend(q)(kv)
        return floats((jnp.tensordot(jax.nn.softmax(s, 0), v, ([0], [0])), jax.nn.logsumexp(s, 0)))

    assert_tree_close(
        jax.grad(loss, argnums=(0, 1))(kv, q),
        jax.grad(plain, argnums=(0, 1))(kv, q),
        rtol=1e-4,
        atol=1e-5,
    )
    assert f"pallas_call:{BACKWARD}" in grad_program(loss, kv, q)


@pytest.mark.parametrize("axis", [None, 0])
def test_ties_share_evenly_and_nan_propagates(axis):
    y = np.zeros((29, 2), np.float32)
    y[[3, 8, 22], 0] = 7.0  # three rows tie for column 0's max (and the overall max)
    y[:, 1] = np.arange(29) % 5  # column 1: max 4 at rows 4, 9, ..., 24
    y = jnp.asarray(y)
    red = dict(reduction=jnp.maximum, chunk_reduction=lambda t: t.max(axis))
    plain = lambda t: jnp.max(t, axis)
    w = jnp.float32(1.5)
    loss = lambda y, w: floats(ours(red, lambda t: t * w, y))
    got = jax.grad(loss, argnums=(0, 1))(y, w)
    assert_tree_close(got, jax.grad(lambda y, w: floats(plain(y * w)), argnums=(0, 1))(y, w))
    assert np.count_nonzero(got[0]) == (3 if axis is None else 8)
    nan = y.at[5, 1].set(jnp.nan)
    got = jax.grad(loss)(nan, w)
    want = jax.grad(lambda y: floats(plain(y * w)))(nan)
    assert_tree_close(got, want)  # NaN where plain JAX has NaN


def test_a_recomputation_that_selects_other_ties_gives_nan(monkeypatch):
    # The tally says two rows tie for the max; a backward pass that sees three (its
    # recomputation of fun a last bit off) must not return a gradient.
    y = jnp.asarray(np.r_[np.zeros(26), [5.0, 5.0, 5.0]].astype(np.float32)[:, None])
    real = backward._tallies

    def two_not_three(r, closed, xs):
        out = real(r, closed, xs)
        top, first, count, _ = out[0]
        return [(top, first, count - 1, 1 / (count - 1))]

    monkeypatch.setattr(backward, "_tallies", two_not_three)
    g = jax.grad(lambda y: ours(ajm.MAX, lambda t: t, y).sum())(y)
    assert bool(jnp.all(jnp.isnan(g))), g


def test_a_lone_extremum_is_selected_by_its_row():
    # One row holds the max: the backward kernel finds it by index, so a value that
    # compares unequal in the recomputation changes nothing.
    y = jnp.asarray(np.random.default_rng(1).normal(size=(29, 3)), jnp.float32)
    tally = ajm.MAX.tally
    state = tally.fold([y], jnp.arange(29), None)
    shifted = (state[0] + 1.0, *state[1:])  # a top no row equals
    picked = tally.selected(
        y, jnp.broadcast_to(jnp.arange(29)[:, None], y.shape), tally.shares(shifted, False)
    )
    assert_tree_close(
        picked, (jnp.arange(29)[:, None] == jnp.argmax(y, 0)[None]).astype(jnp.float32)
    )


def test_forward_mode_and_second_order_still_equal_plain_jax():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(27, 3)), jnp.float32)
    w = jnp.asarray([0.3, -0.7, 1.1], jnp.float32)
    for name in ["LOGSUMEXP", "VAR", "max over all axes"]:
        red, plain = CASES[name]
        f = lambda w, red=red: jnp.sum(ours(red, lambda t: jnp.tanh(t * w), x))
        g = lambda w, plain=plain: jnp.sum(plain(jnp.tanh(x * w)))
        assert_tree_close(jax.jacfwd(f)(w), jax.jacfwd(g)(w), rtol=1e-4, atol=1e-5)
        assert_tree_close(jax.hessian(f)(w), jax.hessian(g)(w), rtol=1e-4, atol=1e-5)
        assert_tree_close(jax.jacrev(jax.jacrev(f))(w), jax.hessian(g)(w), rtol=1e-4, atol=1e-5)
        # forward over forward, no vmap between (jacfwd's): the tangent's own JVP
        jj = lambda h: jax.jvp(lambda w: jax.jvp(h, (w,), (w[::-1],))[1], (w,), (w,))[1]
        assert_tree_close(jj(f), jj(g), rtol=1e-4, atol=1e-5)


def test_softmax_weighted_hessian_vector_product_under_vmap():
    # The fused engine's tangent weighs each row by the softmax against the forward's
    # state; under vmap (the pairwise scan route: a batch_map per query row) the
    # tangent's recomputed scores came out an ulp above the state's top on some rows,
    # and the clamp of the exponent to 0 cut the derivative of that row's weight: the
    # second derivative was off by O(1) there, first order and values right.
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(29, 8)), jnp.float32)
    one = lambda qi: ours(ajm.SOFTMAX_WEIGHTED, lambda r: (r @ qi, jnp.cos(r)), k, 16)
    plain = lambda qi: jax.nn.softmax(k @ qi) @ jnp.cos(k)
    grad = jax.grad(lambda q, f: jnp.sum(jnp.sin(jax.vmap(f)(q))))
    hvp = lambda f: jax.jvp(lambda q: grad(q, f), (q,), (0.3 * q,))[1]
    assert_tree_close(hvp(one), hvp(plain), rtol=1e-4, atol=1e-5)


def test_softmax_weights_derivative_whole_a_row_an_ulp_above_the_top():
    # A row computed again may exceed the state's top by an ulp: its exponent is
    # clamped to 0, but its weight keeps the derivative of exp(y - top) / total.
    y = jnp.asarray([0.5, 1.0, -2.0], jnp.float32)
    top = jnp.nextafter(jnp.float32(1.0), jnp.float32(-np.inf))
    total = jnp.sum(jnp.exp(y - top))
    dy = jnp.asarray([0.25, 1.0, -0.5], jnp.float32)
    got = jax.jvp(lambda y: shifted._softmax(y, top, total), (y,), (dy,))[1]
    assert_tree_close(got, jnp.exp(y - top) / total * dy, rtol=1e-5, atol=1e-7)


def test_explain_says_how_reverse_mode_runs():
    x = jnp.ones((29, 3))
    with ajm.config(backend="interpret"):
        plan = ajm.explain(jnp.sin, x, B, reduction=ajm.LOGSUMEXP)
    assert "backward kernel" in plan.backward, str(plan)
    assert "gradient" in str(plan)


@pytest.mark.parametrize("name", ["ADD", "MAX", "LOGSUMEXP", "top_k(3)"])
def test_a_backward_block_of_its_own(monkeypatch, name):
    # On TPU the backward kernel may run on fewer rows than the forward's block (its
    # VJP's residuals need more VMEM: fused_reduce.reverse_blocks); interpret mode
    # never needs that, so here it is given one: fun traced once more on 3 rows, its
    # constants (w, closed over and differentiated; a constant made inside fun)
    # mapped to the reverse pass's.
    from adv_jax_math.engines import fused as engine
    from adv_jax_math.kernels.fused_reduce.build import traced_at as _traced_at

    def three_rows(fun, xs, reduction, verdict, platform, max_rows=None):
        closed, out_shape = _traced_at(fun, xs, 3, verdict.known)
        return ((closed, out_shape, 3, 1),)

    monkeypatch.setattr(engine, "reverse_blocks", three_rows)
    reduction, plain = CASES[name]
    x = jnp.asarray(np.random.default_rng(5).normal(size=(29, 3)), jnp.float32)
    w = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    fun = lambda w: lambda t: jnp.sin(t * w) + jnp.asarray([0.1, 0.2, 0.3]) * t

    loss = lambda x, w: floats(ours(reduction, fun(w), x))
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    want = jax.value_and_grad(lambda x, w: floats(plain(fun(w)(x))), argnums=(0, 1))(x, w)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-5)
    with ajm.config(backend="interpret"):
        plan = ajm.explain(fun(w), x, B, reduction=reduction)
    assert "blocks of 3 rows" in plan.backward and plan.block_rows == B, str(plan)
    prims = grad_program(loss, x, w)
    assert f"pallas_call:{BACKWARD}" in prims and not {"scan", "while"} & set(prims), prims
