"""batch_map and batch_vmap against plain-JAX oracles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adv_jax_math as ajm

from conftest import assert_tree_close

# (reduction, chunk_reduction, oracle applied to the unchunked fun output)
REDUCTIONS = {
    "map": (None, ajm.identity, lambda y: y),
    "sum": (jnp.add, jnp.sum, lambda y: jax.tree.map(jnp.sum, y)),
    "add.reduce": (jnp.add, jnp.add.reduce, lambda y: jax.tree.map(lambda v: v.sum(0), y)),
    "max": (jnp.maximum, jnp.max, lambda y: jax.tree.map(jnp.max, y)),
    "maximum.reduce": (
        jnp.maximum,
        jnp.maximum.reduce,
        lambda y: jax.tree.map(lambda v: v.max(0), y),
    ),
    "min": (jnp.minimum, jnp.min, lambda y: jax.tree.map(jnp.min, y)),
    "logsumexp": (jnp.logaddexp, jax.nn.logsumexp, lambda y: jax.tree.map(jax.nn.logsumexp, y)),
    "LOGSUMEXP object": (
        ajm.LOGSUMEXP,
        ajm.identity,
        lambda y: jax.tree.map(lambda v: jax.nn.logsumexp(v, axis=0), y),
    ),
    "partial(sum, axis=0)": (
        jnp.add,
        functools.partial(jnp.sum, axis=0),
        lambda y: jax.tree.map(lambda v: v.sum(0), y),
    ),
}


def fun_vec(x):
    return jnp.sin(x) * 2 + x


def fun_tree(d):
    a, (b, c) = d["a"], d["bc"]
    return {"u": a * b[:, :1], "v": (jnp.cos(c), a[:, 0] - 1.0)}


def input_tree(n, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(n), 3)
    return {
        "a": jax.random.normal(k[0], (n, 3), dtype),
        "bc": (jax.random.normal(k[1], (n, 2), dtype), jax.random.normal(k[2], (n,), dtype)),
    }


@pytest.mark.parametrize("name", list(REDUCTIONS))
@pytest.mark.parametrize("n", [16, 17])
@pytest.mark.parametrize("batch_size", [None, 1, 4, 5, 15, 16, 17, 40])
def test_vector_input(name, n, batch_size):
    reduction, chunk_reduction, oracle = REDUCTIONS[name]
    x = jnp.linspace(-3, 3, n * 3).reshape(n, 3)
    out = ajm.batch_map(
        fun_vec, x, batch_size, reduction=reduction, chunk_reduction=chunk_reduction
    )
    assert_tree_close(out, oracle(fun_vec(x)))


@pytest.mark.parametrize("name", ["map", "sum", "add.reduce", "max", "min", "logsumexp"])
@pytest.mark.parametrize("n, batch_size", [(12, 4), (13, 4), (13, 12), (7, 1), (9, None)])
def test_pytree_input_and_output(name, n, batch_size):
    reduction, chunk_reduction, oracle = REDUCTIONS[name]
    x = input_tree(n)
    out = ajm.batch_map(
        fun_tree, x, batch_size, reduction=reduction, chunk_reduction=chunk_reduction
    )
    assert_tree_close(out, oracle(fun_tree(x)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("name", ["map", "sum", "max", "min", "logsumexp"])
@pytest.mark.parametrize("n", [24, 29])
def test_dtypes(x64, dtype, name, n):
    reduction, chunk_reduction, oracle = REDUCTIONS[name]
    x = (jnp.arange(n * 4).reshape(n, 4) % 11 - 5).astype(dtype)
    f = lambda x: x * 3 - 1
    out = ajm.batch_map(f, x, 8, reduction=reduction, chunk_reduction=chunk_reduction)
    assert_tree_close(out, oracle(f(x)))


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
    reduction, chunk_reduction, oracle = REDUCTIONS[name]
    x = jnp.linspace(0, 1, 11 * 12).reshape(11, 3, 4)
    out = ajm.batch_map(jnp.tanh, x, 4, reduction=reduction, chunk_reduction=chunk_reduction)
    assert_tree_close(out, oracle(jnp.tanh(x)))
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

    @pytest.mark.parametrize("name", ["map", "sum", "max", "logsumexp", "add.reduce"])
    @pytest.mark.parametrize("batch_size", [1, 4, 7, 21])
    def test_jit_and_grads(self, name, batch_size):
        reduction, chunk_reduction, oracle = REDUCTIONS[name]

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
            return jnp.sum(oracle(self.model(w, x)) ** 2)

        assert_tree_close(jax.jit(chunked)(self.w, self.x), plain(self.w, self.x))
        g = jax.jit(jax.grad(chunked, argnums=(0, 1)))(self.w, self.x)
        assert_tree_close(g, jax.grad(plain, argnums=(0, 1))(self.w, self.x), rtol=1e-4, atol=1e-5)

    @pytest.mark.parametrize("name", ["map", "sum", "logsumexp", "max"])
    def test_jvp(self, name):
        reduction, chunk_reduction, oracle = REDUCTIONS[name]
        f = lambda x: ajm.batch_map(
            jnp.sin, x, 5, reduction=reduction, chunk_reduction=chunk_reduction
        )
        t = jnp.ones_like(self.x)
        out, tan = jax.jvp(f, (self.x,), (t,))
        eout, etan = jax.jvp(lambda x: oracle(jnp.sin(x)), (self.x,), (t,))
        assert_tree_close((out, tan), (eout, etan))

    @pytest.mark.parametrize("name", ["map", "sum", "logsumexp", "generic"])
    def test_vmap_of_batch_map(self, name):
        if name == "generic":
            reduction, chunk_reduction = jnp.multiply, jnp.prod
            oracle = jnp.prod
        else:
            reduction, chunk_reduction, oracle = REDUCTIONS[name]
        xs = jnp.linspace(0.1, 1, 3 * 21).reshape(3, 21)
        f = lambda x: ajm.batch_map(
            jnp.cos, x, 4, reduction=reduction, chunk_reduction=chunk_reduction
        )
        assert_tree_close(jax.vmap(f)(xs), jax.vmap(lambda x: oracle(jnp.cos(x)))(xs))

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

        g1 = jax.grad(chunked)(self.w)
        with ajm.config(remat=False):
            g2 = jax.grad(chunked)(self.w)
            jaxpr = str(jax.make_jaxpr(jax.grad(chunked))(self.w))
        assert "checkpoint" not in jaxpr and "remat" not in jaxpr
        assert "checkpoint" in str(jax.make_jaxpr(jax.grad(chunked))(self.w)) or "remat" in str(
            jax.make_jaxpr(jax.grad(chunked))(self.w)
        )
        assert_tree_close(g1, g2)


@pytest.mark.parametrize("batch_size", [None, 1, 2, 3, 4, 5])
def test_batch_vmap_matches_vmap_with_reductions(batch_size):
    xs = jnp.arange(15.0).reshape(5, 3)
    f = lambda x: jnp.outer(x, x)
    for name in ["map", "sum", "add.reduce", "logsumexp"]:
        reduction, chunk_reduction, oracle = REDUCTIONS[name]
        out = ajm.batch_vmap(
            f, batch_size=batch_size, reduction=reduction, chunk_reduction=chunk_reduction
        )(xs)
        assert_tree_close(out, oracle(jax.vmap(f)(xs)), rtol=1e-5, atol=1e-4)


def test_numpy_and_list_inputs():
    x = np.arange(9.0)
    assert_tree_close(ajm.batch_map(lambda x: x + 1, x, 4), jnp.asarray(x + 1, jnp.float32))
    out = ajm.batch_map(
        lambda t: t[0] * t[1], [x, x], 4, reduction=jnp.add, chunk_reduction=jnp.sum
    )
    assert_tree_close(out, jnp.float32((x * x).sum()))
