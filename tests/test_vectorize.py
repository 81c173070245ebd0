"""batch_vectorize against jnp.vectorize (plain-JAX oracle)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close

from adv_jax_math.batch.vectorize import batch_vectorize

RNG = np.random.default_rng(0)


def rand(*shape):
    return jnp.asarray(RNG.normal(size=shape), jnp.float32)


TOL = dict(rtol=1e-5, atol=1e-6)


def check(pyfunc, *args, batch_size, excluded=frozenset(), signature=None, **kw):
    expected = jnp.vectorize(pyfunc, excluded=excluded, signature=signature)(*args, **kw)
    ours = batch_vectorize(pyfunc, excluded=excluded, signature=signature, batch_size=batch_size)
    assert_tree_close(ours(*args, **kw), expected, **TOL)


# loop shape (3, 4): 12 elements -> None, 1, a divisor (4), a non-divisor (5), exact, more
BATCH_SIZES = [None, 1, 4, 5, 12, 100]


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_elementwise_broadcasting(batch_size):
    f = lambda a, b: jnp.sin(a) * b + 1
    check(f, rand(3, 4), rand(4), batch_size=batch_size)  # full + partially broadcast
    check(f, rand(3, 1), rand(1, 4), batch_size=batch_size)  # both partially broadcast
    check(f, rand(3, 4), 2.0, batch_size=batch_size)  # scalar broadcast


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_matvec_signature(batch_size):
    matvec = lambda m, v: m @ v
    sig = "(n,k),(k)->(n)"
    check(matvec, rand(3, 4, 2, 5), rand(5), signature=sig, batch_size=batch_size)
    check(matvec, rand(3, 1, 2, 5), rand(4, 5), signature=sig, batch_size=batch_size)
    check(matvec, rand(2, 5), rand(3, 4, 5), signature=sig, batch_size=batch_size)
    check(matvec, rand(2, 5), rand(5), signature=sig, batch_size=batch_size)  # no loop dims


@pytest.mark.parametrize("batch_size", [None, 1, 2, 3])
def test_cross_product_and_whitespace_in_signature(batch_size):
    def cross(a, b):
        assert a.shape == b.shape == (3,)
        return jnp.array([a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1]])

    a, b = rand(1, 2, 3), rand(2, 1, 3)
    expected = jnp.vectorize(cross, signature="(k),(k)->(k)")(a, b)
    got = batch_vectorize(cross, signature=" (k), (k) -> (k) ", batch_size=batch_size)(a, b)
    assert_tree_close(got, expected, **TOL)


@pytest.mark.parametrize("batch_size", [None, 1, 3])
def test_multiple_outputs_and_output_only_dims(batch_size):
    stats = lambda x: (jnp.mean(x), x - jnp.mean(x))
    check(stats, rand(2, 3, 4), signature="(n)->(),(n)", batch_size=batch_size)
    ramp = lambda x: x * jnp.arange(3.0)
    check(ramp, rand(2, 3), signature="()->(m)", batch_size=batch_size)


@pytest.mark.parametrize("batch_size", [None, 1, 5])
def test_excluded_positional_and_keyword(batch_size):
    def f(x, n, scale, *, mode):
        y = jnp.sum(x * jnp.arange(n)) * scale
        return -y if mode == "neg" else y

    x, scale = rand(3, 2, 4), rand(3, 1)
    sig = "(k),()->()"
    check(f, x, 4, scale, excluded={1, "mode"}, signature=sig, batch_size=batch_size, mode="neg")


@pytest.mark.parametrize("batch_size", [None, 2])
def test_none_arguments_pass_through(batch_size):
    f = lambda a, b, c: a * 2 if b is None else a + b
    check(f, rand(2, 3), None, None, batch_size=batch_size)
    with pytest.raises(ValueError, match="Cannot pass None"):
        batch_vectorize(f, signature="(),(k),()->()", batch_size=batch_size)(rand(3), None, 1.0)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_keyword_arguments_are_vectorized(batch_size):
    # jnp.vectorize drops non-excluded keyword arguments; we vectorize them like NumPy does
    f = lambda x, y=0.0: x * y
    x, y = rand(3, 4), rand(4)
    got = batch_vectorize(f, batch_size=batch_size)(x, y=y)
    assert_tree_close(got, jnp.vectorize(f)(x, y), **TOL)


@pytest.mark.parametrize("batch_size", [None, 1, 4])
def test_pytree_output_without_signature(batch_size):
    f = lambda a, b: {"sum": a + b, "pair": (a * b, jnp.stack([a, b]))}
    check(f, rand(2, 4), rand(2, 4), batch_size=batch_size)
    got = batch_vectorize(f, batch_size=batch_size)(rand(2, 1), rand(1, 4))
    assert jax.tree.map(jnp.shape, got) == {"sum": (2, 4), "pair": ((2, 4), (2, 4, 2))}


@pytest.mark.parametrize("batch_size", [None, 2])
def test_size_one_and_empty_loops(batch_size):
    f = lambda a, b: a * b
    check(f, rand(1, 1), rand(1), batch_size=batch_size)
    check(f, rand(0, 3), rand(3), batch_size=batch_size)
    check(lambda v: jnp.sum(v), rand(0, 3), signature="(k)->()", batch_size=batch_size)
    check(f, 2.0, 3.0, batch_size=batch_size)


def test_grad_and_jit_through_chunks():
    f = lambda m, v: jnp.tanh(m @ v)
    m, v = rand(5, 2, 3), rand(3)
    ours = batch_vectorize(f, signature="(n,k),(k)->(n)", batch_size=2)
    ref = jnp.vectorize(f, signature="(n,k),(k)->(n)")
    loss = lambda g: lambda m, v: jnp.sum(g(m, v) ** 2)
    got = jax.jit(jax.grad(loss(ours), (0, 1)))(m, v)
    assert_tree_close(got, jax.grad(loss(ref), (0, 1))(m, v), **TOL)


def test_chunking_happens_and_chunk_size_alias():
    f = lambda a: jnp.sum(jnp.stack([jnp.sin(a), a]))  # not elementwise: chunked
    x = rand(3, 4)
    assert_tree_close(batch_vectorize(f, chunk_size=5)(x), jnp.sin(x) + x, **TOL)
    jaxpr = str(jax.make_jaxpr(batch_vectorize(f, chunk_size=5))(x))
    assert "scan" in jaxpr or "while" in jaxpr
    assert "scan" not in str(jax.make_jaxpr(batch_vectorize(f, batch_size=12))(x))


@pytest.mark.parametrize("batch_size", [None, 2])
def test_rank_promotion_config(batch_size):
    f = lambda a, b: a + b
    a, b = rand(3, 4), rand(4)
    expected = jnp.vectorize(f)(a, b)
    ours = batch_vectorize(f, batch_size=batch_size)
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank promotion"):
            jnp.vectorize(f)(a, b)  # the oracle raises too
        with pytest.raises(ValueError, match="rank promotion"):
            ours(a, b)
        assert_tree_close(ours(a, 1.0), jnp.vectorize(f)(a, 1.0), **TOL)  # scalars never count
        assert_tree_close(ours(a, b[None]), expected, **TOL)
    with jax.numpy_rank_promotion("warn"):
        with pytest.warns(UserWarning, match="rank promotion"):
            got = ours(a, b)
        assert_tree_close(got, expected, **TOL)
    with jax.numpy_rank_promotion("allow"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_tree_close(ours(a, b), expected, **TOL)


def two_outputs(x):
    return x, x


@pytest.mark.parametrize(
    ("pyfunc", "signature", "args", "error", "match"),
    [
        (jnp.sum, "(n)->()", (rand(3, 4), rand(4)), TypeError, "wrong number of vectorized"),
        (jnp.dot, "(n,k),(k)->(n)", (rand(3), rand(3)), ValueError, "not have enough dim"),
        (jnp.dot, "(n,k),(k)->(n)", (rand(2, 3), rand(4)), ValueError, "inconsistent size"),
        (jnp.dot, "(k),(k)->()", (rand(2, 3), rand(4, 3)), ValueError, "do not broadcast"),
        (jnp.sum, "(n)->(),()", (rand(3),), TypeError, "must return a tuple"),
        (two_outputs, "(n)->(n)", (rand(3),), TypeError, "wrong number of outputs"),
        (jnp.sum, "(n)->(n)", (rand(2, 3),), ValueError, "does not match core dim"),
        (lambda x: jnp.ones(4), "(n)->(n)", (rand(2, 3),), ValueError, "inconsistent size"),
    ],
)
@pytest.mark.parametrize("batch_size", [None, 1])
def test_call_errors(pyfunc, signature, args, error, match, batch_size):
    with pytest.raises(error):
        jnp.vectorize(pyfunc, signature=signature)(*args)  # the oracle rejects it too
    with pytest.raises(error, match=match):
        batch_vectorize(pyfunc, signature=signature, batch_size=batch_size)(*args)


@pytest.mark.parametrize(
    "signature",
    ["(n)", "(n)->", "->(n)", "(n)->(n)->(n)", "(n,)->()", "(n),->()", "(n-1)->()", "n->()", "(n"],
)
def test_invalid_signatures(signature):
    with pytest.raises(ValueError, match="not a valid gufunc signature"):
        batch_vectorize(jnp.sum, signature=signature)
    with pytest.raises(TypeError, match="must be a str"):
        batch_vectorize(jnp.sum, signature=3)


def test_definition_errors():
    with pytest.raises(TypeError, match="excluded"):
        batch_vectorize(jnp.sin, excluded={1.5})
    with pytest.raises(ValueError, match="negative"):
        batch_vectorize(jnp.sin, excluded={-1})
    with pytest.raises(ValueError, match="'bogus'"):
        batch_vectorize(jnp.sin, batch_size=2, bogus=True)
    with pytest.raises(ValueError, match="batch_size=0"):
        batch_vectorize(jnp.sin, batch_size=0)
    with pytest.raises(TypeError, match="callable"):
        batch_vectorize("sin")
