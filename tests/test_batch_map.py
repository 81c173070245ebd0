"""batch_map and batch_vmap against plain-JAX oracles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, oracle

import adv_jax_math as ajm

# name: (reduction, chunk_reduction, oracle of the unchunked fun output)
REDUCTIONS = {
    "map": (None, ajm.identity, oracle("map")),
    "sum": (jnp.add, jnp.sum, oracle("add")),
    "add.reduce": (jnp.add, jnp.add.reduce, oracle("add", 0)),
    "max": (jnp.maximum, jnp.max, oracle("max")),
    "maximum.reduce": (jnp.maximum, jnp.maximum.reduce, oracle("max", 0)),
    "min": (jnp.minimum, jnp.min, oracle("min")),
    "logsumexp": (jnp.logaddexp, jax.nn.logsumexp, oracle("logsumexp")),
    "LOGSUMEXP object": (ajm.LOGSUMEXP, ajm.identity, oracle("logsumexp", 0)),
    "partial(sum, axis=0)": (jnp.add, functools.partial(jnp.sum, axis=0), oracle("add", 0)),
}


def fun_vec(x):
    return jnp.sin(x) * 2 + x


# Every batch_size edge (None, 1, divisor, non-divisor, n - 1, n, n + 1, > n) for a
# divisible and a non-divisible n, each with another reduction (the engine matrix in
# test_engines.py covers reductions x dtypes x transforms).
EDGES = [(n, bs) for n in (16, 17) for bs in (None, 1, 4, 5, 15, 16, 17, 40)]
VECTOR_CASES = [(name, *edge) for name, edge in zip(list(REDUCTIONS) * 2, EDGES, strict=False)]


@pytest.mark.parametrize("name, n, batch_size", VECTOR_CASES)
def test_batch_size_edges(name, n, batch_size):
    reduction, chunk_reduction, expect = REDUCTIONS[name]
    x = jnp.linspace(-3, 3, n * 3).reshape(n, 3)
    out = ajm.batch_map(
        fun_vec, x, batch_size, reduction=reduction, chunk_reduction=chunk_reduction
    )
    assert_tree_close(out, expect(fun_vec(x)))


def test_generic_sum_and_count_pytree_reduction():
    x = jnp.arange(23.0)

    def fun(x):
        keep = x % 3 == 0
        return jnp.where(keep, x, 0.0), keep.astype(jnp.int32)

    reduction = lambda a, b: (a[0] + b[0], a[1] + b[1])
    chunk_reduction = lambda y: (y[0].sum(), y[1].sum())
    for bs in (None, 1, 4, 5, 23, 30):
        total, count = ajm.batch_map(
            fun, x, bs, reduction=reduction, chunk_reduction=chunk_reduction
        )
        assert total == x[x % 3 == 0].sum() and count == 8


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 6])
def test_product_of_negatives_is_not_seeded_with_zero(batch_size):
    x = -jnp.arange(1.0, 8.0)
    out = ajm.batch_map(
        lambda x: x, x, batch_size, reduction=jnp.multiply, chunk_reduction=jnp.prod
    )
    assert_tree_close(out, jnp.prod(x))


@pytest.mark.parametrize("name", ["map", "sum", "max", "logsumexp"])
def test_trailing_dims_and_all_axes_semantics(name):
    reduction, chunk_reduction, expect = REDUCTIONS[name]
    x = jnp.linspace(0, 1, 11 * 12).reshape(11, 3, 4)
    out = ajm.batch_map(jnp.tanh, x, 4, reduction=reduction, chunk_reduction=chunk_reduction)
    assert_tree_close(out, expect(jnp.tanh(x)))
    if name != "map":
        assert out.shape == ()  # jnp.sum-style reductions reduce every axis


def test_add_reduce_keeps_trailing_axes():
    x = jnp.ones((10, 3))
    out = ajm.batch_map(lambda x: x, x, 4, reduction=jnp.add, chunk_reduction=jnp.add.reduce)
    assert_tree_close(out, jnp.full(3, 10.0))


def test_fun_without_row_axis_and_non_divisible_n_uses_remainder():
    # fun reduces its rows itself, so repeated rows could not be masked.
    x = jnp.arange(10.0)
    fun = lambda x: x.sum(0)
    plan = ajm.explain(fun, x, 4, reduction=jnp.add, chunk_reduction=jnp.sum)
    assert plan.policy is ajm.Policy.REMAINDER and plan.remainder == 2
    assert "no mapped" in plan.recognition
    assert_tree_close(ajm.batch_map(fun, x, 4, reduction=jnp.add, chunk_reduction=jnp.sum), x.sum())
    assert ajm.batch_map(fun, x, 4, reduction=jnp.add, chunk_reduction=jnp.sum) == 45.0


class TestTransforms:
    x = jnp.linspace(-2, 2, 21 * 2).reshape(21, 2)
    w = jnp.array([0.5, -1.5])

    @staticmethod
    def model(w, x):
        return jnp.tanh(x @ w) + jnp.sum(x**2, axis=1) * w[0]

    # batch_size 1 (a chunk per row) and n (one chunk) with others; test_engines.py
    # has the rest of reductions x transforms.
    @pytest.mark.parametrize(
        "name, batch_size",
        [("map", 1), ("sum", 21), ("max", 7), ("logsumexp", 1), ("add.reduce", 4)],
    )
    def test_jit_and_grads(self, name, batch_size):
        reduction, chunk_reduction, expect = REDUCTIONS[name]

        def chunked(w, x):
            out = ajm.batch_map(
                lambda x: self.model(w, x),
                x,
                batch_size,
                reduction=reduction,
                chunk_reduction=chunk_reduction,
            )
            return jnp.sum(out**2)

        def plain(w, x):
            return jnp.sum(expect(self.model(w, x)) ** 2)

        assert_tree_close(jax.jit(chunked)(self.w, self.x), plain(self.w, self.x))
        g = jax.jit(jax.grad(chunked, argnums=(0, 1)))(self.w, self.x)
        assert_tree_close(g, jax.grad(plain, argnums=(0, 1))(self.w, self.x), rtol=1e-4, atol=1e-5)

    def test_vmap_of_generic_reduction(self):
        xs = jnp.linspace(0.1, 1, 3 * 21).reshape(3, 21)
        f = lambda x: ajm.batch_map(jnp.cos, x, 4, reduction=jnp.multiply, chunk_reduction=jnp.prod)
        assert_tree_close(jax.vmap(f)(xs), jax.vmap(lambda x: jnp.prod(jnp.cos(x)))(xs))

    def test_grad_wrt_closed_over_parameter_generic(self):
        def chunked(w):
            return ajm.batch_map(
                lambda x: self.model(w, x),
                self.x,
                4,
                reduction=lambda a, b: a + b,
                chunk_reduction=jnp.sum,
            )

        expect = jax.grad(lambda w: jnp.sum(self.model(w, self.x)))(self.w)
        assert_tree_close(jax.grad(chunked)(self.w), expect)

    def test_remat_off_gives_same_gradient(self):
        def chunked(w):
            return ajm.batch_map(
                lambda x: self.model(w, x), self.x, 4, reduction=jnp.add, chunk_reduction=jnp.sum
            )

        def tanh_count():  # fun runs again in the backward pass only with remat
            return str(jax.make_jaxpr(jax.grad(chunked))(self.w)).count(" tanh ")

        g1 = jax.grad(chunked)(self.w)
        with ajm.config(remat=False):
            g2 = jax.grad(chunked)(self.w)
            stored = tanh_count()
        assert tanh_count() > stored
        assert_tree_close(g1, g2)


@pytest.mark.parametrize("batch_size", [None, 1, 2, 3, 4, 5])
def test_batch_vmap_matches_vmap_with_reductions(batch_size):
    xs = jnp.arange(15.0).reshape(5, 3)
    f = lambda x: jnp.outer(x, x)
    for name in ["map", "sum", "add.reduce", "logsumexp"]:
        reduction, chunk_reduction, expect = REDUCTIONS[name]
        out = ajm.batch_vmap(
            f, batch_size=batch_size, reduction=reduction, chunk_reduction=chunk_reduction
        )(xs)
        assert_tree_close(out, expect(jax.vmap(f)(xs)), rtol=1e-5, atol=1e-4)


def test_numpy_and_list_inputs():
    x = np.arange(9.0)
    assert_tree_close(ajm.batch_map(lambda x: x + 1, x, 4), jnp.asarray(x + 1, jnp.float32))
    out = ajm.batch_map(
        lambda t: t[0] * t[1], [x, x], 4, reduction=jnp.add, chunk_reduction=jnp.sum
    )
    assert_tree_close(out, jnp.float32((x * x).sum()))
