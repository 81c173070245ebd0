"""Backend selection through the public API: config, env var, explain, and which
engine actually ran (the fused kernel's marker in the lowered program, or not)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import adv_jax_math as ajm
from adv_jax_math._pallas import contains_kernel

from conftest import assert_tree_close

X = jnp.linspace(-1, 1, 37 * 4).reshape(37, 4)
W = jnp.array([0.5, -1.0, 2.0, 0.25])
PAIRS = {
    "add": (jnp.add, jnp.sum, jnp.sum),
    "max": (jnp.maximum, jnp.maximum.reduce, lambda y: y.max(0)),
    "logsumexp": (jnp.logaddexp, jax.nn.logsumexp, jax.nn.logsumexp),
}


def fun(x):
    return jnp.tanh(x * W)


def jaxpr_text(f, *args):
    return str(jax.make_jaxpr(f)(*args))


def test_auto_on_cpu_uses_scan_and_says_why():
    plan = ajm.explain(fun, X, 8, reduction=jnp.add, chunk_reduction=jnp.sum)
    assert plan.engine == "scan" and "interpret mode" in plan.reason
    f = lambda x: ajm.batch_map(fun, x, 8, reduction=jnp.add, chunk_reduction=jnp.sum)
    assert not contains_kernel(jaxpr_text(f, X))


@pytest.mark.parametrize("name", list(PAIRS))
def test_interpret_backend_runs_the_kernel(name):
    reduction, chunk_reduction, oracle = PAIRS[name]
    kw = dict(reduction=reduction, chunk_reduction=chunk_reduction)
    with ajm.config(backend="interpret"):
        plan = ajm.explain(fun, X, 8, **kw)
        f = lambda w, x: ajm.batch_map(lambda x: jnp.tanh(x * w), x, 8, **kw)
        out = f(W, X)
        grads = jax.grad(lambda w, x: jnp.sum(f(w, x)), argnums=(0, 1))(W, X)
        text = jaxpr_text(f, W, X)
    assert plan.engine == "interpret" and "interpret" in plan.reason
    assert contains_kernel(text)
    plain = lambda w, x: oracle(jnp.tanh(x * w))
    assert_tree_close(out, plain(W, X))
    expect = jax.grad(lambda w, x: jnp.sum(plain(w, x)), argnums=(0, 1))(W, X)
    assert_tree_close(grads, expect, rtol=1e-5, atol=1e-5)


def test_interpret_backend_leaves_maps_and_generic_reductions_on_scan():
    with ajm.config(backend="interpret"):
        for kw in ({}, dict(reduction=jnp.multiply, chunk_reduction=jnp.prod)):
            plan = ajm.explain(fun, X, 8, **kw)
            assert plan.engine == "scan" and "not a recognized monoid" in plan.reason
            assert not plan.error


def test_pallas_backend_on_cpu_raises_not_implemented():
    with ajm.config(backend="pallas"):
        plan = ajm.explain(fun, X, 8, reduction=jnp.add, chunk_reduction=jnp.sum)
        assert "interpret" in plan.error  # explain reports, it does not raise
        with pytest.raises(NotImplementedError, match="backend='pallas' was requested"):
            ajm.batch_map(fun, X, 8, reduction=jnp.add, chunk_reduction=jnp.sum)


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("ADV_JAX_MATH_BACKEND", "interpret")
    assert ajm.explain(fun, X, 8, reduction=jnp.add, chunk_reduction=jnp.sum).engine == (
        "interpret"
    )
    with ajm.config(backend="scan"):  # a config block wins over the environment
        assert ajm.explain(fun, X, 8, reduction=jnp.add, chunk_reduction=jnp.sum).engine == ("scan")
    monkeypatch.setenv("ADV_JAX_MATH_BACKEND", "cuda")
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        ajm.batch_map(fun, X, 8)
    monkeypatch.setenv("ADV_JAX_MATH_BACKEND", "scan")
    monkeypatch.setenv("ADV_JAX_MATH_REMAT", "maybe")
    with pytest.raises(ValueError, match="ADV_JAX_MATH_REMAT='maybe'"):
        ajm.batch_map(fun, X, 8)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="backend='gpu'"), ajm.config(backend="gpu"):
        pass
    with pytest.raises(TypeError, match="remat=1"), ajm.config(remat=1):
        pass


def test_sharded_interpret_runs_a_kernel_per_device():
    with ajm.config(backend="interpret"):
        kw = dict(reduction=jnp.logaddexp, chunk_reduction=jax.nn.logsumexp, shard=True)
        plan = ajm.explain(fun, X, 8, **kw)
        out = ajm.batch_map(fun, X, 8, **kw)
    assert plan.engine == "interpret" and plan.shard.local.engine == "interpret"
    assert_tree_close(out, jax.nn.logsumexp(fun(X)))


def abstract_mesh(platform):
    kind = {"cuda": "NVIDIA H100 80GB HBM3", "tpu": "TPU v5 lite"}[platform]
    device = AbstractDevice(
        device_kind=kind, num_cores=None if platform == "cuda" else 1, platform=platform
    )
    return AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)


def lower_for(platform, f, *args):
    with use_abstract_mesh(abstract_mesh(platform)), warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the Triton warning stays hidden
        plan = f(*args, run=ajm.explain)
        text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return plan, text


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_auto_picks_the_kernel_when_it_lowers(platform):
    def f(x, run=ajm.batch_map):
        return run(fun, x, 256, reduction=jnp.add, chunk_reduction=jnp.sum)

    plan, text = lower_for(platform, f, jnp.ones((4096, 4)))
    assert plan.engine == "pallas" and plan.platform == platform, str(plan)
    assert contains_kernel(text, platform)


def test_triton_rejects_three_wide_rows_and_scan_runs():
    def f(x, run=ajm.batch_map):
        return run(jnp.cos, x, 256, reduction=jnp.add, chunk_reduction=jnp.sum)

    plan, text = lower_for("cuda", f, jnp.ones((4096, 3)))
    assert plan.engine == "scan" and "power-of-two" in plan.reason, str(plan)
    assert not contains_kernel(text, "cuda")


def test_tpu_rejects_float64_and_scan_runs(x64):
    def f(x, run=ajm.batch_map):
        return run(jnp.cos, x, 256, reduction=jnp.add, chunk_reduction=jnp.sum)

    plan, text = lower_for("tpu", f, jnp.ones((4096, 4), jnp.float64))
    assert plan.engine == "scan" and "64-bit" in plan.reason, str(plan)
    assert not contains_kernel(text, "tpu")


def test_forced_pallas_on_abstract_gpu_raises_for_unlowerable_fun():
    def f(x, run=ajm.batch_map):
        return run(jnp.cos, x, 256, reduction=jnp.add, chunk_reduction=jnp.sum)

    with (
        ajm.config(backend="pallas"),
        use_abstract_mesh(abstract_mesh("cuda")),
        pytest.raises(NotImplementedError, match="power-of-two"),
    ):
        jax.jit(f).trace(np.ones((4096, 3), np.float32))
