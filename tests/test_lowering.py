"""Lowering for accelerators that are not present: an abstract NVIDIA H100 (Pallas
Triton) and an abstract TPU v5 lite (Pallas Mosaic), through ``batch_map`` and
``explain`` under ``jax.sharding.use_abstract_mesh``. The kernel's custom call is
in the lowered program exactly when ``explain(...).engine == "pallas"``; otherwise
the plan says why, and the scan engine's program is lowered instead."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.map_reduce import BY_NAME, LOWERING
from cases.map_reduce import field_of_sources as nbody
from helpers import (
    TraceCounter,
    contains_kernel,
    enable_x64,
    needs_abstract_devices,
    needs_kernel,
    on_abstract_device,
)

import adv_jax_math as ajm
from adv_jax_math.kernels.fused_reduce.backward import BACKWARD_NAME

pytestmark = [needs_kernel, needs_abstract_devices]

S = jax.ShapeDtypeStruct
W4 = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
TARGETS = [pytest.param("cuda", id="H100"), pytest.param("tpu", id="TPUv5e-mosaic")]
OTHER = {"cuda": "tpu", "tpu": "cuda"}

SUM0 = dict(reduction=jnp.add, chunk_reduction=lambda t: t.sum(axis=0))  # DESC's spelling
SUM_ALL = dict(reduction=jnp.add, chunk_reduction=jnp.sum)
# bench/cases/map_reduce.py's LOWERING: (GPU, TPU) reasons, None for the kernel
CASES = {name: (BY_NAME[name], reasons) for name, reasons in LOWERING.items()}


# The cases are small: the roofline model would often send them to the scan engine
# (test_roofline_model_vetoes_a_kernel_that_would_lose); here the kernel's lowering
# is under test, so the model's veto is off.
NO_VETO = dict(roofline=False)


def lower(platform, f, *args):
    """``f`` lowered for ``platform``; fails if the Pallas Triton deprecation warning
    reaches the user."""
    with (
        on_abstract_device(platform),
        ajm.config(**NO_VETO),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert not [w for w in caught if "Triton backend is deprecated" in str(w.message)]
    return text


def explain_on(platform, *args, **kw):
    with on_abstract_device(platform), ajm.config(**NO_VETO):
        return ajm.explain(*args, **kw)


# explain() builds its 22 forward and 57 backward Mosaic GPU kernels (80 s of CI's
# make test); test_mosaic_gpu lowers element groups for Hopper in make test.
SLOW = {("test_nbody_field_5000", "cuda")}


@pytest.mark.parametrize(
    ("name", "platform"),
    [
        pytest.param(
            n,
            p.values[0],
            id=f"{n}-{p.id}",
            marks=pytest.mark.slow if (n, p.values[0]) in SLOW else (),
        )
        for n in CASES
        for p in TARGETS
    ],
)
def test_kernel_lowered_exactly_when_planned(name, platform):
    case, reasons = CASES[name]
    fun, xs, batch_size, kw = case.fun, case.inputs, case.batch_size, case.reduction_kwargs
    reason = reasons[platform == "tpu"]
    with enable_x64(case.x64):
        plan = explain_on(platform, fun, xs, batch_size, **kw)
        text = lower(platform, lambda x: ajm.batch_map(fun, x, batch_size, **kw), xs)
    assert plan.platform == platform, str(plan)
    if reason is None:
        assert plan.engine == "pallas", str(plan)
        assert 1 <= plan.block_rows <= batch_size, str(plan)
    else:
        assert plan.engine == "scan" and reason in plan.reason, str(plan)
    assert contains_kernel(text, platform) == (plan.engine == "pallas")
    assert not contains_kernel(text, OTHER[platform])


@pytest.mark.parametrize("platform", TARGETS)
def test_value_and_gradient_lower_on_abstract_devices(platform):
    # In jax.grad alone the forward kernel of an add is dead code: use value_and_grad.
    def loss(w, x):
        return jnp.sum(ajm.batch_map(lambda v: v * w, x, 1024, reduction=ajm.LOGSUMEXP))

    xs = S((4096, 4), jnp.float32)
    plan = explain_on(platform, lambda v: v * W4, xs, 1024, reduction=ajm.LOGSUMEXP)
    assert plan.engine == "pallas", str(plan)
    assert contains_kernel(lower(platform, jax.value_and_grad(loss), W4, xs), platform)


def test_forced_pallas_raises_for_a_fun_it_cannot_lower():
    def f(x):  # Mosaic GPU lowers no floor, Triton no (4096, 3) block
        fun = lambda v: jnp.floor(jnp.cos(v) * 4)
        return ajm.batch_map(fun, x, 256, reduction=jnp.add, chunk_reduction=jnp.sum)

    with (
        ajm.config(backend="pallas"),
        on_abstract_device("cuda"),
        pytest.raises(NotImplementedError, match="power-of-two"),
    ):
        jax.jit(f).trace(np.ones((4096, 3), np.float32))


def test_fun_traced_once_per_block_shape():
    # make_plan traces fun on a chunk and the engines reuse that trace; the kernel's
    # static check may trace it again on a small probe block, but no shape twice.
    fun = TraceCounter(jnp.exp)
    xs = S((37 * 1024, 4), jnp.float32)
    f = lambda x: ajm.batch_map(fun, x, 1024, **SUM_ALL)
    assert explain_on("cuda", jnp.exp, xs, 1024, **SUM_ALL).engine == "pallas"
    lower("cuda", f, xs)
    assert len(fun.shapes) == len(set(fun.shapes)), fun.shapes


def test_backward_kernel_on_a_block_of_its_own_where_its_vjp_needs_more_vmem():
    # On TPU the VJP of nbody holds several (Bk, 128, 4) residuals at once: the
    # backward kernel runs on fewer rows than the forward's block (fun traced once
    # more, on that block), so value_and_grad keeps both kernels and no while loop.
    xs = {"pos": S((20001, 4), jnp.float32), "m": S((20001,), jnp.float32)}
    plan = explain_on("tpu", nbody, xs, 2048, **SUM0)
    assert plan.engine == "pallas", str(plan)
    found = re.search(r"backward kernel, blocks of (\d+) rows", plan.backward)
    assert found and int(found.group(1)) < plan.block_rows, str(plan)
    fun = TraceCounter(nbody)
    loss = lambda xs: jnp.sum(ajm.batch_map(fun, xs, 2048, **SUM0))
    text = lower("tpu", jax.value_and_grad(loss), xs)
    assert BACKWARD_NAME in text and "stablehlo.while" not in text
    assert (int(found.group(1)),) in fun.shapes  # m's rows
    assert len(fun.shapes) == len(set(fun.shapes)), fun.shapes
