"""Valid calls the fused engine once crashed on (issue 26 §3), against plain JAX on
every engine: rows without elements (``(n, 0)``, ``(n, 3, 0)``), and gradients of
the interpret engine under ``jax.set_mesh`` of an Explicit mesh."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import adv_jax_math as ajm

ENGINES = ["scan", "interpret", "shard"]


def _top2(y):
    values, rows = lax.top_k(jnp.moveaxis(y, 0, -1), 2)
    return jnp.moveaxis(values, -1, 0), jnp.moveaxis(rows, -1, 0)


# reduction -> its plain-JAX oracle over the rows (axis 0)
REDUCTIONS = {
    "ARGMIN": (ajm.ARGMIN, lambda y: jnp.argmin(y, 0)),
    "ARGMAX": (ajm.ARGMAX, lambda y: jnp.argmax(y, 0)),
    "MIN_ARGMIN": (ajm.MIN_ARGMIN, lambda y: (jnp.min(y, 0), jnp.argmin(y, 0))),
    "MAX_ARGMAX": (ajm.MAX_ARGMAX, lambda y: (jnp.max(y, 0), jnp.argmax(y, 0))),
    "MEAN": (ajm.MEAN, lambda y: jnp.mean(y, 0)),
    "VAR": (ajm.VAR, lambda y: jnp.var(y, 0)),
    "var(1)": (ajm.var(1), lambda y: jnp.var(y, 0, ddof=1)),
    "MEAN_VAR": (ajm.MEAN_VAR, lambda y: (jnp.mean(y, 0), jnp.var(y, 0))),
    "top_k(2)": (ajm.top_k(2), _top2),
    "ADD": (ajm.ADD, lambda y: jnp.sum(y, 0)),
    "MAX": (ajm.MAX, lambda y: jnp.max(y, 0)),
    "MIN": (ajm.MIN, lambda y: jnp.min(y, 0)),
    "LOGSUMEXP": (ajm.LOGSUMEXP, lambda y: jax.nn.logsumexp(y, 0)),
}


def _engine(engine):
    """The config and batch_map keywords that run ``engine``."""
    backend = "scan" if engine == "scan" else "interpret"
    return ajm.config(backend=backend), {"shard": engine == "shard"}


def _floats(tree):
    """A result's float leaves (what has a derivative)."""
    return [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)]


def _loss(tree):
    return sum((jnp.sum(a) for a in _floats(tree)), jnp.float32(0))


def _check_empty(fun, x, reduction, want_of, engine):
    """Values of ``reduction`` of ``fun`` over the rows of ``x`` against
    ``want_of(fun(x))``, and the gradient and JVP of its float leaves; under
    backend="interpret" the plan says why the fused kernel declined."""
    context, kw = _engine(engine)
    ours = lambda x: ajm.batch_map(fun, x, 2, reduction=reduction, **kw)
    theirs = lambda x: want_of(fun(x))
    with context:
        assert_tree_close(ours(x), theirs(x))
        if _floats(theirs(x)):
            grad = jax.grad(lambda x: _loss(ours(x)))(x)
            assert_tree_close(grad, jax.grad(lambda x: _loss(theirs(x)))(x))
            t = jnp.ones_like(x)
            jvp = jax.jvp(lambda x: _floats(ours(x)), (x,), (t,))
            assert_tree_close(jvp, jax.jvp(lambda x: _floats(theirs(x)), (x,), (t,)))
        if engine == "interpret":
            plan = str(ajm.explain(fun, x, 2, reduction=reduction))
            assert "without elements" in plan, plan


# By default every reduction on the interpret engine (the fused kernel, which crashed
# here) and on the scan or the shard engine in turn; the rest slow (make test-slow).
@pytest.mark.parametrize(
    "name, engine",
    [
        pytest.param(
            name, e, marks=() if e in ("interpret", ("scan", "shard")[i % 2]) else pytest.mark.slow
        )
        for i, name in enumerate(REDUCTIONS)
        for e in ENGINES
    ],
)
def test_rows_without_elements_match_plain_jax(name, engine):
    reduction, want_of = REDUCTIONS[name]
    for shape in [(5, 0), (5, 3, 0)]:
        _check_empty(lambda r: jnp.sin(r), jnp.ones(shape), reduction, want_of, engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_empty_results_beside_others_match_plain_jax(engine):
    # softmax-weighted values without elements; an empty state beside a full one
    # (rows with elements, fun's output without); a constant without elements
    x = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)
    softmax = lambda y: jnp.tensordot(jax.nn.softmax(y[0], 0), y[1], ([0], [0]))
    empty = jnp.zeros((0,))
    cases = [
        (lambda r: (r[:, 0], r[:, :0]), ajm.SOFTMAX_WEIGHTED, softmax),
        (
            lambda r: (jnp.sin(r), r[:, :0] * 2.0),
            (ajm.MEAN, ajm.MAX),
            lambda y: (jnp.mean(y[0], 0), jnp.max(y[1], 0)),
        ),
        (lambda r: r[:, :0] + empty, ajm.VAR, lambda y: jnp.var(y, 0)),
    ]
    for fun, reduction, want_of in cases:
        _check_empty(fun, x, reduction, want_of, engine)


# ---------------------------------------------------------------------------- #
# The interpret engine's gradients under jax.set_mesh of an Explicit mesh
# ---------------------------------------------------------------------------- #

MESHES = [
    pytest.param(
        devices,
        axis_type,
        spec,
        set_mesh,
        id=f"{devices}dev-{axis_type.name}-{'P(x)' if spec else 'P()'}-"
        + ("set_mesh" if set_mesh else "no_mesh"),
        # about 5 s: two engines, each compiling the kernel per device
        marks=[pytest.mark.slow] if devices == 4 and axis_type == AxisType.Explicit else [],
    )
    for devices in (1, 4)
    for axis_type in (AxisType.Explicit, AxisType.Auto)
    for spec in (P(), P("x"))
    for set_mesh in (False, True)
]


@pytest.mark.skipif(jax.device_count() != 4, reason="needs the 4 virtual CPU devices")
@pytest.mark.skipif(not hasattr(jax.sharding, "reshard"), reason="needs jax >= 0.10")
@pytest.mark.parametrize("devices, axis_type, spec, set_mesh", MESHES)
def test_interpret_gradients_on_meshes_match_plain_jax(devices, axis_type, spec, set_mesh):
    mesh = jax.make_mesh(
        (devices,), ("x",), devices=jax.devices()[:devices], axis_types=(axis_type,)
    )
    host = jnp.linspace(-2.0, 2.0, 16 * 3).reshape(16, 3)
    x = jax.device_put(host, NamedSharding(mesh, spec))
    fun = lambda r: jnp.sin(r) * 2.0
    cases = [
        (ajm.top_k(2), lambda out: out[0].sum(), lambda y: _top2(y)[0].sum()),
        (ajm.MEAN, jnp.sum, lambda y: jnp.mean(y, 0).sum()),
    ]
    for reduction, loss_of, want_of in cases:
        want = jax.value_and_grad(lambda x, w=want_of: w(fun(x)))(host)
        for engine in ["interpret", "shard"] if devices == 4 else ["interpret"]:
            context, kw = _engine(engine)
            with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext(), context:
                got = jax.jit(jax.value_and_grad(_loss_of(fun, reduction, loss_of, kw)))(x)
            assert_tree_close(jax.device_get(got), want)


def _loss_of(fun, reduction, loss_of, kw):
    return lambda x: loss_of(ajm.batch_map(fun, x, 3, reduction=reduction, **kw))
