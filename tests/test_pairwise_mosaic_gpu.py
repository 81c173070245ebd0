"""The pairwise tile kernel on Pallas Mosaic GPU (``kernels/pairwise_mosaic_gpu.py``):
every case of ``bench/cases/pairwise.py`` it takes, run in Mosaic GPU's interpreter on
CPU (``backend="interpret"``, ``gpu_backend="mosaic_gpu"``) against the dense plain-JAX
oracle, values and gradients, with ragged last tiles of x and y rows; an ``f`` it
declines (a primitive it lacks) with the reason; and the backend chain lowered for
abstract H100 and A100 devices (Mosaic GPU, then Triton); on an Auto mesh."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close, needs_abstract_devices, normal
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_pairwise import CASES, dense

import adv_jax_math as ajm
from adv_jax_math.core import targets
from adv_jax_math.core.targets import abstract_mesh

H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
N, M, D = 150, 200, 3  # 3 x tiles of 64 rows (the last 22 rows), 4 y tiles (the last 8)
TAKEN = [
    "add",
    "vector_add",
    "max",
    "min",
    "logsumexp",
    "weighted_logsumexp",
    "argmin",
    "argmax",
    "min_argmin",
    "max_argmax",
    "mean",
    "var",
    pytest.param("top_k", marks=pytest.mark.slow),  # (k_nearest: the same fold, by default)
    "k_nearest",
    "pytree",
    "softmax_weighted",  # (each score with each value: a fold per pair of them)
    "softmax_two_heads",
]
MOSAIC = dict(backend="interpret", gpu_backend="mosaic_gpu")


def inputs():
    x, y = normal(0, (N, D)), normal(1, (M, D))
    return x, y.at[64].set(y[63])  # a tie across the border of the first two y tiles


def loss(run):
    leaves = lambda out: [v for v in jax.tree.leaves(out) if v.dtype.kind == "f"]
    return lambda x, y: sum(jnp.sum(jnp.sin(v)) for v in leaves(run(x, y)))


def planned_and_checked(name):
    """The plan of case ``name`` in Mosaic GPU's interpreter; its values checked against
    the dense oracle."""
    reduction, f, want = CASES[name]
    x, y = inputs()
    with ajm.config(**MOSAIC):
        plan = ajm.explain_pairwise(f, x, y, reduction)
        got = ajm.pairwise(f, x, y, reduction)
    assert_tree_close(got, want(dense(f, x, y)), rtol=2e-5, atol=2e-5)
    return plan


@pytest.mark.parametrize("name", TAKEN)
def test_values_match_the_dense_oracle(name):
    plan = planned_and_checked(name)
    assert "mosaic_gpu tile kernel, interpreted" in plan.reason and plan.tiles[1] == 64, plan


# (a top-k's: about 15 s in the interpreter, a variance's and a weighted logsumexp's: in
# make test-slow)
GRADIENTS = ["add", "logsumexp", "min_argmin", "softmax_weighted"]
SLOW_GRADIENTS = ["weighted_logsumexp", "var", "k_nearest"]


@pytest.mark.parametrize(
    "name", [*GRADIENTS, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_GRADIENTS)]
)
def test_gradients_match_the_dense_oracle(name):
    # the reverse pass's pairwise sums (dx over x tiles, dy over y tiles) are the same
    # Mosaic GPU tile kernel
    reduction, f, want = CASES[name]
    x, y = inputs()
    with ajm.config(**MOSAIC):
        got = jax.value_and_grad(loss(lambda x, y: ajm.pairwise(f, x, y, reduction)), (0, 1))(x, y)
    expect = jax.value_and_grad(loss(lambda x, y: want(dense(f, x, y))), (0, 1))(x, y)
    assert_tree_close(got, expect, rtol=2e-4, atol=2e-4)


def test_a_primitive_mosaic_gpu_lacks_is_named():
    reduction, f, want = CASES["add"]
    floored = lambda a, b: jnp.floor(8 * f(a, b))  # (Mosaic GPU has no floor)
    x, y = inputs()
    with ajm.config(**MOSAIC):
        plan = ajm.explain_pairwise(floored, x, y, reduction)
        got = ajm.pairwise(floored, x, y, reduction)
    assert "Mosaic GPU has no lowering for floor (in f)" in str(plan), plan
    assert_tree_close(got, want(dense(floored, x, y)), rtol=2e-5, atol=2e-5)


def test_tiles_follow_the_layout_and_the_features():
    reduction, f, want = CASES["add"]
    x, y = inputs()
    with ajm.config(**MOSAIC):
        plan = ajm.explain_pairwise(f, x, y, reduction, tiles=(32, 32))
        assert "on Mosaic GPU bj is a multiple of 64" in plan.reason, plan
        # x's features and the states stay in registers across the loop over y tiles:
        # fewer x rows a tile as they grow (16 features, a sum: 16; 3, a top-10: 16)
        wide = [normal(2, (70, 16)), normal(3, (90, 16))]
        assert ajm.explain_pairwise(f, *wide, reduction).tiles == (16, 64)
        assert ajm.explain_pairwise(f, x, y, ajm.top_k(10)).tiles == (16, 64)
        assert ajm.explain_pairwise(f, x, y, reduction).tiles == (64, 64)
        got = ajm.pairwise(f, *wide, reduction, tiles=(24, 128))
    assert_tree_close(got, want(dense(f, *wide)), rtol=2e-5, atol=2e-5)


# -- the backend chain, lowered for abstract GPUs ---------------------------------------


def lowered_on(kind, f, reduction, x, y):
    with jax.sharding.use_abstract_mesh(abstract_mesh("cuda", kind)):
        plan = ajm.explain_pairwise(f, x, y, reduction)
        grad = jax.jit(jax.value_and_grad(loss(lambda x, y: ajm.pairwise(f, x, y, reduction))))
        return plan, grad.trace(x, y).lower(lowering_platforms=("cuda",)).as_text()


X = jax.ShapeDtypeStruct((100003, 3), jnp.float32)
Y = jax.ShapeDtypeStruct((200003, 3), jnp.float32)


@needs_abstract_devices
def test_hopper_takes_mosaic_gpu_forward_and_backward():
    reduction, f, _ = CASES["logsumexp"]
    plan, text = lowered_on(H100, f, reduction, X, Y)
    assert plan.engine == "pairwise kernel (mosaic_gpu)", plan
    assert "mosaic_gpu" in text and "triton" not in text


@needs_abstract_devices
def test_hopper_falls_back_to_triton_with_the_reason_and_ampere_keeps_triton():
    reduction, f, _ = CASES["add"]
    floored = lambda a, b: jnp.floor(8 * f(a, b))
    plan, text = lowered_on(H100, floored, reduction, X, Y)
    assert plan.engine == "pairwise kernel (gpu)", plan
    assert "Pallas Mosaic GPU not used: the tile kernel: Mosaic GPU has no" in str(plan), plan
    reduction, f, _ = CASES["add"]
    plan, text = lowered_on(A100, f, reduction, X, Y)
    assert plan.engine == "pairwise kernel (gpu)" and "compute capability 9.0" in str(plan)
    assert "triton" in text


@needs_abstract_devices
@pytest.mark.parametrize("d", [64, 128])
def test_wide_squared_distances_take_triton_matmul_tiles_on_hopper(d):
    # k-NN at D = 128 took Mosaic GPU's tile kernel, its features unrolled, and its
    # value_and_grad failed to compile for H100 (396 KB of shared memory); the matmul
    # tiles (Triton's) take squared distances over 64 features and more, as on A100
    sqdist = lambda a, b: jnp.sum((a - b) ** 2)
    x, y = (jax.ShapeDtypeStruct((n, d), jnp.float32) for n in (8191, 16411))
    plan, text = lowered_on(H100, sqdist, ajm.top_k(8, smallest=True), x, y)
    assert plan.engine == "pairwise kernel (matmul, gpu)", plan
    why = f"Pallas Mosaic GPU not used: f's squared distances over {d} features: a matmul"
    assert why in str(plan), plan
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"__gpu$xla.gpu.triton"}
    # a top-k's Triton matmul tiles: 16 x 32 (64 x 64 spilled 24 KB on H100 at D = 128);
    # wide squared distances without one: 16 x 64 (Sinkhorn's reverse kernels spilled)
    assert plan.tiles == (16, 32), plan
    with jax.sharding.use_abstract_mesh(abstract_mesh("cuda", H100)):
        lse = ajm.explain_pairwise(sqdist, x, y, ajm.LOGSUMEXP)
    assert lse.engine == "pairwise kernel (matmul, gpu)" and lse.tiles == (16, 64), lse
    attention = lambda q, kv: (jnp.dot(q, kv[0]), kv[1])  # neither: 64 x 64
    with jax.sharding.use_abstract_mesh(abstract_mesh("cuda", H100)):
        plan = ajm.explain_pairwise(attention, x, (y, y), ajm.SOFTMAX_WEIGHTED)
    assert plan.engine == "pairwise kernel (matmul, gpu)" and plan.tiles == (64, 64), plan


@needs_abstract_devices
def test_without_pallas_triton_hopper_still_runs_pairs_and_ampere_falls_back(monkeypatch):
    def gone():
        raise ImportError("No module named 'jax.experimental.pallas.triton'")

    monkeypatch.setattr(targets, "pallas_triton", gone)
    reduction, f, _ = CASES["min_argmin"]
    plan, text = lowered_on(H100, f, reduction, X, Y)
    assert plan.engine == "pairwise kernel (mosaic_gpu)" and "triton" not in text, plan
    plan = lowered_on(A100, f, reduction, X, Y)[0]
    assert not plan.engine.startswith("pairwise kernel"), plan  # XLA's loops
    assert "Pallas Triton is missing from this jax" in str(plan), plan


# -- on meshes (DESIGN.md §9) --------------------------------------------------------


# Mosaic GPU's interpreter (jax 0.12) cannot run a kernel under shard_map over several
# CPU devices ("Barrier remains allocated", DESIGN.md §10): inputs on an Explicit mesh
# (split or replicated) and shard=True fail there, and break the interpreter for the
# rest of the process; compiled for a GPU they are ordinary kernels. On an Auto mesh:
@pytest.mark.skipif(jax.device_count() != 4, reason="needs the 4 virtual CPU devices")
def test_on_an_auto_mesh_values_and_gradients_match():
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    host_x, host_y = normal(4, (72, D)), normal(5, (132, D))
    x, y = (jax.device_put(a, NamedSharding(mesh, P())) for a in (host_x, host_y))
    reduction, f, want = CASES["logsumexp"]
    ours = lambda x, y: ajm.pairwise(f, x, y, reduction)
    with ajm.config(**MOSAIC):
        assert "mosaic_gpu tile kernel" in ajm.explain_pairwise(f, x, y, reduction).reason
        got = jax.jit(jax.value_and_grad(loss(ours), (0, 1)))(x, y)
    expect = jax.value_and_grad(loss(lambda x, y: want(dense(f, x, y))), (0, 1))(host_x, host_y)
    assert_tree_close(jax.device_get(got), expect, rtol=2e-4, atol=2e-4)
