"""The compiled fused kernel on a real GPU or TPU (bench/device_check.sh).

Marked ``accelerator``: the root conftest.py deselects these where jax sees no GPU
or TPU, and counts them as deselected. Through the public API with the default
backend (``"auto"``): the plan must take the kernel (or fall back with its reason
on the cases the platform cannot run), the compiled program must contain the
kernel, and results must match plain JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, contains_kernel, enable_x64, oracle, reduction_kwargs

import adv_jax_math as ajm

pytestmark = pytest.mark.accelerator

PLATFORM = jax.default_backend()
W4 = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
# Compiled kernels reduce in another order than XLA: looser than helpers.TOL.
DEVICE_TOL = {"float32": 2e-4, "float64": 1e-10, "bfloat16": 3e-2}
if PLATFORM == "tpu":  # float64 is emulated: 3e-9 relative on a v5e's logsumexp (scan engine)
    DEVICE_TOL["float64"] = 1e-8


def normal(shape, dtype=jnp.float32, seed=0):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def assert_device_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        tol = DEVICE_TOL.get(np.dtype(e.dtype).name, 0)
        assert_tree_close(a, e, rtol=tol, atol=tol)


# name: (fun, xs builder taking n, x64)
CASES = {
    "(N,)": (lambda x: jnp.sin(x) * 2.0, lambda n: normal((n,)), False),
    "(N,4) closure": (lambda x: x * W4, lambda n: normal((n, 4)), False),
    "(N,3)": (lambda x: jnp.cos(x) + 1.0, lambda n: normal((n, 3)), False),
    "(N,4,8)": (lambda x: x * x - 0.5, lambda n: normal((n, 4, 8)), False),
    "pytree": (
        lambda d: {"p": d["a"] * d["b"][:, None], "q": (jnp.exp(d["b"]),)},
        lambda n: {"a": normal((n, 4)), "b": normal((n,), seed=1)},
        False,
    ),
    "bf16": (lambda x: x * 2 + 1, lambda n: normal((n, 4), jnp.bfloat16), False),
    "int32": (
        lambda x: x * 3 - 7,
        lambda n: jax.random.randint(jax.random.key(2), (n, 4), -50, 50),
        False,
    ),
    "f64": (jnp.sin, lambda n: normal((n, 4), jnp.float64), True),
}
FALLS_BACK = {"gpu": {"(N,3)": "power-of-two"}, "tpu": {"f64": "64-bit"}}
# Every case with two reductions, every reduction with four cases.
PAIRS = [
    (case, reduction)
    for i, case in enumerate(CASES)
    for reduction in [
        (("add", "max", "min", "logsumexp")[i % 4], None),
        (("logsumexp", "min", "max", "add")[i % 4], 0),
    ]
]


@pytest.mark.parametrize("case, reduction", PAIRS, ids=[f"{c}-{m}-{a}" for c, (m, a) in PAIRS])
def test_compiled_kernel_matches_oracle(case, reduction):
    fun, make, x64 = CASES[case]
    kw = reduction_kwargs(*reduction)
    with enable_x64(x64):
        xs = make(1037)
        plan = ajm.explain(fun, xs, 256, **kw)
        f = jax.jit(lambda x: ajm.batch_map(fun, x, 256, **kw))
        text = f.lower(xs).as_text()
        reason = FALLS_BACK.get(PLATFORM, {}).get(case)
        if reason is not None:
            assert plan.engine == "scan" and reason in plan.reason, str(plan)
        else:
            assert plan.engine == "pallas", str(plan)
        assert contains_kernel(text, PLATFORM) == (plan.engine == "pallas")
        assert_device_close(f(xs), oracle(*reduction)(fun(xs)))


@pytest.mark.parametrize("monoid", ["add", "max", "min", "logsumexp"])
def test_compiled_kernel_many_blocks_grad_and_vmap(monoid):
    # Triton: 2^12 blocks of 8192 rows, looped in pairs in each kernel program.
    axis = None if monoid in ("add", "min") else 0
    kw = reduction_kwargs(monoid, axis)
    xs = normal(((1 << 25) + 5,))
    square = lambda v: v * v
    # the kernel forced: at this size the roofline model may pick the scan engine (v5e)
    with ajm.config(backend="pallas"):
        plan = ajm.explain(square, xs, 1 << 26, **kw)
        got = jax.jit(lambda x: ajm.batch_map(square, x, 1 << 26, **kw))(xs)
    assert plan.engine == "pallas", str(plan)
    assert plan.block_steps > 1 or PLATFORM != "gpu", str(plan)  # Triton loops blocks
    assert_device_close(got, oracle(monoid, axis)(square(xs)))

    small = normal((3, 4099, 4))

    def per_example(run):
        loss = lambda w, x: jnp.sum(run(lambda v: jnp.tanh(v * w), x))
        return jax.vmap(jax.value_and_grad(loss), (None, 0))

    chunked = lambda f, x: ajm.batch_map(f, x, 1024, **kw)
    plain = lambda f, x: oracle(monoid, axis)(f(x))
    got = jax.jit(per_example(chunked))(W4, small)
    assert_device_close(got, per_example(plain)(W4, small))
