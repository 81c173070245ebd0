"""Where outputs and derivatives live when the rows are split over devices (issue
26, §3-4): on an Auto mesh a sharding is no part of the type, so XLA places what a
program returns; plain JAX (``jax.vmap``, ``jax.grad`` of the unchunked computation)
keeps the rows' sharding, and so must every front end, its gradients included.
The matrix and helpers are tests/test_sharding.py's."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_sharding import B, context, fun, per_row, place, pytestmark, same_sharding

import adv_jax_math as ajm

__all__ = ["pytestmark"]

CASES = list(itertools.product((AxisType.Auto, AxisType.Explicit), (P(), P("x")), (False, True)))


def ids(cases: list) -> list[str]:
    name = lambda t, s, m: f"{t.name}-{'P(x)' if s else 'P()'}-{'set_mesh' if m else 'no_mesh'}"
    return [name(*c) for c in cases]


ADD = dict(reduction=jnp.add, chunk_reduction=jnp.sum)
SUM_SQ = dict(  # not recognized as a monoid: the generic path
    reduction=lambda a, b: a + b, chunk_reduction=lambda y: jnp.mean(y, 0) * len(y)
)
# (backend, batch_size, shard, reduction, plain JAX's scalar of fun(x), to differentiate)
GRADIENTS = [
    ("scan", B, False, ADD, jnp.sum),
    ("scan", 4, False, ADD, jnp.sum),
    ("scan", B, True, ADD, jnp.sum),
    ("scan", B, False, dict(reduction=ajm.MAX), lambda y: jnp.max(y, 0).sum()),
    ("scan", B, False, SUM_SQ, jnp.sum),
    ("scan", B, False, {}, lambda y: jnp.sum(jnp.sin(y))),  # a map's VJP
    ("interpret", B, False, ADD, jnp.sum),
]


# Auto meshes, and one Explicit case that the layout tie must leave alone (the
# rest of the Explicit matrix: test_sharding.py)
GRAD_CASES = [c for c in CASES if c[0] is AxisType.Auto] + [(AxisType.Explicit, P("x"), True)]


@pytest.mark.slow
@pytest.mark.parametrize("axis_type, spec, set_mesh", GRAD_CASES, ids=ids(GRAD_CASES))
def test_gradient_w_r_t_rows_keeps_their_sharding(axis_type, spec, set_mesh):
    """jax.grad w.r.t. the rows is laid out as the rows are (it came out replicated
    on Auto meshes), eager and under jit, for monoids, a generic reduction and a map,
    batch sizes that do and do not divide the rows, on the scan and interpret engines
    and with shard=True (which spreads whole rows, and so their gradient: values only
    there)."""
    mesh, x = place(4, axis_type, spec)
    # an eager jax.grad of an Explicit array outside set_mesh fails in plain JAX too
    wraps = [jax.jit] if axis_type is AxisType.Explicit and not set_mesh else [None, jax.jit]
    with context(mesh, set_mesh):
        for backend, b, shard, kw, plain in GRADIENTS:
            post = jnp.sum if kw else plain
            kw = {**kw, "shard": shard}
            ours = lambda x, b=b, kw=kw, post=post: post(ajm.batch_map(fun, x, b, **kw))
            for wrap in wraps:
                wrap = wrap or (lambda f: f)
                with ajm.config(backend=backend):
                    got = wrap(jax.grad(ours))(x)
                want = wrap(jax.grad(lambda x, plain=plain: plain(fun(x))))(x)
                assert_tree_close(got, want, rtol=1e-5, atol=1e-5)
                if not (shard and spec == P()):
                    same_sharding(got, want)


ROWS_SPLIT = [c for c in CASES if c[1] == P("x")]


@pytest.mark.parametrize("axis_type, spec, set_mesh", ROWS_SPLIT, ids=ids(ROWS_SPLIT))
def test_rows_split_maps_and_generic_reductions(axis_type, spec, set_mesh):
    """On rows split over devices, maps keep jax.vmap's output sharding at batch sizes
    that do and do not divide the rows, and a reduction that is not a monoid (a sum
    of squares, chunk_reduction mean × rows; reported to raise a ShardingTypeError
    from a sort on Explicit meshes) gives plain JAX's value, shard=False and True."""
    mesh, x = place(4, axis_type, spec)
    with context(mesh, set_mesh):
        for b in (B, 4):
            got, want = ajm.batch_vmap(per_row, batch_size=b)(x), jax.vmap(per_row)(x)
            assert_tree_close(got, want)
            same_sharding(got, want)
            got = ajm.batch_vectorize(per_row, signature="(k)->(k)", batch_size=b)(x)
            assert_tree_close(got, want)
            same_sharding(got, want)
            for shard in (False, True):
                got, want = ajm.batch_map(fun, x, b, shard=shard), jax.vmap(fun)(x)
                assert_tree_close(got, want)
                same_sharding(got, want)
                got = ajm.batch_map(lambda v: v**2, x, b, shard=shard, **SUM_SQ)
                assert_tree_close(got, jnp.sum(x**2, 0), rtol=1e-5, atol=1e-5)


INNER = {  # fun with derivative rules or loops of their own, traced into fun's jaxpr
    "relu": jax.nn.relu,
    "fori_loop": lambda v: jax.lax.fori_loop(0, 3, lambda i, c: jnp.sin(c) * v, v),
}


@pytest.mark.parametrize("set_mesh", [False, True], ids=["no_mesh", "set_mesh"])
@pytest.mark.parametrize("backend", ["scan", "interpret"])
@pytest.mark.parametrize("name", list(INNER))
def test_gradients_through_rules_traced_on_split_rows(name, backend, set_mesh):
    """Rows split over an Explicit mesh of 4: a ``custom_jvp`` (``jax.nn.relu``'s
    select) or a ``fori_loop`` inside ``fun`` is traced with the chunks' sharding, so
    its tangents agree with the chunks' (they were traced unsharded: "select cases
    must have the same shardings", "Expected cotangent type float32[8@x,4]")."""
    mesh, x = place(4, AxisType.Explicit, P("x"))
    f = INNER[name]
    with jax.set_mesh(mesh):  # plain JAX's gradient of a fori_loop needs the mesh set
        want = jax.grad(lambda x: jnp.sum(f(x)))(x)
    with context(mesh, set_mesh), ajm.config(backend=backend):
        for red in (None, ajm.ADD):
            loss = lambda x, red=red: jnp.sum(ajm.batch_map(f, x, B, reduction=red))
            got = jax.jit(jax.grad(loss))(x)
            assert_tree_close(got, want)
            same_sharding(got, want)
