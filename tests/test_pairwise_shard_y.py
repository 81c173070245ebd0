"""``pairwise(..., shard="y")``: the y rows spread over the devices, each device
reducing every x row over its own y rows, the monoid states merged across devices.

Values and gradients against the dense plain-JAX oracle for every monoid (a
softmax-weighted sum: each x row its own reduction, vmapped), on the 4 virtual CPU
devices and on Explicit and Auto meshes (DESIGN.md §9), with ``y`` placed split or
replicated.
"""

import contextlib

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_pairwise import CASES, dense, inputs

import adv_jax_math as ajm

pytestmark = pytest.mark.skipif(jax.device_count() != 4, reason="needs the 4 virtual CPU devices")

NAMES = list(CASES)


@pytest.mark.parametrize("tiles", ["auto", (5, 7)])
@pytest.mark.parametrize("name", NAMES)
def test_values_match_dense_oracle(name, tiles):
    reduction, f, want = CASES[name]
    x, y = inputs()  # 37 x 53 rows: 14 y rows a device, chunks ragged; ties across them
    plan = ajm.explain_pairwise(f, x, y, reduction, tiles=tiles, shard="y")
    got = jax.jit(lambda x, y: ajm.pairwise(f, x, y, reduction, tiles=tiles, shard="y"))(x, y)
    assert plan.engine == "pairwise scan (y over devices)", str(plan)
    assert plan.tiles == (37, 14 if tiles == "auto" else 7), str(plan)
    assert_tree_close(got, want(dense(f, x, y)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "name", ["logsumexp", "min", "k_nearest", "var", "weighted_logsumexp", "softmax_two_heads"]
)
def test_gradients_match_dense_oracle(name):
    # w.r.t. x, y and a closed-over scale
    reduction, f, want = CASES[name]
    x, y = inputs()
    scaled = lambda s: lambda a, b: jax.tree.map(lambda v: v * s, f(a, b))
    floats = lambda out: sum(
        jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(out) if v.dtype.kind == "f"
    )
    ours = lambda s, x, y: floats(ajm.pairwise(scaled(s), x, y, reduction, shard="y"))
    oracle = lambda s, x, y: floats(want(dense(scaled(s), x, y)))
    got = jax.jit(jax.value_and_grad(ours, (0, 1, 2)))(0.7, x, y)
    assert_tree_close(got, jax.value_and_grad(oracle, (0, 1, 2))(0.7, x, y), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name", ["logsumexp", "softmax_weighted"])
@pytest.mark.parametrize("set_mesh", [False, True], ids=["no_mesh", "set_mesh"])
@pytest.mark.parametrize("spec", [P(), P("x")], ids=["P()", "P(x)"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=lambda t: t.name)
def test_on_meshes(axis_type, spec, set_mesh, name):
    mesh = jax.make_mesh((4,), ("x",), axis_types=(axis_type,))
    reduction, f, want = CASES[name]
    host_x, host_y = inputs()
    host_y = host_y[:52]  # rows split 4 ways
    y = jax.device_put(host_y, NamedSharding(mesh, spec))
    loss = lambda run: lambda x, y: jnp.sum(jnp.sin(run(x, y)))
    # the mesh: the one set, else all devices; passed as mesh= where that may be (Auto)
    given = mesh if axis_type == AxisType.Auto and not set_mesh else None
    ours = lambda x, y: ajm.pairwise(f, x, y, reduction, shard="y", mesh=given)
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        got = jax.jit(jax.value_and_grad(loss(ours), (0, 1)))(host_x, y)
    expect = jax.value_and_grad(loss(lambda x, y: want(dense(f, x, y))), (0, 1))(host_x, host_y)
    assert_tree_close(jax.device_get(got), expect, rtol=2e-5, atol=2e-5)


def test_bad_shard_is_named():
    x, y = inputs()
    with pytest.raises(TypeError, match="shard='z'; pass False, True"):
        ajm.pairwise(*CASES["add"][1:2], x, y, ajm.ADD, shard="z")
