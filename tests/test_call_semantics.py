"""A call means what plain JAX means: every eager call sees ``fun`` as it is now,
sums promote like ``jnp.sum``, NaN reaches max/min gradients, constants are not
folded into wrong programs; and the errors of odd calls name what was given."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, enable_x64, needs_kernel

import adv_jax_math as ajm
from adv_jax_math.plan import autotune as _autotune

SUM = dict(reduction=jnp.add, chunk_reduction=jnp.sum)
ENGINES = {
    "scan": (contextlib.nullcontext, {}),
    "interpret": (lambda: ajm.config(backend="interpret"), {}),
    "shard": (contextlib.nullcontext, {"shard": True}),
}


# -- a fresh trace every eager call ------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        dict(reduction=jnp.add, chunk_reduction=jnp.sum),  # overlapping chunks
        dict(reduction=lambda a, b: a + b, chunk_reduction=lambda y: jnp.sum(y) * 1.0 + 0.0),
        {},  # a map
    ],
    ids=["monoid", "generic (full chunks, then the remainder)", "map"],
)
def test_eager_calls_see_fun_as_it_is_now(kw):
    scale = [1.0]
    fun = lambda t: t * scale[0]
    y = jnp.arange(26.0).reshape(13, 2)
    for s in (1.0, 2.0):
        scale[0] = s
        out = ajm.batch_map(fun, y, 4, **kw)
        want = fun(y) if not kw else jnp.sum(fun(y))
        assert_tree_close(out, want)  # 650 at 2.0: not 374, a mix of two traces


def test_recognition_sees_the_reduction_as_it_is_now():
    class Switch:  # one bound method, its object switched from a sum to a max
        def __init__(self):
            self.max = False

        def reduce(self, t):
            return t.max(0) if self.max else t.sum(0)

        def combine(self, a, b):
            return jnp.maximum(a, b) if self.max else a + b

    s, y = Switch(), jnp.arange(26.0).reshape(13, 2)
    assert_tree_close(
        ajm.batch_map(lambda t: t, y, 4, reduction=s.combine, chunk_reduction=s.reduce), y.sum(0)
    )
    s.max = True
    assert_tree_close(
        ajm.batch_map(lambda t: t, y, 4, reduction=s.combine, chunk_reduction=s.reduce), y.max(0)
    )


def test_closed_over_splat_constant_is_not_folded():
    # jaxlib 0.12.0.1's XLA:CPU miscompiles a dot with a splat constant fused into a
    # reduction (jnp.sum(jnp.tanh(x @ (ones / 8)) ** 2) under jit: 84.8, eagerly 3906.7):
    # fun's constants are arguments of the program, as values of an eager call are.
    w = jnp.ones((8, 16)) / 8
    x = jnp.linspace(-1.0, 1.0, 1024 * 8).reshape(1024, 8)
    fun = lambda r: jnp.sum(jnp.tanh(r @ w) ** 2, axis=1)
    want = np.sum(np.tanh(np.asarray(x, np.float64) @ np.asarray(w, np.float64)) ** 2)
    for b in (None, 256):
        got = ajm.batch_map(fun, x, b, **SUM)
        np.testing.assert_allclose(float(got), want, rtol=1e-4)


# -- ADD reduces like jnp.sum -----------------------------------------------------------
DTYPES = [jnp.bool_, jnp.uint8, jnp.int8, jnp.int16, jnp.int32, jnp.bfloat16, jnp.float16]


# by default half of x32/x64 x engines (a checkerboard: both modes, every engine; 4-6 s
# each here); the other half slow (make test-slow)
@pytest.mark.parametrize(
    "x64, name",
    [
        pytest.param(
            x64,
            name,
            id=f"x{64 if x64 else 32}-{name}",
            marks=pytest.mark.slow if (i + j) % 2 else (),
        )
        for i, x64 in enumerate([False, True])
        for j, name in enumerate(ENGINES)
    ],
)
def test_add_promotes_like_jnp_sum(name, x64):
    if name == "interpret" and jax.__version_info__ < (0, 10, 0):
        pytest.skip(needs_kernel.kwargs["reason"])
    ctx, kw = ENGINES[name]
    with enable_x64(x64), ctx():
        for dtype in DTYPES:
            y = (jnp.arange(300 * 5) % 7).reshape(300, 5).astype(dtype)
            got = ajm.batch_map(lambda t: t, y, 7, reduction=ajm.ADD, **kw)
            assert_tree_close(got, jnp.sum(y, 0), rtol=1e-2)  # dtype and value
            got = ajm.batch_map(lambda t: t, y, 7, reduction=jnp.add, chunk_reduction=jnp.sum, **kw)
            assert_tree_close(got, jnp.sum(y), rtol=1e-2)


# -- NaN reaches max/min gradients ------------------------------------------------------
@pytest.mark.parametrize("name", list(ENGINES))
@pytest.mark.parametrize(
    "reduction, plain",
    [
        (dict(reduction=ajm.MAX), lambda y: jnp.max(y, 0)),
        (dict(reduction=jnp.minimum, chunk_reduction=jnp.min), jnp.min),
        (dict(reduction=ajm.MIN_ARGMIN), lambda y: (jnp.min(y, 0), jnp.argmin(y, 0))),
    ],
    ids=["MAX", "jnp.min all axes", "MIN_ARGMIN"],
)
def test_max_min_gradients_propagate_nan(name, reduction, plain):
    if name == "interpret" and jax.__version_info__ < (0, 10, 0):
        pytest.skip(needs_kernel.kwargs["reason"])
    ctx, kw = ENGINES[name]
    x = jnp.array([[1.0, 2.0], [jnp.nan, 3.0], [3.0, 3.0], [0.5, -1.0], [2.0, 3.0]])
    first = lambda out: jax.tree.leaves(out)[0].sum()
    ours_f = lambda v: first(ajm.batch_map(lambda t: t * 2, v, 2, **reduction, **kw))
    want_f = lambda v: first(plain(v * 2))
    dx = jnp.arange(1.0, 11.0).reshape(x.shape)
    with ctx():
        ours, ours_t = jax.grad(ours_f)(x), jax.jvp(ours_f, (x,), (dx,))[1]
    assert_tree_close(ours, jax.grad(want_f)(x))  # column 0 NaN everywhere; column 1 ties 1/3 each
    assert_tree_close(ours_t, jax.jvp(want_f, (x,), (dx,))[1])  # forward mode: NaN too


# -- odd calls: clear errors --------------------------------------------------------------
def test_symbolic_leading_dimension_is_named():
    (n,) = jax.export.symbolic_shape("n")
    spec = jax.ShapeDtypeStruct((n, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"symbolic leading dimension n.*batch_map"):
        jax.export.export(jax.jit(lambda x: ajm.batch_map(jnp.sin, x, 4)))(spec)
    # one call of fun needs no rows: it exports at any size
    exported = jax.export.export(jax.jit(lambda x: ajm.batch_map(jnp.sin, x, None, **SUM)))(spec)
    assert exported.out_avals[0].shape == ()


def test_remainder_of_another_shape_is_named():
    with pytest.raises(ValueError, match=r"remainder.*chunk_reduction keeps the rows"):
        ajm.batch_map(lambda t: t, jnp.arange(10.0), 4, reduction=lambda a, b: a + b)


@pytest.mark.skipif(jax.device_count() != 4, reason="needs the 4 virtual CPU devices")
@pytest.mark.parametrize("n", [16, 64, 67])
def test_auto_batch_size_with_shard_on_the_first_call(n):
    _autotune.clear_cache()
    x = jnp.linspace(-1.0, 1.0, n)
    got = ajm.batch_map(jnp.sin, x, "auto", shard=True, **SUM)  # planned outside shard_map
    assert_tree_close(got, jnp.sum(jnp.sin(x)))
