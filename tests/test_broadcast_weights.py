"""``weighted_logsumexp`` with weights that broadcast as ``jax.nn.logsumexp``'s ``b``
does (issue 43): a weight per row against vectors ``a`` (``b (n,)``, ``(n, 1)``), and
``a`` spread over ``b``'s vector, on every engine of ``batch_map`` and of ``pairwise``
(the OTT-JAX form: per-y weights against per-pair vectors), values, signs and
gradients against jax itself; nothing of the broadcast shape is stored per pair."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_tree_close,
    each_on_an_engine,
    engine,
    needs_abstract_devices,
    normal,
    on_abstract_device,
)

import adv_jax_math as ajm
from adv_jax_math.pairs import api as pairs_api

SHAPES = {  # a's rows, b's rows
    "weight per row": ((23, 5), (23,)),
    "weight per row, (n, 1)": ((23, 5), (23, 1)),
    "a per row": ((23, 1), (23, 5)),
    "matrix by column": ((23, 3, 4), (23, 4)),
}


def _close(got, expect):
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expect), strict=True):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(e))
        ok = ~np.isnan(np.asarray(e))
        assert_tree_close(np.asarray(g)[ok], np.asarray(e)[ok], rtol=2e-5, atol=2e-5)


def _jax_b(a, b):
    """``b`` as jax.nn.logsumexp takes it along axis 0: rows aligned first."""
    return b.reshape(b.shape[:1] + (1,) * (a.ndim - b.ndim) + b.shape[1:])


def _values_and_signs_as_jax(a, b, name):
    """``batch_map``'s weighted logsumexp on engine ``name`` against jax's, with signs
    and without."""
    for sign in (False, True):
        reduction = ajm.weighted_logsumexp(sign)
        with engine(name) as kw:
            run = lambda a, b, r=reduction: ajm.batch_map(lambda v: v, (a, b), 4, reduction=r, **kw)
            got = jax.jit(run)(a, b)
        _close(got, jax.nn.logsumexp(a, 0, b=_jax_b(a, b), return_sign=sign))


@pytest.mark.parametrize("shapes, name", each_on_an_engine(SHAPES))
def test_batch_map_weights_broadcast_as_jax(shapes, name):
    sa, sb = SHAPES[shapes]
    a, b = 3 * normal(0, sa), normal(1, sb)
    _values_and_signs_as_jax(a, b, name)

    # gradients by a and by the (positive) weights, in their own shapes
    def loss(lse, a, b):
        return jnp.sum(jnp.sin(lse(a, jnp.abs(b) + 0.1)))

    ours = lambda a, b: ajm.batch_map(
        lambda v: v, (a, b), 4, reduction=ajm.WEIGHTED_LOGSUMEXP, **kw
    )
    with engine(name) as kw:
        got = jax.jit(jax.grad(lambda a, b: loss(ours, a, b), (0, 1)))(a, b)
    plain = lambda a, b: jax.nn.logsumexp(a, 0, b=_jax_b(a, b))
    want = jax.grad(lambda a, b: loss(plain, a, b), (0, 1))(a, b)
    assert [g.shape for g in got] == [sa, sb]
    assert_tree_close(got, want, rtol=1e-4, atol=1e-5)


# -- pairwise: OTT-JAX's Sinkhorn step, a per-y weight against a vector per pair --------
def _sinkhorn(features: int):
    """``f`` of OTT's lse kernel, four potentials at once: ``a`` ``(4,)`` per pair,
    ``b`` the y row's marginal weight (a scalar); the squared distance over
    ``features`` (expanded on the matmul tiles from 64 on)."""

    def f(xi, yj):
        yv, g, w = yj
        return (g - jnp.sum((xi - yv) ** 2)) / 0.5, w

    x, y = normal(2, (37, features)) / 3, normal(3, (53, features)) / 3
    g, w = normal(4, (53, 4)), jnp.linspace(-0.5, 2.0, 53)
    return f, x, (y, g, w)


def _dense(f, x, y, sign):
    a, b = jax.vmap(jax.vmap(f, (None, 0)), (0, None))(x, y)
    return jax.nn.logsumexp(a, axis=1, b=b[..., None], return_sign=sign)


ROUTES = {  # name: (features, backend, the interpreted kernel's layout, engine)
    "cpu tiles": (3, None, None, "pairwise tiles (xla)"),
    "matmul tiles": (64, None, None, "pairwise tiles (matmul)"),
    "scan": (3, "scan", None, "pairwise scan"),
    "gpu kernel": (3, "interpret", "gpu", "pairwise kernel (interpret)"),
    "tpu kernel": (3, "interpret", "tpu", "pairwise kernel (interpret)"),
    "gpu matmul kernel": (64, "interpret", "gpu", "pairwise kernel (interpret)"),
}


@pytest.mark.parametrize(
    "route",
    [  # (the TPU layout and the GPU matmul kernel in make test-slow)
        pytest.param(r, marks=pytest.mark.slow if r in ("tpu kernel", "gpu matmul kernel") else ())
        for r in ROUTES
    ],
)
def test_pairwise_weights_broadcast_on_every_engine(route, monkeypatch):
    features, backend, layout, name = ROUTES[route]
    if layout:
        monkeypatch.setattr(pairs_api, "INTERPRET_LAYOUT", layout)
    f, x, y = _sinkhorn(features)
    tiles = (8, 16) if backend else "auto"
    run = lambda x, y, r: ajm.pairwise(f, x, y, r, tiles=tiles)
    with ajm.config(backend=backend):
        plan = ajm.explain_pairwise(f, x, y, ajm.WEIGHTED_LOGSUMEXP, tiles=tiles)
        got = jax.jit(lambda x, y: run(x, y, ajm.weighted_logsumexp(True)))(x, y)
        positive = lambda y: (y[0], y[1], jnp.abs(y[2]) + 0.1)
        loss = lambda x, y: jnp.sum(jnp.sin(run(x, positive(y), ajm.WEIGHTED_LOGSUMEXP)))
        grads = jax.jit(jax.grad(loss, (0, 1)))(x, y)
    assert plan.engine == name, str(plan)
    _close(got, _dense(f, x, y, True))
    want = jax.grad(lambda x, y: jnp.sum(jnp.sin(_dense(f, x, positive(y), False))), (0, 1))(x, y)
    assert_tree_close(grads, want, rtol=2e-4, atol=2e-4)


@needs_abstract_devices
def test_pairwise_weights_broadcast_in_the_gpu_kernel_lowered_for_h100():
    f, x, y = _sinkhorn(3)
    grad = jax.value_and_grad(lambda x, y: jnp.sum(ajm.pairwise(f, x, y, ajm.WEIGHTED_LOGSUMEXP)))
    with on_abstract_device("cuda"):
        plan = ajm.explain_pairwise(f, x, y, ajm.WEIGHTED_LOGSUMEXP)
        text = jax.jit(grad).trace(x, y).lower(lowering_platforms=("cuda",)).as_text()
    assert plan.engine == "pairwise kernel (mosaic_gpu)", str(plan)
    assert "mosaic_gpu" in text and "triton" not in text


@pytest.mark.parametrize("features", [3, 64])
def test_weights_cost_no_more_temp_than_twice_the_unweighted_call(features):
    # the weighted form stays on the unweighted call's engine, its weights never
    # broadcast to the (bi, bj, 4) values of a tile in memory
    f, x, y = _sinkhorn(features)
    n, m = 4096, 3000
    x = jax.ShapeDtypeStruct((n, features), jnp.float32)
    y = tuple(jax.ShapeDtypeStruct((m, *a.shape[1:]), a.dtype) for a in y)
    unweighted = lambda xi, yj: f(xi, yj)[0]
    runs = {
        "weighted": (f, ajm.WEIGHTED_LOGSUMEXP),
        "unweighted": (unweighted, ajm.LOGSUMEXP),
    }
    temp, engines = {}, {}
    for key, (g, red) in runs.items():
        engines[key] = ajm.explain_pairwise(g, x, y, red).engine
        compiled = jax.jit(lambda x, y, g=g, red=red: ajm.pairwise(g, x, y, red)).lower(x, y)
        temp[key] = compiled.compile().memory_analysis().temp_size_in_bytes
    assert engines["weighted"] == engines["unweighted"] != "pairwise scan", engines
    assert temp["weighted"] <= 2 * temp["unweighted"], temp


def test_shapes_that_do_not_broadcast_are_refused_with_both_shapes():
    a, b = normal(0, (23, 6)), normal(1, (23, 4))
    with pytest.raises(ValueError, match=r"rows of shapes \(6,\) and \(4,\), which do not"):
        ajm.batch_map(lambda v: v, (a, b), 4, reduction=ajm.WEIGHTED_LOGSUMEXP)


@pytest.mark.skipif(jax.device_count() != 4, reason="needs the 4 virtual CPU devices")
@pytest.mark.parametrize("shard", [True, "y"])
@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_pairwise_weights_broadcast_spread_over_devices(shard, axis_type):
    # the x rows (shard=True) or the y rows ("y") over 4 devices, under jax.set_mesh
    f, x, y = _sinkhorn(3)
    mesh = jax.make_mesh((4,), ("d",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    run = lambda x, y: ajm.pairwise(f, x, y, ajm.weighted_logsumexp(True), shard=shard)
    with jax.set_mesh(mesh):
        got = jax.jit(run)(x, y)
    _close(got, _dense(f, x, y, True))


@pytest.mark.parametrize("shapes, name", each_on_an_engine(["weight per row", "a per row"]))
def test_broadcast_weights_at_special_values(shapes, name):
    """Zero weights (a row left out, whatever its values: jax masks them), infinite and
    NaN values, an all -inf column, against jax.nn.logsumexp(b=) with the same shapes."""
    sa, sb = SHAPES[shapes]
    a, b = np.array(3 * normal(0, sa)), np.array(jnp.abs(normal(1, sb)) + 0.1)
    a[2], a[5] = np.inf, -np.inf  # (rows of a: every column of them)
    a[7, ...] = np.nan
    a[:, -1:] = -np.inf  # one column (all of a's, where a has one) with nothing in it
    b[2], b[7] = 0.0, 0.0  # the +inf and the NaN rows weighted out
    a, b = jnp.asarray(a), jnp.asarray(b)
    _values_and_signs_as_jax(a, b, name)
