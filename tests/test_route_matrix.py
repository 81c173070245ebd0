"""Every route on every engine of the registry, on every kind of mesh, under every
transformation, against plain JAX.

The axes come from tables below, the engines' from the registry itself
(``_engines.engines()``: a new engine without a column here fails
:func:`test_every_registered_engine_has_a_column`). A route is a way into the engines
(a plain ``batch_map``, ``batch_vmap``, a ``batch_map`` whose ``fun`` closes over rows
that pair with the chunk's: the pairing route, nested calls, ``pairwise``); a column is
how an engine is asked for (``config(backend=...)``, ``shard=``); a mesh is where the
inputs live (none, an Auto mesh replicated or split, an Explicit one with and without
``jax.set_mesh``); a transformation is what wraps the call (none, ``jit``, ``grad``,
``jvp``, ``vmap``, a Hessian-vector product).

The whole product (thousands of compiles) is not run: :data:`CASES` holds every
route on every column, and every pair of values of any two axes at least once (a
covering array of strength two, built greedily and deterministically, from the
calls that must be there, :data:`MUST`): about a hundred small cases. Shapes are
tiny; the rows (7 of x, 6 of y) are not a multiple of the 4 devices (a global
remainder of at least 2 rows, which the pairing route can take), but where an
input's rows are split over them (8).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, normal
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import adv_jax_math as ajm
from adv_jax_math.engines import registry as _engines
from adv_jax_math.engines import shard as _shard
from adv_jax_math.engines.chunked import prepare

pytestmark = [
    pytest.mark.skipif(jax.device_count() != 4, reason="needs the 4 virtual CPU devices"),
    pytest.mark.skipif(
        not hasattr(jax.sharding, "reshard"), reason="sharding in types needs jax >= 0.10"
    ),
]

N, N_SPLIT, M, B, BY = 7, 8, 6, 3, 2  # rows, rows split over 4 devices, y rows, chunks
W = np.array([0.5, -1.0, 2.0], np.float32)
TOL = dict(rtol=2e-4, atol=2e-4)


def sqdist(a, b):
    return jnp.sum((a - b) ** 2, -1)


# -- routes: (ours, plain JAX), each a function of (x, y, s) ------------------------------
@dataclasses.dataclass(frozen=True)
class Route:
    ours: Callable[..., Any]  # (x, y, s, shard) -> result; shard: the column's keywords
    plain: Callable[..., Any]  # (x, y, s) -> the same, in plain JAX
    floats: bool = True  # a float result: differentiable
    shard_y: bool = False  # pairwise(shard="y") under the shard columns
    closes: bool = False  # the sharded call's fun closes over y (typed on the mesh)


def _row(v, s):
    return jnp.sin(v * W * s) + v


def _pairs(v, y, s):  # (rows, M): the N-body form, fun closing over y
    return jnp.exp(-s * sqdist(v[:, None], y[None]))


SUMS = dict(reduction=jnp.add, chunk_reduction=lambda t: t.sum(0))


def _nested_vmap(x, y, s, kw):
    inner = lambda xi: ajm.batch_vmap(
        lambda yj: -s * sqdist(xi, yj), batch_size=BY, reduction=ajm.LOGSUMEXP
    )(y)
    return ajm.batch_vmap(inner, batch_size=B, **kw)(x)


def _nested_map(x, y, s, kw):
    blocks = lambda yc, xc: -s * sqdist(yc[:, None], xc[None])  # (BY, B): y rows first
    outer = lambda xc: ajm.batch_map(lambda yc: blocks(yc, xc), y, BY, reduction=ajm.LOGSUMEXP)
    return ajm.batch_map(outer, x, B, **kw)


def _pairwise(x, y, s, kw, **more):
    f = lambda a, b: -s * sqdist(a, b)
    return ajm.pairwise(f, x, y, ajm.LOGSUMEXP, tiles=(B, BY), **kw, **more)


def _lse_rows(x, y, s):  # plain: reduce over y for every x row
    return jax.nn.logsumexp(-s * sqdist(x[:, None], y[None]), 1)


LIFT = np.asarray(normal(2, (3, 16)))  # rows to 16 features: f's dot is read as a matmul


def _attention(x, y, s, kw):  # the matmul tiles (the tile kernel declines 16 features)
    q, k = jnp.tanh(x @ LIFT), jnp.tanh(y @ LIFT)
    f = lambda a, b: (s * jnp.dot(a, b), b)
    return ajm.pairwise(f, q, k, ajm.SOFTMAX_WEIGHTED, tiles=(B, BY), **kw)


def _attention_plain(x, y, s):
    q, k = jnp.tanh(x @ LIFT), jnp.tanh(y @ LIFT)
    return jax.nn.softmax(s * q @ k.T, 1) @ k


ROUTES = {
    "map": Route(
        lambda x, y, s, kw: ajm.batch_map(lambda v: _row(v, s), x, B, **kw),
        lambda x, y, s: _row(x, s),
    ),
    "sum": Route(
        lambda x, y, s, kw: ajm.batch_map(lambda v: _row(v, s), x, B, **SUMS, **kw),
        lambda x, y, s: _row(x, s).sum(0),
    ),
    "max": Route(
        lambda x, y, s, kw: ajm.batch_map(lambda v: _row(v, s), x, B, reduction=ajm.MAX, **kw),
        lambda x, y, s: _row(x, s).max(0),
    ),
    "sum_auto": Route(  # batch_size="auto": the autotuner (or the pairing's draft)
        lambda x, y, s, kw: ajm.batch_map(lambda v: _row(v, s), x, "auto", **SUMS, **kw),
        lambda x, y, s: _row(x, s).sum(0),
    ),
    "vmap": Route(
        lambda x, y, s, kw: ajm.batch_vmap(lambda v: jnp.tanh(v @ W * s) * v, batch_size=B, **kw)(
            x
        ),
        lambda x, y, s: jnp.tanh(x @ W * s)[:, None] * x,
    ),
    "pairing": Route(
        lambda x, y, s, kw: ajm.batch_map(lambda v: _pairs(v, y, s), x, B, **SUMS, **kw),
        lambda x, y, s: _pairs(x, y, s).sum(0),
        closes=True,
    ),
    "pairing_whole": Route(  # batch_size=None: one chunk
        lambda x, y, s, kw: ajm.batch_map(lambda v: _pairs(v, y, s), x, None, **SUMS, **kw),
        lambda x, y, s: _pairs(x, y, s).sum(0),
        closes=True,
    ),
    "pairing_auto": Route(
        lambda x, y, s, kw: ajm.batch_map(lambda v: _pairs(v, y, s), x, "auto", **SUMS, **kw),
        lambda x, y, s: _pairs(x, y, s).sum(0),
        closes=True,
    ),
    "pairing_argmin": Route(  # k-NN: the nearest row of x for every query in y
        lambda x, y, s, kw: ajm.batch_map(
            lambda v: sqdist(v[:, None], y[None]), x, B, reduction=ajm.ARGMIN, **kw
        ),
        lambda x, y, s: jnp.argmin(sqdist(x[:, None], y[None]), 0),
        floats=False,
        closes=True,
    ),
    "nested_vmap": Route(_nested_vmap, _lse_rows, closes=True),
    "nested_map": Route(_nested_map, _lse_rows, closes=True),
    "pairwise": Route(_pairwise, _lse_rows),
    "pairwise_y": Route(_pairwise, _lse_rows, shard_y=True),
    "pairwise_matmul": Route(_attention, _attention_plain),
    "pairwise_columns": Route(
        lambda x, y, s, kw: _pairwise(x, y, s, kw, columns=ajm.ADD),
        lambda x, y, s: (_lse_rows(x, y, s), (-s * sqdist(x[:, None], y[None])).sum(0)),
    ),
}

# -- columns: how each engine of the registry is asked for ---------------------------------
COLUMNS = {  # name: (engine it asks for, backend, shard)
    "scan": ("scan", "scan", False),
    "interpret": ("interpret", "interpret", False),
    "pallas": ("pallas", "pallas", False),  # on CPU: a clear error where it is meant
    "pairwise": ("pairwise", "auto", False),
    "shard": ("shard", "auto", True),
    "shard_scan": ("shard", "scan", True),
    "shard_interpret": ("shard", "interpret", True),
}

# -- meshes: where the inputs live -----------------------------------------------------------
MESHES = {  # name: (axis type or None, rows spec, jax.set_mesh)
    "none": (None, None, False),
    "auto_P()": (AxisType.Auto, P(), False),
    "auto_P(x)": (AxisType.Auto, P("x"), False),
    "explicit_P(x)": (AxisType.Explicit, P("x"), False),
    "explicit_P(x)_set": (AxisType.Explicit, P("x"), True),
    "explicit_P()_set": (AxisType.Explicit, P(), True),
}

TRANSFORMS = ["none", "jit", "grad", "jvp", "vmap", "hvp"]
SECOND_ORDER = {"sum", "max", "pairing", "nested_vmap", "pairwise", "pairwise_y", "pairwise_matmul"}
MUST = [
    # issue 39: a global remainder the pairing route took under shard=True (crashed)
    ("pairing", "shard", "none", "grad"),
    ("pairing_whole", "shard", "none", "grad"),
    ("pairing_argmin", "shard", "auto_P()", "jit"),
    ("pairwise_y", "shard", "none", "none"),
    # found by this matrix: a nested call's carry unsharded against its rows (grad),
    # shard="y" with x split on the axis y is spread over, or on an Explicit mesh not
    # set (crashed); fun over y on another mesh than shard=True's (now a clear error)
    ("nested_map", "shard_scan", "explicit_P()_set", "grad"),
    ("pairwise_y", "shard", "explicit_P(x)_set", "vmap"),
    ("pairwise_y", "shard", "explicit_P(x)", "jvp"),
    ("pairing_whole", "shard_interpret", "explicit_P(x)", "vmap"),
]


def _allowed(route: str, column: str, mesh: str, transform: str) -> bool:
    r = ROUTES[route]
    if not r.floats and transform in ("grad", "jvp", "hvp"):
        return False
    if transform == "hvp" and route not in SECOND_ORDER:
        return False
    return not (r.shard_y and not COLUMNS[column][2])  # shard="y" needs a shard column


def _cover() -> list[tuple[str, str, str, str]]:
    """Every (route, column) with some mesh and transformation, and every pair of
    values of two axes at least once: greedy, each step the allowed case covering
    the most pairs not yet covered (ties: the first in table order)."""
    axes = [list(ROUTES), list(COLUMNS), list(MESHES), TRANSFORMS]
    everything = [c for c in itertools.product(*axes) if _allowed(*c)]
    pairs = lambda c: {(i, c[i], j, c[j]) for i, j in itertools.combinations(range(4), 2)}
    todo = set().union(*map(pairs, everything))
    chosen: list[tuple[str, str, str, str]] = list(MUST)
    for case in MUST:
        todo -= pairs(case)
    for route, column in itertools.product(*axes[:2]):  # every route on every column
        options = [c for c in everything if c[:2] == (route, column)]
        if options and not any(c[:2] == (route, column) for c in chosen):
            best = max(options, key=lambda c: len(pairs(c) & todo))
            chosen.append(best)
            todo -= pairs(best)
    while todo:
        best = max(everything, key=lambda c: len(pairs(c) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


CASES = _cover()


# -- running a case ------------------------------------------------------------------------------
@functools.cache
def _mesh(axis_type):
    return jax.make_mesh((4,), ("x",), axis_types=(axis_type,))


def _inputs(mesh_name: str) -> tuple[Any, Any, Any]:
    axis_type, spec, _ = MESHES[mesh_name]
    n = N_SPLIT if spec == P("x") else N
    x, y = normal(0, (n, 3)), normal(1, (M, 3))
    if axis_type is not None:
        mesh = _mesh(axis_type)
        x = jax.device_put(x, NamedSharding(mesh, spec))
        y = jax.device_put(y, NamedSharding(mesh, P()))
    return x, y, jnp.float32(0.7)


def _host(a):
    return jnp.asarray(np.asarray(a))


def _transformed(f: Callable, transform: str, x, y, s) -> Any:
    """``f(x, y, s)`` under ``transform`` (all but "none" under ``jit``)."""
    loss = lambda x, y, s: sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(f(x, y, s)))
    dx, dy = jnp.full(x.shape, 0.3, x.dtype), jnp.full(y.shape, -0.2, y.dtype)
    if transform == "none":
        return f(x, y, s)
    run = {
        "jit": lambda x, y, s: f(x, y, s),
        "grad": lambda x, y, s: jax.grad(loss, argnums=(0, 1, 2))(x, y, s),
        "jvp": lambda x, y, s: jax.jvp(f, (x, y, s), (dx, dy, jnp.float32(0.5))),
        "vmap": lambda x, y, s: jax.vmap(f, (None, None, 0))(x, y, jnp.stack([s, 2 * s])),
        "hvp": lambda x, y, s: jax.jvp(
            lambda x, s: jax.grad(loss, argnums=(0, 2))(x, y, s), (x, s), (dx, jnp.float32(0.5))
        ),
    }[transform]
    return jax.jit(run)(x, y, s)


@functools.cache
def _expected(route: str, mesh_name: str, transform: str) -> Any:
    x, y, s = (_host(a) for a in _inputs(mesh_name))
    return _transformed(ROUTES[route].plain, transform, x, y, s)


def _context(mesh_name: str) -> contextlib.AbstractContextManager:
    axis_type, _, set_mesh = MESHES[mesh_name]
    return jax.set_mesh(_mesh(axis_type)) if set_mesh else contextlib.nullcontext()


def _shard_kw(route: Route, column: str, mesh_name: str) -> dict:
    _, _, shard = COLUMNS[column]
    if not shard:
        return {}
    axis_type, _, set_mesh = MESHES[mesh_name]
    kw: dict = dict(shard="y" if route.shard_y else True)
    if axis_type is AxisType.Auto and not set_mesh:
        kw["mesh"] = _mesh(axis_type)  # mesh= must be Auto; else the context's or all devices
    return kw


XFAIL: dict[tuple[str, str, str, str], str] = {}  # (route, column, mesh, transform): bug


def _id(case) -> str:
    return "-".join(case)


@pytest.mark.parametrize(
    "route, column, mesh, transform",
    [
        pytest.param(*c, marks=pytest.mark.xfail(strict=True, reason=XFAIL[c])) if c in XFAIL else c
        for c in CASES
    ],
    ids=map(_id, CASES),
)
def test_route_matrix(route, column, mesh, transform):
    r = ROUTES[route]
    _, backend, shard = COLUMNS[column]
    axis_type, _, set_mesh = MESHES[mesh]
    kw = _shard_kw(r, column, mesh)
    x, y, s = _inputs(mesh)
    ours = lambda x, y, s: r.ours(x, y, s, kw)
    with _context(mesh), ajm.config(backend=backend):
        try:
            got = _transformed(ours, transform, x, y, s)
        except NotImplementedError as e:
            if shard and r.closes and axis_type is AxisType.Explicit and not set_mesh:
                # shard=True spreads the rows over all devices (no mesh given or set);
                # fun's y is typed on another mesh: the error says to set that mesh
                assert "call under jax.set_mesh(that mesh)" in str(e), e
                return
            # a forced engine that cannot run the call says so (pallas on CPU)
            assert backend == "pallas" and jax.default_backend() == "cpu", e
            assert "backend='interpret'" in str(e), e
            return
    assert_tree_close(got, _expected(route, mesh, transform), **TOL)


def test_every_registered_engine_has_a_column():
    assert {e.name for e in _engines.engines()} == {e for e, _, _ in COLUMNS.values()}
    backends = {b for _, b, _ in COLUMNS.values()}
    assert backends == {"auto", "scan", "pallas", "interpret"}


@pytest.mark.parametrize("backend", ["auto", "interpret", "shard"])
def test_the_matmul_route_takes_the_matmul_tiles(backend):
    # else pairwise_matmul would test the unrolled tiles twice (XLA's loops on CPU;
    # interpret: the matmul tile kernel as a GPU would run it; shard=True: the matmul
    # tiles on each device's x rows)
    x, y, s = _inputs("none")
    q, k = jnp.tanh(x @ LIFT), jnp.tanh(y @ LIFT)
    f = lambda a, b: (s * jnp.dot(a, b), b)
    shard = backend == "shard"
    with ajm.config(backend="auto" if shard else backend):
        plan = ajm.explain_pairwise(f, q, k, ajm.SOFTMAX_WEIGHTED, tiles=(B, BY), shard=shard)
    assert "matmul" in plan.engine + plan.reason, str(plan)
    assert backend != "interpret" or "matmul tile kernel, interpreted" in plan.reason, str(plan)
    assert not shard or "spread over the devices" in plan.reason, str(plan)


def test_the_cases_cover_every_pair():
    assert set(XFAIL) <= set(CASES)
    covered = {(c[i], c[j]) for c in CASES for i, j in itertools.combinations(range(4), 2)}
    for route, column, mesh, transform in itertools.product(ROUTES, COLUMNS, MESHES, TRANSFORMS):
        if _allowed(route, column, mesh, transform):
            assert (route, column) in covered and (mesh, transform) in covered
            assert (route, mesh) in covered and (route, transform) in covered
            assert (column, mesh) in covered and (column, transform) in covered


# -- the engines' protocol -------------------------------------------------------------------------
METHODS = sorted(m for m in vars(_engines.Engine) if not m.startswith("_"))
BACKEND = {engine: backend for engine, backend, shard in COLUMNS.values() if not shard}
BACKEND["shard"] = "auto"


def _knn(y):
    return lambda v: sqdist(v[:, None], y[None])  # k-NN: a pairing route's ARGMIN


def _finish(plan, states):
    red = plan.reduction
    shapes = jax.tree.leaves((plan.traced or plan.shard.remainder.traced).out_shape)
    items = [leaf.items(red.reads(shapes, leaf)) for leaf in red.leaves]
    per_term = zip(red.leaves, states, items, strict=True)
    return red.finish([leaf.result(s, it) for leaf, s, it in per_term])


@pytest.mark.parametrize(
    "name, shard",
    [(e.name, s) for e in _engines.engines() for s in (False, True) if s or e.name != "shard"],
)
def test_engine_protocol(name, shard):
    """Every registered engine has every method of ``_engines.Engine``, and each gives
    plain JAX's result on a plan it accepted (its states too, from a row offset),
    alone and as the part of a sharded call (``shard=True``: 7 rows, a global
    remainder of 3); an engine that cannot serve a part declines it, saying why."""
    engine = next(e for e in _engines.engines() if e.name == name)
    assert all(callable(getattr(engine, m, None)) for m in METHODS), METHODS
    assert set(METHODS) >= {"accept", "run", "states", "describe_reverse", "auto_draft"}
    x, y = normal(0, (N, 3)), normal(1, (M, 3))
    want = jnp.argmin(sqdist(x[:, None], y[None]), 0)
    with ajm.config(backend=BACKEND[name]):
        call = prepare(_knn(y), x, B, ajm.ARGMIN, ajm.identity, shard, None, {})
        plan = _engines.plan(call)
        if name == "pallas" and jax.default_backend() == "cpu":  # no CPU lowering
            assert "backend='interpret'" in plan.error, str(plan)
            rejected = dict((plan.shard.local if shard else plan).rejected)
            assert rejected["pallas"].startswith("Pallas has no compiled CPU"), str(plan)
            with pytest.raises(NotImplementedError, match="backend='interpret'"):
                _engines.run(plan, call)
            return
        if shard:
            assert plan.engine == "shard", str(plan)
            parts = [plan.shard.local, plan.shard.remainder]
            if name == "pairwise":  # the tiles give results, not states: declined
                why = dict(plan.shard.remainder.rejected)["pairwise"]
                assert why.startswith(_shard.PART), str(plan.shard.remainder)
                assert f"global remainder: pairwise not used: {why}" in str(plan)
            elif name != "shard":
                assert {p.engine for p in parts} == {name}, str(plan)
            engine = _engines.engines()[0]
        else:
            assert plan.engine == name, str(plan)
        assert_tree_close(_engines.run(plan, call), want)
        for offset in (0, 10):  # row indices count from the offset
            states = jax.jit(lambda xs, o=offset: engine.states(plan, xs, o))(call.xs)
            assert_tree_close(_finish(plan, states), want + offset)
        described = engine.describe_reverse(plan, call)
        assert described.engine == plan.engine and described.n == plan.n
        # only the tiles size a batch_size="auto" call themselves, on unsharded rows
        draft = engine.auto_draft(dataclasses.replace(call, batch_size="auto"))
        if name == "pairwise" and not shard:
            assert isinstance(draft, ajm.Plan) and draft.autotune is not None, draft
        else:
            assert draft is None, draft


@pytest.mark.parametrize("placed, shard", [("mesh", False), ("none", False), ("none", True)])
def test_second_order_of_nested_scan_under_explicit_mesh(placed, shard):
    """The second order of a batch_vmap whose fun holds a batch_map of
    jax.vmap(f, (None, 0)) (pairwise scan's form), with remainders outside and inside
    (7 rows by 5), under jax.set_mesh of an Explicit mesh: the chunk's cotangent from
    the inner call's ``jit`` is typed as ``fun`` was traced, and must agree with the
    buffer the outer slice is transposed into (ShardingTypeError in
    dynamic_update_slice when ``fun`` was traced on no mesh and the rows were on the
    mesh). ``none``: rows typed on no mesh inside ``jit``, whose tangents JAX may type on
    the context mesh; ``shard``: the rows spread over it."""
    x, y = normal(0, (N, 3)), normal(1, (5, 3))
    f = lambda a, b: -jnp.sum((a - b) ** 2)
    per_x = lambda xi, y: ajm.batch_map(
        lambda yc: jax.vmap(f, (None, 0))(xi, yc), y, BY, reduction=ajm.LOGSUMEXP
    )
    ours = lambda x: ajm.batch_vmap(per_x, (0, None), batch_size=B, shard=shard)(x, y)
    plain = lambda x: jax.nn.logsumexp(-sqdist(x[:, None], y[None]), 1)
    hvp = lambda g: jax.jit(
        lambda x: jax.jvp(jax.grad(lambda x: jnp.sum(jnp.sin(g(x)))), (x,), (jnp.ones_like(x),))
    )
    mesh = _mesh(AxisType.Explicit)
    want = hvp(plain)(x)
    with jax.set_mesh(mesh), ajm.config(backend="scan"):
        got = hvp(ours)(jax.device_put(x, NamedSharding(mesh, P())) if placed == "mesh" else x)
    assert_tree_close(got, want, **TOL)
