"""``weighted_logsumexp``: ``jax.nn.logsumexp(a, 0, b=b, return_sign=...)`` chunk by
chunk, on every engine, against jax itself: values, signs and gradients, with
weights of both signs, rows of weight 0 (whose ``a`` may be anything), negative
sums (NaN without ``return_sign``), all-zero weights, infinities; and in pairwise
form, the Sinkhorn step OTT-JAX computes with marginal weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, engine, normal

import adv_jax_math as ajm

ENGINES = ["scan", "interpret", "shard"]


def columns(n: int = 23) -> tuple[jax.Array, jax.Array]:
    """``(a, b)``, ``(n, 6)``: a column each of mixed-sign weights, positive weights,
    zeros with huge ``a`` (left out), a negative sum, all-zero weights, an infinite
    ``a`` among finite ones."""
    a = 3 * normal(0, (n, 6))
    b = normal(1, (n, 6))
    b = b.at[:, 1].set(jnp.abs(b[:, 1]) + 0.1)
    a = a.at[::3, 2].set(1e30)
    b = b.at[::3, 2].set(0.0)
    b = b.at[:, 3].set(-jnp.abs(b[:, 3]) - 0.1)
    b = b.at[:, 4].set(0.0)
    a = a.at[7, 5].set(jnp.inf)
    b = b.at[7, 5].set(0.5)
    return a, b


def want(a, b, return_sign):
    return jax.nn.logsumexp(a, axis=0, b=b, return_sign=return_sign)


@pytest.mark.parametrize("return_sign", [False, True])
@pytest.mark.parametrize("batch_size", [1, 4, 22])
@pytest.mark.parametrize("name", ENGINES)
def test_values_and_signs_as_jax(name, batch_size, return_sign):
    a, b = columns()
    reduction = ajm.weighted_logsumexp(return_sign)
    with engine(name) as kw:
        got = jax.jit(
            lambda a, b: ajm.batch_map(lambda r: r, (a, b), batch_size, reduction=reduction, **kw)
        )(a, b)
    expect = want(a, b, return_sign)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expect), strict=True):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(e))
        assert_tree_close(g, e, rtol=1e-5, atol=1e-5)


def _same_nans_close(got, expect):
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expect), strict=True):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(e))
        ok = ~np.isnan(np.asarray(e))
        assert_tree_close(np.asarray(g)[ok], np.asarray(e)[ok], rtol=1e-4, atol=1e-5)


# finite columns (mixed signs, positive, negative), and the columns with rows of
# weight 0: some (huge a) and all (a result of -inf, left out of the loss: the
# derivative by a is 0, by b NaN, as jax's; it was NaN by a in the kernel's reverse
# pass, exp(-inf - -inf), issue 44)
# By default 6 of the 12: the columns chosen by return_sign and the engine's parity, so
# that every pair of two axes' values runs once; the other 6 slow (make test-slow).
@pytest.mark.parametrize(
    "name, return_sign, cols",
    [
        pytest.param(
            name,
            sign,
            cols,
            id=f"{name}-{sign}-{what}",
            marks=() if k == (sign + i) % 2 else pytest.mark.slow,
        )
        for i, name in enumerate(ENGINES)
        for sign in (False, True)
        for k, (what, cols) in enumerate({"finite": [0, 1, 3], "zero weights": [0, 2, 4]}.items())
    ],
)
def test_gradients_as_jax(name, return_sign, cols):
    a, b = columns()
    a, b = a[:, cols], b[:, cols]
    reduction = ajm.weighted_logsumexp(return_sign)

    def loss(run, a, b):
        out = run(a, b)
        value = out[0] if return_sign else out
        return jnp.sum(jnp.where(jnp.isfinite(value), jnp.sin(value), 0.0))

    ours = lambda a, b: ajm.batch_map(lambda r: r, (a, b), 5, reduction=reduction, **kw)
    with engine(name) as kw:
        got = jax.jit(jax.grad(lambda a, b: loss(ours, a, b), argnums=(0, 1)))(a, b)
        fwd = jax.jvp(lambda a: loss(ours, a, b), (a,), (jnp.ones_like(a),))
    expect = jax.grad(
        lambda a, b: loss(lambda a, b: want(a, b, return_sign), a, b), argnums=(0, 1)
    )(a, b)
    _same_nans_close(got, expect)
    plain = jax.jvp(
        lambda a: loss(lambda a, b: want(a, b, return_sign), a, b), (a,), (jnp.ones_like(a),)
    )
    _same_nans_close(fwd, plain)


def test_pairwise_sinkhorn_step_with_weights():
    # f_i = -eps * logsumexp_j((g_j - C_ij) / eps, b=w_j): OTT-JAX's update with marginals
    x, y = normal(2, (41, 3)), normal(3, (57, 3))
    g, w, eps = normal(4, (57,)), jnp.linspace(0.0, 2.0, 57), 0.2
    pair = lambda xi, yw: ((yw[1] - jnp.sum((xi - yw[0]) ** 2)) / eps, yw[2])
    dense = jax.vmap(jax.vmap(pair, (None, 0)), (0, None))(x, (y, g, w))
    expect = -eps * jax.nn.logsumexp(dense[0], axis=1, b=dense[1])
    for backend in ("scan", "interpret"):
        with ajm.config(backend=backend):
            got = -eps * ajm.pairwise(pair, x, (y, g, w), ajm.WEIGHTED_LOGSUMEXP, tiles=(8, 16))
        assert_tree_close(got, expect, rtol=1e-5, atol=1e-5)


def test_rows_of_other_shapes_are_refused():
    a, b = columns()
    with pytest.raises(ValueError, match=r"rows of shapes \(6,\) and \(3,\)"):
        ajm.batch_map(lambda r: r, (a, b[:, :3]), 4, reduction=ajm.WEIGHTED_LOGSUMEXP)
