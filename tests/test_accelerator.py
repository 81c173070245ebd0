"""The compiled fused kernel on a real GPU or TPU (bench/device_check.sh).

Marked ``accelerator``: the root conftest.py deselects these where jax sees no GPU
or TPU, and counts them as deselected. Through the public API with the default
backend (``"auto"``): the plan must take the kernel (or fall back with its reason
on the cases the platform cannot run), the compiled program must contain the
kernel, and results must match plain JAX.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import plain_pair
from cases.map_reduce import BY_NAME, LOWERING, W4
from helpers import assert_tree_close, contains_kernel, enable_x64, oracle, reduction_kwargs

import adv_jax_math as ajm

pytestmark = pytest.mark.accelerator

PLATFORM = jax.default_backend()
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


# Cases of bench/cases/map_reduce.py (1-D, (N, 4) with a closure, (N, 3), (N, 4, 8), a
# bf16/int32 pytree, (N, 8, 16) bf16 and int32 blocks, float64) on 1037 rows in blocks
# of 256; where the kernel falls back, LOWERING's (GPU, TPU) reasons say why (the kernel
# where it has none).
NAMES = [
    "test_elementwise_1d",
    "test_closure_n4",
    "test_pytree_bf16_int",  # max and min: integer and bf16 leaves
    "test_n48_max",
    "test_n3_fallback",
    "test_n816_bf16",
    "test_n816_i32",
    "test_f64",
]
# Every case with two reductions, every reduction with four cases.
PAIRS = [
    (name, reduction)
    for i, name in enumerate(NAMES)
    for reduction in [
        (("add", "max", "min", "logsumexp")[i % 4], None),
        (("logsumexp", "min", "max", "add")[i % 4], 0),
    ]
]


@pytest.mark.parametrize("name, reduction", PAIRS, ids=[f"{c}-{m}-{a}" for c, (m, a) in PAIRS])
def test_compiled_kernel_matches_oracle(name, reduction):
    case = dataclasses.replace(BY_NAME[name].at(1037), batch_size=256)
    case = dataclasses.replace(case, reduction=plain_pair(*reduction))
    with enable_x64(case.x64):
        args = jax.tree.map(jnp.asarray, case.arrays())
        plan = ajm.explain(case.bind(args[0]), args[1], 256, **case.reduction_kwargs)
        f = jax.jit(case.program())
        text = f.lower(*args).as_text()
        reason = LOWERING.get(name, (None, None))[PLATFORM == "tpu"]
        if reason is not None:
            assert plan.engine == "scan" and reason in plan.reason, str(plan)
        else:
            assert plan.engine == "pallas", str(plan)
        assert contains_kernel(text, PLATFORM) == (plan.engine == "pallas")
        assert_device_close(f(*args), case.program(plain=True)(*args))


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
