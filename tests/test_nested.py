"""Pairwise reductions written as nested ``batch_vmap`` calls take the pairwise engine.

``batch_vmap(lambda xi: batch_vmap(lambda yj: f(xi, yj), batch_size=bj,
reduction=M)(y), batch_size=bi)(x)`` is read as ``pairwise(f, x, y, M, tiles=(bi,
bj))``: values and gradients against the dense plain-JAX oracle, the kernel holding
the whole computation under ``backend="interpret"``, and the forms that are not
pairwise (the outer function post-processes the inner result, ``y`` depends on the
outer row, two inner calls, a reduction function) computed as written, with the
reason in ``explain``.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import TraceCounter, assert_tree_close, needs_abstract_devices, on_abstract_device
from test_pairwise import CASES, ENGINES, TILES, _flat, dense, inputs

import adv_jax_math as ajm

NAMES = ["logsumexp", "min_argmin", "k_nearest", "softmax_weighted", "pytree"]


def nested(f, reduction, y, tiles=TILES):
    bi, bj = tiles
    inner = lambda xi: ajm.batch_vmap(lambda yj: f(xi, yj), batch_size=bj, reduction=reduction)(y)
    return ajm.batch_vmap(inner, batch_size=bi)


@pytest.mark.parametrize("backend", list(ENGINES))
@pytest.mark.parametrize("name", NAMES)
def test_nested_calls_take_the_pairwise_engine(name, backend):
    reduction, f, want = CASES[name]
    x, y = inputs()
    with ajm.config(backend=backend):
        plan = nested(f, reduction, y).explain(x)
        got = jax.jit(lambda x, y: nested(f, reduction, y)(x))(x, y)
    assert plan.engine == ENGINES[backend] and plan.tiles == TILES, str(plan)
    assert "read from nested batch_vmap calls" in plan.reason, str(plan)
    assert_tree_close(got, want(dense(f, x, y)), rtol=2e-5, atol=2e-5)


# by default half of names x engines (a checkerboard: both names, every engine; 3-6 s
# each here); the other half slow (make test-slow)
@pytest.mark.parametrize(
    "name, backend",
    [
        pytest.param(name, backend, marks=pytest.mark.slow if (i + j) % 2 else ())
        for i, name in enumerate(["logsumexp", "min"])
        for j, backend in enumerate(ENGINES)
    ],
)
def test_nested_gradients_match_dense_oracle(name, backend):
    reduction, f, want = CASES[name]
    x, y = inputs()
    scaled = lambda s: lambda a, b: f(a, b) * s
    loss = lambda run: lambda s, x, y: jnp.sum(jnp.sin(run(scaled(s), x, y)))
    ours = loss(lambda g, x, y: nested(g, reduction, y)(x))
    with ajm.config(backend=backend):
        got = jax.grad(ours, argnums=(0, 1, 2))(0.7, x, y)
    expect = jax.grad(loss(lambda g, x, y: want(dense(g, x, y))), argnums=(0, 1, 2))(0.7, x, y)
    assert_tree_close(got, expect, rtol=2e-4, atol=2e-4)


def test_nested_value_and_grad_is_kernels_only():
    reduction, f, _ = CASES["logsumexp"]
    x, y = inputs()
    loss = lambda x, y: jnp.sum(nested(f, reduction, y)(x))
    with ajm.config(backend="interpret"):
        forward = jax.make_jaxpr(loss)(x, y)
        both = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(x, y)
    for jaxpr, kernels in ((forward, 1), (both, 3)):
        outside = [e.primitive.name for e in _flat(jaxpr.jaxpr)]
        assert outside.count("pallas_call") == kernels, outside
        assert not {"scan", "while"} & set(outside), outside


def test_inner_axes_and_unmapped_arguments_carry_over():
    # y given transposed (in_axes=1) and a scale passed unmapped to the inner call
    reduction, f, want = CASES["logsumexp"]
    x, y = inputs()
    y_t = y.T  # outside the outer function: a value computed in it is not closed over
    pair = lambda yj, s, xi: f(xi, yj) * s
    inner = lambda xi: ajm.batch_vmap(
        lambda yj, s: pair(yj, s, xi), in_axes=(1, None), batch_size=16, reduction=reduction
    )(y_t, 0.5)
    outer = ajm.batch_vmap(inner, batch_size=8)
    assert outer.explain(x).engine == "pairwise tiles (xla)"
    assert_tree_close(outer(x), want(dense(lambda a, b: f(a, b) * 0.5, x, y)), rtol=2e-5)


NOT_PAIRWISE = {  # name: (outer function on one x row, oracle, the reason explain gives)
    "post-processed": (
        lambda y: (
            lambda xi: (
                2
                * ajm.batch_vmap(
                    lambda yj: -jnp.sum((xi - yj) ** 2), batch_size=16, reduction=ajm.LOGSUMEXP
                )(y)
            )
        ),
        lambda x, y: 2 * jax.nn.logsumexp(-dense(lambda a, b: jnp.sum((a - b) ** 2), x, y), 1),
        "does not return the inner call's result as is",
    ),
    "y from the row": (
        lambda y: (
            lambda xi: ajm.batch_vmap(
                lambda yj: -jnp.sum((xi - yj) ** 2), batch_size=16, reduction=ajm.LOGSUMEXP
            )(y + xi)
        ),
        lambda x, y: jax.vmap(lambda a: jax.nn.logsumexp(-jnp.sum((a - (y + a)) ** 2, 1)))(x),
        "computed in the outer function",
    ),
    "two inner calls": (
        lambda y: (
            lambda xi: [
                ajm.batch_vmap(lambda yj: jnp.sum(xi * yj), batch_size=16, reduction=ajm.ADD)(y)
                for _ in range(2)
            ]
        ),
        lambda x, y: [jnp.sum(dense(lambda a, b: jnp.sum(a * b), x, y), 1)] * 2,
        "makes 2 nested batch_vmap/batch_map calls",
    ),
    "reduction function": (
        lambda y: (
            lambda xi: ajm.batch_vmap(
                lambda yj: jnp.sum(xi * yj),
                batch_size=16,
                reduction=jnp.add,
                chunk_reduction=jnp.sum,
            )(y)
        ),
        lambda x, y: jnp.sum(dense(lambda a, b: jnp.sum(a * b), x, y), 1),
        "is not a Monoid",
    ),
}


@pytest.mark.parametrize("name", list(NOT_PAIRWISE))
def test_other_forms_run_as_written_and_say_why(name):
    outer_of, oracle, why = NOT_PAIRWISE[name]
    x, y = inputs()
    outer = ajm.batch_vmap(outer_of(y), batch_size=8)
    plan = outer.explain(x)
    assert isinstance(plan, ajm.Plan) and any(why in note for note in plan.notes), str(plan)
    assert_tree_close(outer(x), oracle(x, y), rtol=2e-5, atol=2e-5)


def test_a_stacking_call_still_traces_f_once():
    f = TraceCounter(lambda v: jnp.sin(v) * 2)
    out = ajm.batch_vmap(f, batch_size=4)(jnp.ones((9, 3)))
    assert f.calls == 1 and out.shape == (9, 3)


@needs_abstract_devices
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_nested_calls_on_gpu_and_tpu_take_the_tile_kernel(platform):
    # batch sizes 8 and 16 would break the TPU tile rules: the tile kernel's own tiles,
    # no larger than the least that hold the rows (37 x 53)
    reduction, f, _ = CASES["logsumexp"]
    x, y = inputs()
    with on_abstract_device(platform):
        plan = nested(f, reduction, y).explain(x)
    kind = "mosaic_gpu" if platform == "cuda" else "tpu"  # (an H100: Mosaic GPU's tiles)
    assert plan.engine == f"pairwise kernel ({kind})", str(plan)
    assert plan.tiles == {"mosaic_gpu": (40, 64), "tpu": (128, 128)}[kind], str(plan)
