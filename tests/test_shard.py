"""shard=True on four virtual CPU devices (set up by the repository conftest.py)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, oracle
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import adv_jax_math as ajm

pytestmark = pytest.mark.skipif(
    jax.device_count() != 4, reason="needs the 4 virtual CPU devices of conftest.py"
)

REDUCTIONS = {
    "map": (None, ajm.identity, oracle("map")),
    "add": (jnp.add, jnp.sum, oracle("add")),
    "max": (
        jnp.maximum,
        jnp.maximum.reduce,
        lambda y: jax.tree.map(lambda v: v.max(0, initial=-jnp.inf), y),  # n == 0 too
    ),
    "logsumexp": (jnp.logaddexp, jax.nn.logsumexp, oracle("logsumexp")),
    "generic": (
        lambda a, b: jax.tree.map(jnp.add, a, b),
        lambda y: jax.tree.map(lambda v: v.sum(0), y),
        lambda y: jax.tree.map(lambda v: v.sum(0), y),
    ),
}


def fun(d):
    return {"s": jnp.sin(d["x"]) * d["y"][:, None], "t": jnp.cos(d["y"])}


def inputs(n):
    x = jnp.linspace(-2, 2, n * 3).reshape(n, 3)
    return {"x": x, "y": jnp.linspace(0.5, 1.5, n)}


class Recorder:
    """Records the rows of every chunk actually executed, on every device (a
    partitioned callback sees each device's own rows)."""

    def __init__(self, fun):
        self.fun, self.rows = fun, []

    def __call__(self, d):
        jax.debug.callback(lambda y: self.rows.append(y.shape[0]), d["y"], partitioned=True)
        return self.fun(d)

    def executed(self):
        jax.effects_barrier()
        return collections.Counter(self.rows)


def expected_chunks(plan):
    """Chunk sizes the plan says the devices run (Counter of rows per device and
    chunk): every device its own share's chunks, and the global remainder's
    (replicated)."""
    lay, count = plan.shard, collections.Counter()

    def add(p):
        count[p.rows_per_chunk] += p.chunks * lay.devices
        if p.remainder:
            count[p.remainder] += lay.devices

    for p in (lay.local, lay.remainder):
        if p is not None:
            add(p)
    return count


# Every n (empty, under the device count, divisible, with a global remainder, local
# remainders) with two batch sizes, reductions round robin: the layout depends on n
# and batch_size; values per reduction x transform are in test_engines.py.
LAYOUTS = [  # (reduction, n, batch_size)
    ("map", 0, 2),
    ("add", 0, None),
    ("max", 1, None),
    ("logsumexp", 1, 1),
    ("generic", 3, 2),
    ("map", 3, 5),
    ("add", 4, 1),
    ("max", 4, 5),
    ("logsumexp", 7, 2),
    ("generic", 7, None),
    ("map", 17, 1),
    ("add", 17, 5),
    ("max", 67, 2),
    ("logsumexp", 67, 5),
    ("generic", 67, 1),
]


@pytest.mark.parametrize("name, n, batch_size", LAYOUTS)
def test_matches_oracle_and_plan(name, n, batch_size):
    reduction, chunk_reduction, expect = REDUCTIONS[name]
    rec = Recorder(fun)
    kw = dict(reduction=reduction, chunk_reduction=chunk_reduction, shard=True)
    out = jax.jit(lambda d: ajm.batch_map(rec, d, batch_size, **kw))(inputs(n))
    assert_tree_close(out, expect(fun(inputs(n))), rtol=1e-5, atol=1e-5)
    plan = ajm.explain(fun, inputs(n), batch_size, **kw)
    if n:
        assert rec.executed() == expected_chunks(plan), str(plan)
        local_rows = [plan.shard.local_rows] if plan.shard.local else []
        assert plan.shard.prefix == n - n % 4 and local_rows in ([n // 4], [])
        assert plan.shard.global_remainder == n % 4


@pytest.mark.parametrize(
    "name, n, batch_size",
    [("map", 3, 2), ("add", 17, 2), ("max", 67, 5), ("logsumexp", 16, None), ("generic", 17, 2)],
)
def test_gradients(name, n, batch_size):
    reduction, chunk_reduction, expect = REDUCTIONS[name]
    w0 = jnp.float32(0.7)

    def loss(w, d, run):
        out = run(lambda d: fun({"x": d["x"] * w, "y": d["y"]}), d)
        return sum(jnp.sum(v**2) for v in jax.tree.leaves(out))

    chunked = lambda f, d: ajm.batch_map(
        f, d, batch_size, reduction=reduction, chunk_reduction=chunk_reduction, shard=True
    )
    plain = lambda f, d: expect(f(d))
    g = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(w0, inputs(n), chunked)
    expect = jax.grad(loss, argnums=(0, 1))(w0, inputs(n), plain)
    assert_tree_close(g, expect, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_single_device_mesh_equals_unsharded():
    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    d = inputs(13)
    for name, (reduction, chunk_reduction, _) in REDUCTIONS.items():
        kw = dict(reduction=reduction, chunk_reduction=chunk_reduction)
        out = ajm.batch_map(fun, d, 4, shard=True, mesh=mesh, **kw)
        assert_tree_close(out, ajm.batch_map(fun, d, 4, **kw)), name


def test_explicit_mesh_selects_devices():
    mesh = jax.make_mesh((2,), ("rows",), axis_types=(AxisType.Auto,), devices=jax.devices()[2:])
    out = ajm.batch_map(jnp.sin, jnp.arange(9.0), 2, shard=True, mesh=mesh)
    assert_tree_close(out, jnp.sin(jnp.arange(9.0)))
    assert out.sharding.mesh.devices.tolist() == jax.devices()[2:]
    plan = ajm.explain(jnp.sin, jnp.arange(9.0), 2, shard=True, mesh=mesh)
    assert plan.shard.devices == 2 and plan.shard.global_remainder == 1
    assert "2 devices on mesh axis 'rows'" in str(plan)


def test_map_output_layout():
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    divisible = ajm.batch_map(jnp.sin, jnp.arange(16.0), 2, shard=True, mesh=mesh)
    assert divisible.sharding.spec == PartitionSpec("x")
    with_rest = ajm.batch_map(jnp.sin, jnp.arange(17.0), 2, shard=True, mesh=mesh)
    assert with_rest.sharding.is_fully_replicated


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_already_sharded_inputs(axis_type):
    src = jax.make_mesh((4,), ("x",), axis_types=(axis_type,))
    x = jax.device_put(jnp.linspace(0, 1, 20), NamedSharding(src, PartitionSpec("x")))
    w = jax.device_put(jnp.float32(3.0), NamedSharding(src, PartitionSpec()))
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    f = ajm.batch_vmap(lambda w, x: w * jnp.sin(x), (None, 0), batch_size=2, shard=True, mesh=mesh)
    assert_tree_close(f(w, x), 3.0 * jnp.sin(jnp.linspace(0, 1, 20)))
    red = ajm.batch_map(
        jnp.sin, x, 3, reduction=jnp.add, chunk_reduction=jnp.sum, shard=True, mesh=mesh
    )
    assert_tree_close(red, jnp.sin(jnp.linspace(0, 1, 20)).sum())


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2),
            "one-dimensional mesh",
        ),
        (lambda: jax.make_mesh((4,), ("a",), axis_types=(AxisType.Explicit,)), "AxisType.Auto"),
        (lambda: "cpu", "must be a jax.sharding.Mesh"),
    ],
)
def test_bad_mesh(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ajm.batch_map(jnp.sin, jnp.ones(8), 2, shard=True, mesh=make())


def test_mesh_without_shard_warns():
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    with pytest.warns(UserWarning, match="only used with shard=True"):
        ajm.batch_map(jnp.sin, jnp.ones(8), 2, mesh=mesh)


def test_batch_vmap_sharded_per_example_grads():
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    w, xs = jnp.ones(3) / 3, jnp.asarray(np.random.default_rng(0).normal(size=(11, 3)), jnp.float32)
    f = ajm.batch_vmap(jax.grad(loss), (None, 0), batch_size=2, shard=True)
    assert_tree_close(f(w, xs), jax.vmap(jax.grad(loss), (None, 0))(w, xs))


def _ordered_product(m):
    out = m[0]
    for a in m[1:]:
        out = out @ a
    return out


@pytest.mark.parametrize("n", [16, 18])
def test_generic_reductions_see_one_device_s_chunk_at_a_time(n):
    """A generic reduction reduces each device's own chunks, then the devices' results
    in the order of the rows: chunk results that keep a chunk's rows (the identity
    chunk_reduction) and reductions that do not commute (a product of matrices), as
    the unsharded call and plain JAX give them. Each chunk used to take the same rows
    of every device at once: (8,) for (2,), and the product in the wrong order."""
    x = jnp.arange(float(n))
    m = jnp.asarray(np.random.default_rng(0).normal(size=(n, 2, 2)), jnp.float32)
    pair = lambda c: c[0] @ c[1]
    cases = [
        (lambda r: r, x, dict(reduction=jnp.add), x.reshape(-1, 2).sum(0)),
        (lambda r: r, m, dict(reduction=jnp.matmul, chunk_reduction=pair), _ordered_product(m)),
        (pair, m, dict(reduction=jnp.matmul), _ordered_product(m)),  # fun reduces its chunk
    ]
    for f, xs, kw, want in cases:
        got = ajm.batch_map(f, xs, 2, shard=True, **kw)
        assert_tree_close(got, want, rtol=1e-4, atol=1e-4)
        assert_tree_close(got, ajm.batch_map(f, xs, 2, **kw), rtol=1e-4, atol=1e-4)
