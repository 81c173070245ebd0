"""batch_jacfwd / batch_jacrev against jax.jacfwd / jax.jacrev (plain-JAX oracles)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close

from adv_jax_math.batch.jacobian import batch_jacfwd, batch_jacrev

BATCH_JAC = {"fwd": (batch_jacfwd, jax.jacfwd), "rev": (batch_jacrev, jax.jacrev)}


TIGHT = dict(rtol=1e-6, atol=1e-6)  # same ops on the same values as the oracle


def f_6_to_6(x):
    """(2, 3) -> (3, 2): six input and six output directions."""
    a = jnp.arange(6.0).reshape(3, 2) / 5
    return jnp.tanh(x.T * a) + jnp.sin(x.sum()) * a


X = jnp.arange(6.0).reshape(2, 3) / 7


# 6 directions: None, 1, a divisor (2), a non-divisor (4), one chunk exactly (6), more (100)
@pytest.mark.parametrize("batch_size", [None, 1, 2, 4, 6, 100])
@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_matches_jax(mode, batch_size):
    ours, oracle = BATCH_JAC[mode]
    assert_tree_close(ours(f_6_to_6, batch_size=batch_size)(X), oracle(f_6_to_6)(X), **TIGHT)


def pytree_fun(p, scale):
    y = jnp.sin(p["a"]) * p["b"][0, 0] + p["b"][:, 0].sum() * scale
    return y, {"c": jnp.sum(p["a"] ** 2) * scale, "d": p["b"] * p["a"][0]}


P = {"a": jnp.array([0.3, -1.2]), "b": jnp.array([[0.5], [2.0], [-0.7]])}


@pytest.mark.parametrize("batch_size", [None, 1, 2, 3])
@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_pytree_inputs_and_outputs(mode, batch_size):
    ours, oracle = BATCH_JAC[mode]
    assert_tree_close(
        ours(pytree_fun, batch_size=batch_size)(P, 1.5), oracle(pytree_fun)(P, 1.5), **TIGHT
    )


def aux_fun(x, k, y):
    out = {"u": x * y[0], "v": jnp.outer(x, y).sum(0) * k}
    return out, {"norm": jnp.linalg.norm(x), "k": k}


@pytest.mark.parametrize("argnums", [(0, 2), (2, 0), (-1,), 0, -3])
@pytest.mark.parametrize("batch_size", [None, 1, 2])
@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_argnums_with_aux(mode, batch_size, argnums):
    ours, oracle = BATCH_JAC[mode]
    args = (jnp.array([1.0, -2.0, 0.5]), 3, jnp.array([0.2, 0.4]))
    jac, aux = ours(aux_fun, argnums=argnums, has_aux=True, batch_size=batch_size)(*args)
    jac_ref, aux_ref = oracle(aux_fun, argnums=argnums, has_aux=True)(*args)
    assert_tree_close(jac, jac_ref, **TIGHT)
    assert_tree_close(aux, aux_ref, **TIGHT)


@pytest.mark.parametrize("batch_size", [None, 1, 2])
@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_holomorphic(mode, batch_size):
    ours, oracle = BATCH_JAC[mode]
    f = lambda z: z**2 * jnp.sin(z[::-1])
    z = jnp.array([1 + 2j, -0.5j, 0.3 + 0.1j], dtype=jnp.complex64)
    expected = oracle(f, holomorphic=True)(z)
    assert_tree_close(
        ours(f, holomorphic=True, batch_size=batch_size)(z), expected, rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_scalar_and_empty_inputs(mode):
    ours, oracle = BATCH_JAC[mode]
    f = lambda x: jnp.stack([x**2, jnp.sin(x)])
    assert_tree_close(ours(f, batch_size=1)(0.7), oracle(f)(0.7), **TIGHT)
    g = lambda x: jnp.concatenate([x * 2, jnp.ones(2)])
    assert_tree_close(ours(g, batch_size=2)(jnp.ones((0,))), oracle(g)(jnp.ones((0,))), **TIGHT)


def test_jacfwd_complex_output_of_real_input():
    f = lambda x: jnp.exp(1j * x)
    x = jnp.array([1.0, 2.0, 3.0])
    assert_tree_close(batch_jacfwd(f, batch_size=2)(x), jax.jacfwd(f)(x), **TIGHT)


@pytest.mark.parametrize("batch_size", [None, 1])
def test_jacfwd_integer_output_gives_zeros_like_jax(batch_size):
    f = lambda x: (x * 2, jnp.arange(3))
    x = jnp.ones(2)
    assert_tree_close(batch_jacfwd(f, batch_size=batch_size)(x), jax.jacfwd(f)(x), **TIGHT)


@pytest.mark.parametrize("batch_size", [None, 1])
def test_jacrev_allow_int(batch_size):
    f = lambda x, n: x * n.sum()
    args = (jnp.ones(2), jnp.arange(3))
    expected = jax.jacrev(f, argnums=(0, 1), allow_int=True)(*args)
    ours = batch_jacrev(f, (0, 1), allow_int=True, batch_size=batch_size)
    assert_tree_close(ours(*args), expected, **TIGHT)
    with pytest.raises(TypeError, match="allow_int=True"):
        batch_jacrev(f, (0, 1), batch_size=batch_size)(*args)
    g = lambda n: n * 2.0  # only integer inputs: nothing to pull back
    expected = jax.jacrev(g, allow_int=True)(args[1])
    assert_tree_close(
        batch_jacrev(g, allow_int=True, batch_size=batch_size)(args[1]), expected, **TIGHT
    )


@pytest.mark.parametrize(
    ("ours", "kwargs", "x", "fun", "match"),
    [
        (batch_jacfwd, {}, jnp.arange(3), jnp.sin, "real floating inputs"),
        (batch_jacfwd, {}, jnp.ones(3, jnp.complex64), jnp.sin, "holomorphic=True"),
        (batch_jacfwd, {"holomorphic": True}, jnp.ones(3), jnp.sin, "complex inputs"),
        (batch_jacfwd, {"holomorphic": True}, jnp.ones(3, jnp.complex64), jnp.abs, "complex out"),
        (batch_jacrev, {}, jnp.ones(3), lambda x: jnp.exp(1j * x), "real floating outputs"),
        (batch_jacrev, {}, jnp.ones(3), lambda x: jnp.arange(3), "real floating outputs"),
        (batch_jacrev, {"holomorphic": True}, jnp.ones(3), jnp.sin, "complex inputs"),
        (batch_jacrev, {"holomorphic": True}, jnp.ones(3, jnp.complex64), jnp.abs, "complex out"),
        (batch_jacrev, {}, jax.random.key(0), lambda k: jax.random.normal(k), "dtype key"),
    ],
)
@pytest.mark.parametrize("batch_size", [None, 1])
def test_dtype_errors(ours, kwargs, x, fun, match, batch_size):
    with pytest.raises(TypeError, match=match):
        ours(fun, batch_size=batch_size, **kwargs)(x)


@pytest.mark.parametrize("ours", [batch_jacfwd, batch_jacrev])
def test_argnums_errors(ours):
    f = lambda x, y: x * y
    x = jnp.ones(2)
    with pytest.raises(ValueError, match="out of range"):
        ours(f, argnums=2)(x, x)
    with pytest.raises(ValueError, match="more than once"):
        ours(f, argnums=(0, -2))(x, x)
    for bad in [1.5, "a", (), (0, 1.0), True]:
        with pytest.raises(TypeError, match="argnums"):
            ours(f, argnums=bad)
    with pytest.raises(TypeError, match="callable"):
        ours(3)


@pytest.mark.parametrize("ours", [batch_jacfwd, batch_jacrev])
def test_chunk_size_alias_and_kwarg_errors(ours):
    f = f_6_to_6
    expected = ours(f)(X)
    chunked = ours(f, chunk_size=4)
    assert_tree_close(chunked(X), expected, **TIGHT)
    # the alias really chunks: the chunked program has a loop, the unchunked one none
    assert "scan" in str(jax.make_jaxpr(chunked)(X)) or "while" in str(jax.make_jaxpr(chunked)(X))
    assert "scan" not in str(jax.make_jaxpr(ours(f))(X))
    assert_tree_close(ours(f, batch_size=6, chunk_size=1)(X), expected, **TIGHT)  # batch_size wins
    with pytest.raises(ValueError, match="'bogus'"):
        ours(f, batch_size=2, bogus=1)
    with pytest.raises(ValueError, match="batch_size=0"):
        ours(f, batch_size=0)
    with pytest.raises(TypeError, match="batch_size=2.0"):
        ours(f, batch_size=2.0)


@pytest.mark.parametrize(("ours", "n_directions"), [(batch_jacfwd, 8), (batch_jacrev, 8)])
def test_primal_evaluated_once_for_four_chunks(ours, n_directions):
    calls = []

    def f(x):  # not jitted: every Python call is a trace of the primal
        calls.append(1)
        return jnp.sin(x) * jnp.cumsum(x)

    x = jnp.linspace(0.1, 1.0, n_directions)
    jac = ours(f, batch_size=n_directions // 4)(x)  # 4 chunks
    assert len(calls) == 1
    np.testing.assert_allclose(jac, jax.jacfwd(f)(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_under_jit_and_vmap(mode):
    ours, oracle = BATCH_JAC[mode]
    xs = jnp.stack([X, 2 * X])
    got = jax.jit(jax.vmap(ours(f_6_to_6, batch_size=4)))(xs)
    assert_tree_close(got, jax.vmap(oracle(f_6_to_6))(xs), **TIGHT)


def test_jacrev_chunks_bound_compiled_memory():
    n = 2048

    def f(x, w):  # per output row, the backward pass builds an (n, n) reverse cumsum
        return jnp.sum(jnp.cumsum(jnp.sin(x[:, None] * w), axis=1) ** 2, axis=1)

    x, w = jnp.ones(n), jnp.ones((n, n)) / n

    def temp_bytes(g):
        return jax.jit(g).lower(x, w).compile().memory_analysis().temp_size_in_bytes

    unchunked = temp_bytes(jax.jacrev(f))
    chunked = temp_bytes(batch_jacrev(f, batch_size=16))
    # measured: 64 GiB vs 544 MiB; one chunk's (16, n, n) intermediate is 256 MiB
    assert chunked < unchunked / 50, (chunked, unchunked)
