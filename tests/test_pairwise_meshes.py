"""Pairwise reductions on inputs placed on Explicit and Auto meshes (DESIGN.md §9).

``x`` and ``y`` sharded along their rows (``P("x")``) or replicated (``P()``) on a
4-device mesh of either axis type, with and without ``jax.set_mesh``: every engine
(scan, interpret kernel, ``shard=True``) and the nested form give the dense oracle's
value and gradient, and so does the interpret kernel where the tile kernel does not
take ``f`` (a primitive its unrolled evaluator lacks). ``shard=True`` under an
Explicit context mesh and nested calls over rows split on Explicit axes run loops
under ``vmap`` over rows typed on the mesh: their carries start on it
(``_sharding.on_context_mesh``).
"""

import contextlib

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_pairwise import CASES, dense

import adv_jax_math as ajm
from adv_jax_math.pairs import api as pairs_api

N, M = 16, 24

pytestmark = [
    pytest.mark.skipif(jax.device_count() != 4, reason="needs the 4 virtual CPU devices"),
    pytest.mark.skipif(not hasattr(jax.sharding, "reshard"), reason="needs jax >= 0.10"),
]


def _run(engine, f, reduction):
    if engine == "nested":
        inner = lambda y: (
            lambda xi: ajm.batch_vmap(lambda yj: f(xi, yj), batch_size=8, reduction=reduction)(y)
        )
        return lambda x, y: ajm.batch_vmap(inner(y), batch_size=4)(x)
    shard = engine == "shard"
    return lambda x, y: ajm.pairwise(f, x, y, reduction, tiles=(4, 8), shard=shard)


# by default the half of the 2 x 2 x 2 meshes with an even count of (Auto, rows split,
# set_mesh): every pair of the three axes' values; the other half slow (make test-slow)
MESHES = [
    pytest.param(
        axis_type,
        spec,
        set_mesh,
        id=f"{axis_type.name}-{'P(x)' if spec else 'P()'}-{'set_mesh' if set_mesh else 'no_mesh'}",
        marks=[pytest.mark.slow]
        if ((axis_type is AxisType.Auto) + bool(spec) + set_mesh) % 2
        else [],
    )
    for axis_type in (AxisType.Explicit, AxisType.Auto)
    for spec in (P(), P("x"))
    for set_mesh in (False, True)
]


@pytest.mark.parametrize("axis_type, spec, set_mesh", MESHES)
def test_every_engine_on_meshes_matches_dense(axis_type, spec, set_mesh):
    mesh = jax.make_mesh((4,), ("x",), axis_types=(axis_type,))
    host_x = jnp.linspace(-2.0, 2.0, N * 3).reshape(N, 3)
    host_y = jnp.cos(jnp.arange(M * 3.0)).reshape(M, 3)
    x, y = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (host_x, host_y))
    reduction, f, want = CASES["logsumexp"]
    loss = lambda run: lambda x, y: jnp.sum(jnp.sin(run(x, y)))
    expect = jax.value_and_grad(loss(lambda x, y: want(dense(f, x, y))), (0, 1))(host_x, host_y)
    engines = ["scan", "interpret", "shard"]
    # nested vmaps of rows both split on one Explicit axis type a pair's value on it
    # twice, which jax refuses (plain jax.vmap of jax.vmap too): see the test below
    engines += [] if axis_type == AxisType.Explicit and spec == P("x") else ["nested"]
    for engine in engines:
        backend = ajm.config(backend="interpret") if engine == "interpret" else None
        with (
            jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext(),
            backend or contextlib.nullcontext(),
        ):
            got = jax.jit(jax.value_and_grad(loss(_run(engine, f, reduction)), (0, 1)))(x, y)
        assert_tree_close(jax.device_get(got), expect, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("set_mesh", [False, True], ids=["no_mesh", "set_mesh"])
@pytest.mark.parametrize("spec", [P(), P("x")], ids=["P()", "P(x)"])
@pytest.mark.parametrize("kernel", ["interpret", "matmul"])
def test_interpret_kernel_on_an_explicit_mesh(spec, set_mesh, kernel):
    # a cumsum in f: not unrolled, so not tiled; values that depend on the x row
    # neither go to the matmul tile kernel: the interpret kernel (under shard_map with
    # whole arguments) runs forward and in the reverse pass; y's values alone: the
    # matmul tile kernel, interpreted
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    host_x = jnp.linspace(-2.0, 2.0, N * 3).reshape(N, 3)
    host_y = jnp.cos(jnp.arange(M * 3.0)).reshape(M, 3)
    x, y = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (host_x, host_y))
    reduction, _, want = CASES["softmax_weighted"]
    f = lambda a, b: (-jnp.sum((a - b) ** 2), jnp.cumsum(b)[:2])
    if kernel == "interpret":
        f = lambda a, b: (-jnp.sum((a - b) ** 2), jnp.cumsum(b)[:2] * a[0])
    loss = lambda run: lambda x, y: jnp.sum(jnp.sin(run(x, y)))
    ours = lambda x, y: ajm.pairwise(f, x, y, reduction, tiles=(4, 8))
    with (
        ajm.config(backend="interpret"),
        jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext(),
    ):
        said = {"interpret": "the interpret kernel", "matmul": "matmul tile kernel, interpreted"}
        assert said[kernel] in ajm.explain_pairwise(f, x, y, reduction).reason
        got = jax.jit(jax.value_and_grad(loss(ours), (0, 1)))(x, y)
    expect = jax.value_and_grad(loss(lambda x, y: want(dense(f, x, y))), (0, 1))(host_x, host_y)
    assert_tree_close(jax.device_get(got), expect, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("set_mesh", [False, True], ids=["no_mesh", "set_mesh"])
def test_nested_calls_over_rows_split_on_an_explicit_mesh(set_mesh):
    # x split on the Explicit axis, y unsharded: the outer call vmaps the inner
    # call's loop over rows typed on the mesh
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    host_x = jnp.linspace(-2.0, 2.0, N * 3).reshape(N, 3)
    x = jax.device_put(host_x, NamedSharding(mesh, P("x")))
    y = jnp.cos(jnp.arange(M * 3.0)).reshape(M, 3)
    reduction, f, want = CASES["logsumexp"]
    loss = lambda run: lambda x: jnp.sum(jnp.sin(run(x, y)))
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        got = jax.jit(jax.value_and_grad(loss(_run("nested", f, reduction))))(x)
    assert jax.typeof(got[1]).sharding.spec == P("x", None)  # as x is
    expect = jax.value_and_grad(loss(lambda x, y: want(dense(f, x, y))))(host_x)
    assert_tree_close(jax.device_get(got), expect, rtol=2e-5, atol=2e-5)


def test_scan_engine_folds_rows_split_on_an_explicit_axis_where_they_live():
    # x split, y replicated: each device folds its own x rows; nothing is gathered
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.linspace(-2.0, 2.0, N * 3).reshape(N, 3), NamedSharding(mesh, P("x")))
    y = jax.device_put(jnp.cos(jnp.arange(M * 3.0)).reshape(M, 3), NamedSharding(mesh, P()))
    reduction, f, _ = CASES["logsumexp"]
    with ajm.config(backend="scan"):
        run = jax.jit(lambda x, y: ajm.pairwise(f, x, y, reduction, tiles=(4, 8)))
        hlo = run.lower(x, y).compile().as_text()
        assert jax.typeof(run(x, y)).sharding.spec == P("x")
    assert "all-gather" not in hlo


@pytest.mark.parametrize("axis_type, spec, set_mesh", MESHES)
def test_matmul_tiles_on_meshes_match_dense(axis_type, spec, set_mesh):
    # a dot product over 32 features: the matmul tiles; attention's values per y row
    mesh = jax.make_mesh((4,), ("x",), axis_types=(axis_type,))
    host_x = jnp.sin(jnp.arange(N * 32.0)).reshape(N, 32)
    host_y = jnp.cos(jnp.arange(M * 32.0)).reshape(M, 32)
    x, y = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (host_x, host_y))
    f = lambda a, b: (jnp.dot(a, b) / 4, b[:3])
    loss = lambda run: lambda x, y: jnp.sum(jnp.sin(run(x, y)))
    ours = lambda x, y: ajm.pairwise(f, x, y, ajm.SOFTMAX_WEIGHTED, tiles=(4, 8))

    def want(x, y):
        s, v = dense(f, x, y)
        return jnp.einsum("nm,nmd->nd", jax.nn.softmax(s, axis=1), v)

    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        plan = ajm.explain_pairwise(f, x, y, ajm.SOFTMAX_WEIGHTED, tiles=(4, 8))
        got = jax.jit(jax.value_and_grad(loss(ours), (0, 1)))(x, y)
    assert plan.engine == "pairwise tiles (matmul)", str(plan)
    expect = jax.value_and_grad(loss(want), (0, 1))(host_x, host_y)
    assert_tree_close(jax.device_get(got), expect, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("on", ["gpu", "tpu"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=lambda t: t.name)
def test_matmul_kernels_interpreted_on_meshes(axis_type, on, monkeypatch):
    # the GPU and TPU matmul tile kernels, interpreted, with rows split on a mesh: the
    # forward kernel and the reverse kernels (on a TPU one, its expanded distances'
    # dots a custom_vjp there: pairs.precision.keeping_inf_reverse)
    monkeypatch.setattr(pairs_api, "INTERPRET_LAYOUT", on)
    mesh = jax.make_mesh((4,), ("x",), axis_types=(axis_type,))
    host_x = jnp.sin(jnp.arange(N * 64.0)).reshape(N, 64)
    host_y = jnp.cos(jnp.arange(M * 64.0)).reshape(M, 64)
    x, y = (jax.device_put(a, NamedSharding(mesh, P("x"))) for a in (host_x, host_y))
    f = lambda a, b: -jnp.sum((a - b) ** 2) / 8
    loss = lambda run: lambda x, y: jnp.sum(jnp.sin(run(x, y)))
    ours = lambda x, y: ajm.pairwise(f, x, y, ajm.LOGSUMEXP, tiles=(4, 8))
    want = lambda x, y: jax.nn.logsumexp(dense(f, x, y), axis=1)
    with ajm.config(backend="interpret"), jax.set_mesh(mesh):
        plan = ajm.explain_pairwise(f, x, y, ajm.LOGSUMEXP, tiles=(4, 8))
        got = jax.jit(jax.value_and_grad(loss(ours), (0, 1)))(x, y)
    assert f"{on} matmul tile kernel, interpreted" in plan.reason, str(plan)
    expect = jax.value_and_grad(loss(want), (0, 1))(host_x, host_y)
    assert_tree_close(jax.device_get(got), expect, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("on", ["gpu", "tpu"])
def test_matmul_kernels_interpreted_spread_with_shard(on, monkeypatch):
    # shard=True with no mesh set: each device's x rows over all of y (pairs.spread),
    # the matmul tile kernels interpreted there, forward and reverse
    monkeypatch.setattr(pairs_api, "INTERPRET_LAYOUT", on)
    x = jnp.sin(jnp.arange(N * 64.0)).reshape(N, 64)
    y = jnp.cos(jnp.arange(M * 64.0)).reshape(M, 64)
    f = lambda a, b: -jnp.sum((a - b) ** 2) / 8
    loss = lambda run: lambda x, y: jnp.sum(jnp.sin(run(x, y)))
    ours = lambda x, y: ajm.pairwise(f, x, y, ajm.LOGSUMEXP, tiles=(4, 8), shard=True)
    want = lambda x, y: jax.nn.logsumexp(dense(f, x, y), axis=1)
    with ajm.config(backend="interpret"):
        plan = ajm.explain_pairwise(f, x, y, ajm.LOGSUMEXP, tiles=(4, 8), shard=True)
        got = jax.jit(jax.value_and_grad(loss(ours), (0, 1)))(x, y)
    assert f"{on} matmul tile kernel, interpreted" in plan.reason, str(plan)
    assert "spread over the devices (shard=True), 4 on each" in plan.reason, str(plan)
    assert_tree_close(got, jax.value_and_grad(loss(want), (0, 1))(x, y), rtol=2e-5, atol=2e-5)


def test_no_kernel_inside_a_vmap_over_rows_on_explicit_axes():
    # a kernel under an Explicit mesh runs in a shard_map, which jax refuses inside a
    # vmap over rows typed on its axes (shard=True spreads the x rows so): the fused
    # engine declines there with its reason (a jax ValueError before: "all mesh axes
    # are already manual"), and still runs over rows not typed on the mesh
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    host = jnp.linspace(-1.0, 1.0, N * 3).reshape(N, 3)
    rows = jax.device_put(host, NamedSharding(mesh, P("x")))
    inner = lambda xi: ajm.batch_map(lambda t: jnp.exp(t * xi[0]), host[:, 1], 4, reduction=ajm.ADD)
    with ajm.config(backend="interpret"), jax.set_mesh(mesh):
        want = jax.vmap(inner)(host)  # rows on no mesh axis: the kernel runs
        with pytest.raises(NotImplementedError, match="inside a vmap over rows typed on"):
            jax.vmap(inner)(rows)
        y = jax.device_put(host, NamedSharding(mesh, P("x")))
        run = lambda x, y: ajm.pairwise(lambda a, b: jnp.dot(a, b), x, y, ajm.ADD, shard=True)
        with pytest.raises(NotImplementedError, match="inside a vmap over rows typed on"):
            run(rows, y)
    with jax.set_mesh(mesh):
        got = jax.vmap(inner)(rows)  # not forced: the scan engine
    assert_tree_close(jax.device_get(got), want, rtol=1e-5, atol=1e-6)
    assert_tree_close(want, jnp.sum(jnp.exp(host[None, :, 1] * host[:, :1]), 1), rtol=1e-5)
