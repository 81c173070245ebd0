"""Backend selection on this machine through the public API: ``config``, the
environment variables, ``explain``, and which engine actually ran (the fused
kernel's name in the traced program, or not). Results per engine are checked by
the matrix in test_engines.py; lowering for GPUs and TPUs in test_lowering.py."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close, contains_kernel, needs_kernel

import adv_jax_math as ajm

# CPU dispatch: on a GPU/TPU host "auto" picks the compiled kernel instead.
pytestmark = [
    needs_kernel,
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="tests CPU dispatch"),
]

X = jnp.linspace(-1, 1, 37 * 4).reshape(37, 4)
W = jnp.array([0.5, -1.0, 2.0, 0.25])
SUM = dict(reduction=jnp.add, chunk_reduction=jnp.sum)


def fun(x):
    return jnp.tanh(x * W)


def jaxpr_text(f, *args):
    return str(jax.make_jaxpr(f)(*args))


def test_auto_on_cpu_uses_scan_and_says_why():
    plan = ajm.explain(fun, X, 8, **SUM)
    assert plan.engine == "scan" and "interpret mode" in plan.reason, str(plan)
    assert [name for name, _ in plan.rejected] == ["pallas", "interpret", "pairwise"]
    assert dict(plan.rejected)["pairwise"].startswith("not shown to be a pairwise reduction")
    assert not contains_kernel(jaxpr_text(lambda x: ajm.batch_map(fun, x, 8, **SUM), X), "cpu")


@pytest.mark.parametrize(
    "reduction, chunk_reduction",
    [
        (jnp.add, jnp.sum),
        (jnp.maximum, lambda y: y.max(0)),
        (jnp.logaddexp, jax.nn.logsumexp),
    ],
    ids=["add", "max", "logsumexp"],
)
def test_interpret_backend_runs_the_kernel_in_values_and_gradients(reduction, chunk_reduction):
    kw = dict(reduction=reduction, chunk_reduction=chunk_reduction)
    f = lambda w, x: ajm.batch_map(lambda x: jnp.tanh(x * w), x, 8, **kw)
    with ajm.config(backend="interpret"):
        plan = ajm.explain(fun, X, 8, **kw)
        value = jaxpr_text(f, W, X)
        grad = jaxpr_text(jax.value_and_grad(lambda w, x: jnp.sum(f(w, x))), W, X)
    assert plan.engine == "interpret" and "interpret" in plan.reason, str(plan)
    assert plan.block_rows >= 1 and plan.block_rows <= 8
    assert contains_kernel(value, "cpu") and contains_kernel(grad, "cpu")


@pytest.mark.parametrize("kw", [{}, dict(reduction=jnp.multiply, chunk_reduction=jnp.prod)])
def test_interpret_backend_leaves_maps_and_generic_reductions_on_scan(kw):
    with ajm.config(backend="interpret"):
        plan = ajm.explain(fun, X, 8, **kw)
    assert plan.engine == "scan" and "not a recognized monoid" in plan.reason, str(plan)
    assert not plan.error


def test_pallas_backend_on_cpu_raises_not_implemented():
    with ajm.config(backend="pallas"):
        plan = ajm.explain(fun, X, 8, **SUM)
        assert "interpret" in plan.error  # explain reports, it does not raise
        with pytest.raises(NotImplementedError, match="backend='pallas' was requested"):
            ajm.batch_map(fun, X, 8, **SUM)


def test_environment_variables(monkeypatch):
    monkeypatch.setenv("ADV_JAX_MATH_BACKEND", "interpret")
    assert ajm.explain(fun, X, 8, **SUM).engine == "interpret"
    with ajm.config(backend="scan"):  # a config block wins over the environment
        assert ajm.explain(fun, X, 8, **SUM).engine == "scan"
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


@pytest.mark.skipif(jax.device_count() != 4, reason="needs the 4 virtual CPU devices")
def test_sharded_interpret_runs_a_kernel_per_device():
    kw = dict(reduction=jnp.logaddexp, chunk_reduction=jax.nn.logsumexp, shard=True)
    with ajm.config(backend="interpret"):
        plan = ajm.explain(fun, X, 8, **kw)
        out = ajm.batch_map(fun, X, 8, **kw)
        text = jaxpr_text(lambda x: ajm.batch_map(fun, x, 8, **kw), X)
    assert plan.engine == "shard" and plan.shard.local.engine == "interpret", str(plan)
    assert plan.shard.remainder.engine == "interpret", str(plan)
    assert contains_kernel(text, "cpu")
    assert_tree_close(out, jax.nn.logsumexp(fun(X)))
