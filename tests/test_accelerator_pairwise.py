"""The pairwise tile kernel compiled and run on a real GPU or TPU (bench/device_check*.sh).

Marked ``accelerator``: deselected where jax sees no GPU or TPU (root conftest.py).
Through the public API with the default backend: the plan must take the device tile
kernel, the compiled program must hold it, and values and gradients must match the
dense plain-JAX oracle of tests/test_pairwise.py (every monoid there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from cases import oracle
from helpers import KERNEL_MARKERS, assert_tree_close
from test_pairwise import CASES, DIFFERENTIABLE, dense, inputs, scaled_loss
from test_pairwise_matmul import CASES as MATMUL_CASES
from test_pairwise_matmul import inputs as matmul_inputs
from test_pairwise_special_values import DOT_CASES as SPECIAL_DOT_CASES
from test_pairwise_special_values import close as close_at_special_values
from test_pairwise_special_values import dot_inputs as special_dot_inputs
from test_pairwise_special_values import transforms

import adv_jax_math as ajm

pytestmark = pytest.mark.accelerator

PLATFORM = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
TOL = dict(rtol=2e-4, atol=2e-4)  # the device sums in another order, exp/log ulps differ


def _oracle(fun):
    """The dense oracle at full float32 matmul precision (TPUs default to bf16 passes)."""

    def run(*args):
        with jax.default_matmul_precision("highest"):
            return fun(*args)

    return run


@pytest.mark.parametrize("name", list(CASES))
def test_device_kernel_values_match_dense_oracle(name):
    reduction, f, want = CASES[name]
    x, y = inputs()
    plan = ajm.explain_pairwise(f, x, y, reduction)
    assert plan.engine.startswith("pairwise kernel"), str(plan)
    call = jax.jit(lambda x, y: ajm.pairwise(f, x, y, reduction))
    text = call.lower(x, y).as_text()
    assert any(m in text for m in KERNEL_MARKERS[PLATFORM]), "no compiled kernel"
    expect = _oracle(jax.jit(lambda x, y: want(dense(f, x, y))))(x, y)
    assert_tree_close(call(x, y), expect, **TOL)


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_device_kernel_gradients_match_dense_oracle(name):
    reduction, f, want = CASES[name]
    x, y = inputs()
    loss = scaled_loss(f)
    ours = lambda g, x, y: ajm.pairwise(g, x, y, reduction)
    dense_run = lambda g, x, y: want(dense(g, x, y))
    got = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(0.7, x, y)
    grad = jax.jit(jax.grad(lambda *a: loss(dense_run, *a), argnums=(0, 1, 2)))
    assert_tree_close(got, _oracle(grad)(0.7, x, y), rtol=2e-3, atol=2e-3)


def test_device_kernel_at_a_size_that_needs_many_tiles():
    # a Gaussian kernel sum over 20011 x 30011 pairs (ragged against every tile size)
    x = jax.random.normal(jax.random.key(0), (20011, 3))
    y = jax.random.normal(jax.random.key(1), (30011, 3))
    b = jax.random.normal(jax.random.key(2), (30011,))
    f = lambda xi, yj: jnp.exp(-jnp.sum((xi - yj[:3]) ** 2)) * yj[3]
    yb = jnp.concatenate([y, b[:, None]], 1)
    got = jax.jit(lambda x, y: ajm.pairwise(f, x, y, ajm.ADD))(x, yb)
    expect = _oracle(
        jax.jit(
            lambda x, y: jax.lax.map(
                lambda xi: jnp.sum(jax.vmap(lambda yj: f(xi, yj))(y)), x, batch_size=512
            )
        )
    )(x, yb)
    assert_tree_close(got, expect, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", list(MATMUL_CASES))
def test_matmul_kernel_matches_dense_oracle(name):
    # the shared reductions at D = 64 (tests/test_pairwise_matmul.py): the tile kernel
    # declines the wide dot products and distances, the matmul tile kernel takes them;
    # on a TPU, f with several values per pair runs in XLA's loops (choose.TPU_WIDE_PAIRS)
    case = MATMUL_CASES[name]
    x, y = matmul_inputs()
    plan = ajm.explain_pairwise(case.f, x, y, case.reduction)
    call = jax.jit(lambda x, y: ajm.pairwise(case.f, x, y, case.reduction))
    if PLATFORM == "tpu" and "values per pair (a score per head" in str(plan):
        assert plan.engine == "pairwise tiles (matmul)", str(plan)
    else:
        assert plan.engine.startswith("pairwise kernel (matmul"), str(plan)
        assert any(m in call.lower(x, y).as_text() for m in KERNEL_MARKERS[PLATFORM])
    assert_tree_close(
        call(x, y), _oracle(jax.jit(lambda x, y: case.oracle(dense(case.f, x, y))))(x, y), **TOL
    )
    if case.differentiable:
        loss = scaled_loss(case.f)
        ours = lambda g, x, y: ajm.pairwise(g, x, y, case.reduction)
        dense_run = lambda g, x, y: case.oracle(dense(g, x, y))
        got = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(0.7, x, y)
        grad = jax.jit(jax.grad(lambda *a: loss(dense_run, *a), argnums=(0, 1, 2)))
        assert_tree_close(got, _oracle(grad)(0.7, x, y), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_kernel_attention_at_ragged_sizes(dtype):
    n, m, d = 1031, 2053, 64
    q, k, v = (
        jax.random.normal(jax.random.key(i), (r, d)).astype(dtype) for i, r in enumerate((n, m, m))
    )
    # at full float32 precision, as the oracle (a TPU's default is bfloat16 passes)
    f = lambda q, kv: (jnp.dot(q, kv[0], precision="highest") * d**-0.5, kv[1])
    run = jax.jit(lambda q, k, v: ajm.pairwise(f, q, (k, v), ajm.SOFTMAX_WEIGHTED))
    plain = lambda q, k, v: jax.nn.dot_product_attention(
        q[None, :, None], k[None, :, None], v[None, :, None], implementation="xla"
    )[0, :, 0]
    # (ours too: at the default precision a TPU's P @ V is bfloat16 passes, as XLA's)
    got, want = _oracle(run)(q, k, v), _oracle(jax.jit(plain))(q, k, v)
    tol = TOL if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    assert_tree_close(got.astype(jnp.float32), want.astype(jnp.float32), **tol)


@pytest.mark.parametrize("name", list(SPECIAL_DOT_CASES))
@pytest.mark.parametrize("precision", ["default", "highest"])
def test_matmul_kernel_at_special_values(name, precision):
    # +-inf, +-1e30 and NaN inside the dot products (tests/test_pairwise_special_values.py),
    # ragged tiles: values, jvp and grad against the dense oracle, NaN and inf exactly.
    # On a TPU v5e (jax 0.10.2) a Pallas dot at HIGHEST made [1, inf] . [1, 1] NaN
    # (XLA's: inf): every score of an infinite feature was NaN (precision.keeping_inf)
    reduction, f = SPECIAL_DOT_CASES[name]
    x, y = special_dot_inputs(not name.endswith("expanded"), 1e30)
    plan = ajm.explain_pairwise(f, x, y, reduction)  # (TPU tiles: multiples of 128)
    assert plan.engine.startswith("pairwise kernel (matmul"), str(plan)
    want = oracle(reduction, axis=1)
    ours = lambda x, y: ajm.pairwise(f, x, y, reduction)
    with jax.default_matmul_precision(precision):  # (both: at the default, bfloat16)
        expect = transforms(lambda x, y: want(dense(f, x, y)), x, y)
        got = jax.jit(lambda x, y: transforms(ours, x, y))(x, y)
    for part in expect:
        close_at_special_values(got[part], expect[part], f"{name} {part}")
