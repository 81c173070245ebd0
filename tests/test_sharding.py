"""Inputs on Explicit and Auto meshes (``jax.make_mesh`` gives Explicit axes by
default in jax 0.12), with and without ``jax.set_mesh``, replicated and with their
rows sharded, on 1 and 4 devices: every front end against plain JAX, values and
the output sharding ``jax.vmap`` / ``jnp`` give (DESIGN.md §9)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import adv_jax_math as ajm

pytestmark = [
    pytest.mark.skipif(jax.device_count() != 4, reason="needs the 4 virtual CPU devices"),
    pytest.mark.skipif(
        not hasattr(jax.sharding, "reshard"), reason="sharding in types needs jax >= 0.10"
    ),
]

N, B = 16, 3  # rows divisible by the devices, chunks that do not divide them
W = jnp.array([0.5, -1.0, 2.0, 0.25])
Y = jnp.cos(jnp.arange(32.0)).reshape(8, 4)  # rows a nested call reduces over


def fun(x):
    return jnp.sin(x * W) + x


def per_row(v):
    return jnp.tanh(v @ W) * v


MATRIX = [
    (devices, axis_type, spec, set_mesh)
    for devices in (1, 4)
    for axis_type in (AxisType.Explicit, AxisType.Auto)
    for spec in (P(), P("x"))
    for set_mesh in (False, True)
]
IDS = [
    f"{d}dev-{t.name}-{'P(x)' if s else 'P()'}-{'set_mesh' if m else 'no_mesh'}"
    for d, t, s, m in MATRIX
]


def half_of_matrix(parity: int) -> list:
    """:data:`MATRIX` as params: the half whose count of (4 devices, Auto, rows split,
    set_mesh) is ``parity`` mod 2 runs by default, the other half is marked slow
    (``make test-slow``). Either half holds every combination of any three axes."""
    params = []
    for case, name in zip(MATRIX, IDS, strict=True):
        devices, axis_type, spec, set_mesh = case
        odd = (devices == 4) + (axis_type is AxisType.Auto) + bool(spec) + set_mesh
        marks = () if odd % 2 == parity else pytest.mark.slow
        params.append(pytest.param(*case, id=name, marks=marks))
    return params


def place(devices, axis_type, spec):
    mesh = jax.make_mesh(
        (devices,), ("x",), devices=jax.devices()[:devices], axis_types=(axis_type,)
    )
    x = jax.device_put(jnp.linspace(-2.0, 2.0, N * 4).reshape(N, 4), NamedSharding(mesh, spec))
    return mesh, x


def context(mesh, on):
    return jax.set_mesh(mesh) if on else contextlib.nullcontext()


def host(x):
    """The values of ``x`` without their sharding (plain JAX on a gathered copy), for
    oracles plain JAX cannot compute on sharded rows (``lax.top_k`` along them)."""
    return jnp.asarray(np.asarray(x))


def same_sharding(got, want):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)


@pytest.mark.parametrize("devices, axis_type, spec, set_mesh", half_of_matrix(0))
def test_front_ends_match_plain_jax(devices, axis_type, spec, set_mesh):
    mesh, x = place(devices, axis_type, spec)
    xh = host(x)
    with context(mesh, set_mesh):
        # maps keep the sharding jax.vmap gives; under jit too where it is in the types
        # (on Auto axes a traced input's sharding is XLA's to propagate, not ours to see)
        got, want = ajm.batch_map(fun, x, B), fun(x)
        assert_tree_close(got, want)
        same_sharding(got, want)
        got = jax.jit(ajm.batch_map, static_argnums=(0, 2))(fun, x, B)
        assert_tree_close(got, want)
        if axis_type is AxisType.Explicit:
            same_sharding(got, want)
        got, want = ajm.batch_vmap(per_row, batch_size=B)(x), jax.vmap(per_row)(x)
        assert_tree_close(got, want)
        same_sharding(got, want)
        got = ajm.batch_vectorize(per_row, signature="(k)->(k)", batch_size=B)(x)
        want = jnp.vectorize(per_row, signature="(k)->(k)")(x)
        assert_tree_close(got, want)
        same_sharding(got, want)
        # reductions: the values plain JAX gives, replicated as jnp.sum's result is
        for kw, want in [
            (dict(reduction=jnp.add, chunk_reduction=jnp.sum), jnp.sum(fun(x))),
            (dict(reduction=ajm.MAX), jnp.max(fun(xh), 0)),
            (
                dict(reduction=jnp.multiply, chunk_reduction=lambda y: jnp.prod(y, 0)),
                jnp.prod(fun(xh), 0),
            ),
            (dict(reduction=ajm.ARGMIN), jnp.argmin(fun(xh), 0)),
            (dict(reduction=ajm.MEAN_VAR), (jnp.mean(fun(xh), 0), jnp.var(fun(xh), 0))),
            (
                dict(reduction=ajm.top_k(2)),
                tuple(jnp.moveaxis(a, -1, 0) for a in jax.lax.top_k(fun(xh).T, 2)),
            ),
        ]:
            got = ajm.batch_map(fun, x, B, **kw)
            assert_tree_close(got, want, rtol=1e-5, atol=1e-5)
            assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(got))
        # jacobians and gradients (under jit: an eager jax.grad of an Explicit array
        # outside set_mesh fails in plain JAX too, seeding its cotangent)
        v = jax.device_put(xh[0], NamedSharding(mesh, spec))
        for ours, plain in [
            (ajm.batch_jacfwd(per_row, batch_size=B), jax.jacfwd(per_row)),
            (ajm.batch_jacrev(per_row, batch_size=B), jax.jacrev(per_row)),
        ]:
            for wrap in (lambda f: f, jax.jit):  # eager and under jit
                got, want = wrap(ours)(v), wrap(plain)(v)
                assert_tree_close(got, want)
                if axis_type is AxisType.Explicit:  # on Auto axes XLA's layout, not a type
                    same_sharding(got, want)
        for kw, plain in [
            (dict(reduction=jnp.add, chunk_reduction=jnp.sum), jnp.sum),
            (dict(reduction=ajm.MAX), lambda y: jnp.max(y, 0).sum()),
        ]:
            ours = lambda x, kw=kw: jnp.sum(ajm.batch_map(fun, x, B, **kw))
            got = jax.jit(jax.grad(ours))(x)
            want = jax.jit(jax.grad(lambda x, plain=plain: plain(fun(x))))(x)
            assert_tree_close(got, want)
            if axis_type is AxisType.Explicit:  # (under jit; see the maps above)
                same_sharding(got, want)


@pytest.mark.parametrize("devices, axis_type, spec, set_mesh", half_of_matrix(1))
def test_shard_true(devices, axis_type, spec, set_mesh):
    mesh, x = place(devices, axis_type, spec)
    x = x[: N - 1] if spec == P() else x  # a global remainder where the rows allow it
    if axis_type is AxisType.Explicit and not set_mesh:
        kw = {}  # mesh= must be Auto (the original's contract); no mesh: all devices
    elif set_mesh:
        kw = {}  # the context mesh
    else:
        kw = dict(mesh=mesh)
    with context(mesh, set_mesh):
        got = ajm.batch_map(fun, x, B, shard=True, **kw)
        assert_tree_close(got, fun(host(x)))
        got = ajm.batch_map(fun, x, B, reduction=ajm.top_k(2), shard=True, **kw)
        want = tuple(jnp.moveaxis(a, -1, 0) for a in jax.lax.top_k(fun(host(x)).T, 2))
        assert_tree_close(got, want)
        # a fun holding a batch_map: its loop runs under vmap over the lanes' rows
        pair = lambda v: lambda y: jnp.sum(jnp.exp(-((y - v) ** 2)), axis=1)
        sums = dict(reduction=jnp.add, chunk_reduction=lambda c: jnp.sum(c, 0))
        inner = lambda v: ajm.batch_map(pair(v), Y, 4, **sums)
        vmapped = ajm.batch_vmap(inner, batch_size=B, shard=True, **kw)
        # jit only with the mesh set: otherwise shard=True takes every device, and jit
        # does not move an x committed to one of them
        got = (jax.jit(vmapped) if set_mesh else vmapped)(x)
        assert_tree_close(got, jax.vmap(lambda v: jnp.sum(pair(v)(Y)))(host(x)))
        plan = ajm.explain(fun, x, B, reduction=ajm.ARGMIN, shard=True, **kw)
        assert plan.engine == "shard", str(plan)
        if set_mesh:
            assert plan.shard.mesh.axis_names == mesh.axis_names, str(plan)


def test_rows_sharded_run_where_they_live():
    _, x = place(4, AxisType.Explicit, P("x"))
    plan = ajm.explain(fun, x, B, reduction=ajm.ARGMIN)
    assert plan.engine == "shard" and plan.shard.implicit and plan.shard.devices == 4, str(plan)
    assert plan.shard.local.rows_per_chunk <= B  # batch_size bounds each device's chunks
    _, x = place(4, AxisType.Explicit, P())
    assert ajm.explain(fun, x, B).engine == "scan"  # replicated rows: one device's plan
