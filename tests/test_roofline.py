"""The roofline model (``_roofline``, ``kernels.fused_reduce.model``): its arithmetic,
its fusion count on known programs, and the planner's use of it on an abstract
H100 and TPU v5e: a kernel the model says loses to the scan engine is not picked
(forward or backward), unless forced or ``config(roofline=False)``."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import needs_abstract_devices, needs_kernel, on_abstract_device

import adv_jax_math as ajm
from adv_jax_math.engines import fused as fused_engine
from adv_jax_math.plan import roofline as rl

S = jax.ShapeDtypeStruct
H100 = rl.DEVICES["NVIDIA H100 80GB HBM3"]
W = jnp.linspace(-1, 1, 16 * 32, dtype=jnp.float32).reshape(16, 32)


def test_cost_arithmetic():
    c = rl.Cost(bytes=3.35e9, flops=0, launches=10, parallel=0.5)
    assert c.seconds(H100) == pytest.approx(2e-3 + 10 * H100.launch)  # 1 ms of HBM at 50%
    flop_bound = rl.Cost(bytes=0, flops=H100.peak, launches=0)
    assert flop_bound.seconds(H100) == pytest.approx(1.0)
    both = rl.Cost(1e6, 0, 1, 1.0) + rl.Cost(1e6, 0, 2, 0.5)
    assert (both.bytes, both.launches, both.parallel) == (2e6, 3, 0.75)


def test_fusions_of_known_programs():
    # tanh(x @ W).sum(0): the dot's output is materialized, the reduction is another
    # fusion (tanh fuses into it), and one more for what follows.
    jaxpr = jax.make_jaxpr(lambda x: jnp.tanh(x @ W).sum(0))(S((1024, 16), jnp.float32)).jaxpr
    count, moved = rl.fusions(jaxpr)
    assert count == 3
    assert moved == 2 * (1024 * 32 * 4) + 2 * (32 * 4)
    elementwise = jax.make_jaxpr(lambda x: jnp.sin(x) * 2 + 1)(S((8, 4), jnp.float32)).jaxpr
    assert rl.fusions(elementwise) == (1, 0)
    inlined = jax.make_jaxpr(jax.jit(lambda x: (x @ W).sum()))(S((8, 16), jnp.float32)).jaxpr
    assert rl.fusions(inlined)[0] == 3  # through the jit call


def test_a_kernel_fills_the_device_by_its_programs():
    kw = dict(inputs=[S((1 << 20, 16), jnp.float32)], consts=[], partials=[S((16,), jnp.float32)])
    few = rl.kernel_pass(H100, grid=33, flops=0, **kw)
    many = rl.kernel_pass(H100, grid=4096, flops=0, **kw)
    assert few.parallel == pytest.approx(0.25) and many.parallel == 1.0
    assert many.bytes == (1 << 20) * 16 * 4 + 2 * 4096 * 16 * 4


def test_unknown_devices_have_no_model():
    assert rl.device("NVIDIA L4") is None and rl.device("TPU v5 lite").cores == 1


@needs_kernel
@needs_abstract_devices
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_roofline_model_vetoes_a_kernel_that_would_lose(platform):
    # One chunk: the scan engine runs fun once (one fusion), the kernel needs two
    # launches (the kernel, the merge of its partials) over few programs.
    small = (jnp.sin, S((4096, 64), jnp.float32), 4096)
    with on_abstract_device(platform):
        plan = ajm.explain(*small, reduction=ajm.ADD)
        assert plan.engine == "scan", str(plan)
        assert "the roofline model says the scan engine is faster" in plan.reason
        with ajm.config(roofline=False):
            assert ajm.explain(*small, reduction=ajm.ADD).engine == "pallas"
        with ajm.config(backend="pallas"):
            forced = ajm.explain(*small, reduction=ajm.ADD)
        assert forced.engine == "pallas" and not forced.error, str(forced)
        # 98 chunks: the scan engine's loop launches ~200 fusions, the kernel two.
        many = ajm.explain(
            lambda t: jnp.tanh(t @ W), S((100003, 16), jnp.float32), 1024, reduction=ajm.ADD
        )
    assert many.engine == "pallas", str(many)
    assert [v.name for v in many.roofline] == ["forward", "backward"], str(many)
    assert all(v.kernel_wins for v in many.roofline)
    assert "backward kernel" in many.backward and "(a roofline model)" in str(many)


@needs_kernel
@needs_abstract_devices
def test_roofline_model_vetoes_the_backward_kernels(monkeypatch):
    real = fused_engine.backward_costs

    def losing(*args):
        v = real(*args)
        return dataclasses.replace(v, kernel=dataclasses.replace(v.kernel, launches=10**6))

    monkeypatch.setattr(fused_engine, "backward_costs", losing)
    with on_abstract_device("cuda"):
        plan = ajm.explain(
            lambda t: jnp.tanh(t @ W), S((100003, 16), jnp.float32), 1024, reduction=ajm.ADD
        )
    assert plan.engine == "pallas", str(plan)  # the forward kernel still wins
    assert plan.backward.startswith("the scan engine's chunks, transposed: the roofline model")


def test_plans_where_jax_roofline_does_not_import(monkeypatch):
    # jax.experimental.roofline imports absl, which jax does not require (the jax 0.10.2
    # of a TPU machine lacked it, and every call the planner modelled failed there)
    monkeypatch.setitem(sys.modules, "jax.experimental.roofline", None)
    monkeypatch.delattr(jax.experimental, "roofline", raising=False)  # imported earlier
    assert rl.flops(lambda v: v * 2, jax.ShapeDtypeStruct((4,), jnp.float32)) == 0.0
    xs = jnp.arange(10.0)
    out = ajm.batch_map(lambda v: v * v, xs, 4, reduction=jnp.add, chunk_reduction=jnp.sum)
    assert float(out) == float(jnp.sum(xs * xs))
