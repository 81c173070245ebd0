"""The device the fused kernel is planned and built for, the way users call it:
inside ``jax.jit``, under ``jax.set_mesh`` or an abstract mesh, one jitted function
for two device kinds, and a jax without Pallas Triton.

The compiles themselves need the CUDA plugin or libtpu: ``make test-accel`` runs
them (bench/accel/compile_targets.py: every case first thing in a fresh process,
inside ``jit``, and one jitted function compiled for two device kinds). Here, on
CPU, the same paths are taken with abstract devices (lowered, not compiled)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TraceCounter, contains_kernel, needs_abstract_devices, needs_kernel

import adv_jax_math as ajm
from adv_jax_math.core.targets import abstract_mesh, concrete_context_mesh
from adv_jax_math.kernels.fused_reduce.fused import check

probe_module = importlib.import_module("adv_jax_math.kernels.fused_reduce.probe")

pytestmark = [needs_kernel, needs_abstract_devices]

S = jax.ShapeDtypeStruct
SUM_ALL = dict(reduction=jnp.add, chunk_reduction=jnp.sum)
PROBES = np.linspace(-1, 1, 128 * 4, dtype=np.float32).reshape(128, 4)
X4 = S((20001, 4), jnp.float32)
TRITON = "jax.experimental.pallas.triton"
AMPERE = "NVIDIA A100-SXM4-80GB"  # Triton only: Hopper has Mosaic GPU without it


def potential(p):
    """(n, 4) N-body: the TPU block depends on the generation's VMEM (v5e 608, v4 80)."""
    d = PROBES[None, :, :] - p[:, None, :]
    return jnp.sum(1.0 / jnp.sqrt(jnp.sum(d * d, axis=-1) + 1e-3), axis=-1)


def batch_potential(x):
    return ajm.batch_map(potential, x, 2048, **SUM_ALL)


def lowered(platform, kind, f, *args):
    with jax.sharding.use_abstract_mesh(abstract_mesh(platform, kind)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


# ---------------------------------------------------------------------------- #
# The mesh jit compiles for, seen from inside jit
# ---------------------------------------------------------------------------- #


@pytest.mark.parametrize("devices", [1, None], ids=["one device", "all devices"])
def test_context_mesh_is_seen_inside_jit(devices):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("x",))
    seen = []

    def f(x):
        seen.append(concrete_context_mesh())
        return x

    with jax.set_mesh(mesh):
        assert concrete_context_mesh() == (mesh, False)
        jax.jit(f).trace(np.zeros(4, np.float32))
    ((inside, tracing),) = seen
    assert tracing and inside is not None
    assert list(inside.devices.flat) == list(mesh.devices.flat)


def test_no_context_mesh_without_set_mesh():
    seen = []
    jax.jit(lambda x: seen.append(concrete_context_mesh()) or x).trace(np.zeros(4, np.float32))
    assert concrete_context_mesh() == (None, False)
    assert seen == [(None, True)]
    with jax.sharding.use_abstract_mesh(abstract_mesh("tpu")):  # abstract only: no devices
        jax.jit(lambda x: seen.append(concrete_context_mesh()) or x).trace(np.zeros(4, np.float32))
    assert seen[-1] == (None, True)


@pytest.mark.parametrize(
    "platform, kind", [("tpu", "TPU v4"), ("cuda", "NVIDIA H100 80GB HBM3")], ids=["v4", "h100"]
)
def test_probe_inside_jit_agrees_with_explain_outside(platform, kind):
    # The probe runs first inside the user's trace (a fresh verdict), then explain()
    # outside it must find the same verdict.
    probe_module._PROBES.clear()
    plans = []

    def f(x):
        plans.append(ajm.explain(potential, x, 2048, **SUM_ALL))
        return batch_potential(x)

    text = lowered(platform, kind, f, X4)
    with jax.sharding.use_abstract_mesh(abstract_mesh(platform, kind)):
        outside = ajm.explain(potential, X4, 2048, **SUM_ALL)
    (inside,) = plans
    assert inside.engine == outside.engine == "pallas", str(inside)
    assert inside.reason == outside.reason and f"lowered for {kind}" in inside.reason
    assert contains_kernel(text, platform)


# ---------------------------------------------------------------------------- #
# One jitted function, two device kinds: JAX's trace cache key holds the kind
# ---------------------------------------------------------------------------- #


def test_jit_cache_key_holds_the_abstract_device_kind():
    # What the library relies on: the device kind planned for comes from the active
    # mesh (or the process's devices), and JAX keys its caches on the mesh, device
    # kind included. Should a jax stop doing so, plans would leak between targets.
    kinds = []
    f = jax.jit(lambda x: kinds.append(jax.sharding.get_abstract_mesh().abstract_device) or x)
    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"):
        with jax.sharding.use_abstract_mesh(abstract_mesh("cuda", kind)):
            f.trace(np.zeros(4, np.float32))
    assert [d.device_kind for d in kinds] == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]


def test_one_jitted_function_planned_per_device_kind():
    fun = TraceCounter(potential)
    blocks = []

    def f(x):
        blocks.append(ajm.explain(fun, x, 2048, **SUM_ALL).block_rows)
        return ajm.batch_map(fun, x, 2048, **SUM_ALL)

    jf = jax.jit(f)
    texts: dict[str, list[str]] = {}
    for kind in ("TPU v5 lite", "TPU v4", "TPU v5 lite"):
        with jax.sharding.use_abstract_mesh(abstract_mesh("tpu", kind)):
            texts.setdefault(kind, []).append(
                jf.trace(X4).lower(lowering_platforms=("tpu",)).as_text()
            )
    assert blocks == [608, 80], blocks  # v4 traced apart; v5e again: JAX's cache
    assert texts["TPU v5 lite"][0] == texts["TPU v5 lite"][1]
    assert texts["TPU v5 lite"][0] != texts["TPU v4"][0]
    assert all(contains_kernel(t, "tpu") for ts in texts.values() for t in ts)


@pytest.mark.skipif(
    not hasattr(jax, "make_user_context"), reason="jax.make_user_context is new in jax 0.12"
)
def test_one_jitted_function_per_config_block():
    fun = TraceCounter(jnp.sin)
    jf = jax.jit(lambda x: ajm.batch_map(fun, x, 64, **SUM_ALL))
    x = np.ones(1000, np.float32)
    with ajm.config(backend="scan"):
        scan_text = str(jf.trace(x).jaxpr)
    with ajm.config(backend="interpret"):
        interpret_text = str(jf.trace(x).jaxpr)
    assert not contains_kernel(scan_text, "cpu")
    assert contains_kernel(interpret_text, "cpu")


# ---------------------------------------------------------------------------- #
# A jax without Pallas Triton
# ---------------------------------------------------------------------------- #


@pytest.fixture
def no_pallas_triton(monkeypatch):
    """``import jax.experimental.pallas.triton`` fails, as in a jax that dropped it."""
    monkeypatch.setitem(sys.modules, TRITON, None)
    with pytest.raises(ImportError):
        importlib.import_module(TRITON)


def test_gpu_kernel_declines_without_pallas_triton(no_pallas_triton):
    fun = lambda x: jnp.sin(x) * x
    xs = S((6001, 8), jnp.float32)
    with jax.sharding.use_abstract_mesh(abstract_mesh("cuda", AMPERE)):
        plan = ajm.explain(fun, xs, 300, **SUM_ALL)
    assert plan.engine == "scan", str(plan)
    assert "Pallas Triton is missing" in plan.reason and TRITON in plan.reason, plan.reason
    reduction = ajm.explain(fun, xs, 300, **SUM_ALL).reduction
    assert reduction is not None
    with jax.sharding.use_abstract_mesh(abstract_mesh("cuda", AMPERE)):
        verdict = check(reduction.prepare(fun), xs, reduction, platform="cuda", max_rows=300)
    assert verdict.problem is not None and TRITON in verdict.problem
    # the scan engine's program is lowered for the GPU instead
    text = lowered("cuda", AMPERE, lambda x: ajm.batch_map(fun, x, 300, **SUM_ALL), xs)
    assert not contains_kernel(text, "cuda")
    # TPU and interpret mode do not need it
    with jax.sharding.use_abstract_mesh(abstract_mesh("tpu")):
        assert ajm.explain(fun, xs, 300, **SUM_ALL).engine == "pallas"
    x = jnp.linspace(-1, 1, 37 * 8).reshape(37, 8)
    with ajm.config(backend="interpret"):
        np.testing.assert_allclose(
            ajm.batch_map(fun, x, 8, **SUM_ALL), jnp.sum(fun(x)), rtol=2e-5, atol=2e-5
        )
    np.testing.assert_allclose(
        ajm.batch_map(fun, x, 8, **SUM_ALL), jnp.sum(fun(x)), rtol=2e-5, atol=2e-5
    )


def test_forced_pallas_without_pallas_triton_names_it(no_pallas_triton):
    f = lambda x: ajm.batch_map(jnp.sin, x, 256, **SUM_ALL)
    with (
        ajm.config(backend="pallas"),
        jax.sharding.use_abstract_mesh(abstract_mesh("cuda", AMPERE)),
        pytest.raises(NotImplementedError, match="Pallas Triton is missing"),
    ):
        jax.jit(f).trace(np.ones((4096, 4), np.float32))


def test_importing_the_library_does_not_import_pallas_triton():
    # A fresh interpreter where the module cannot be imported at all.
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules[{TRITON!r}] = None
        import jax, jax.numpy as jnp
        import adv_jax_math as ajm
        assert sys.modules[{TRITON!r}] is None
        x = jnp.ones((100, 4))
        print(float(ajm.batch_map(jnp.sin, x, 8, reduction=jnp.add, chunk_reduction=jnp.sum)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == pytest.approx(400 * np.sin(1.0), rel=1e-5)
