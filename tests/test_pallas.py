"""The fused Pallas engine, in interpret mode on CPU, against plain-JAX oracles.

Oracles are the unchunked computation: ``jnp.sum`` / ``jnp.add.reduce`` /
``jnp.max`` / ``jax.nn.logsumexp`` ... of ``fun(xs)``, and ``jax.grad`` of that.
Lowering tests target an abstract NVIDIA H100 (Pallas Triton) and an abstract
TPU v5 lite (Pallas Mosaic), so they run without accelerators.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from adv_jax_math import _pallas
from adv_jax_math._monoid import ADD, LOGSUMEXP, MAX, MIN, MonoidReduction
from adv_jax_math._pallas import contains_kernel, fused_reduce, kernel_problem

ORACLES = {
    ("add", None): jnp.sum,
    ("add", 0): jnp.add.reduce,
    ("max", None): jnp.max,
    ("max", 0): jnp.maximum.reduce,
    ("min", None): jnp.min,
    ("min", 0): jnp.minimum.reduce,
    ("logsumexp", None): jax.nn.logsumexp,
    ("logsumexp", 0): functools.partial(jax.nn.logsumexp, axis=0),
}
REDUCTIONS = [MonoidReduction(m, axis) for m in (ADD, MAX, MIN, LOGSUMEXP) for axis in (None, 0)]
RIDS = [f"{r.monoid.name}-{r.axis}" for r in REDUCTIONS]
TOL = {"float32": 3e-5, "float64": 1e-12, "bfloat16": 2e-2, "int32": 0}


def oracle(fun, xs, reduction):
    """The unchunked computation in plain JAX."""
    return jax.tree.map(ORACLES[reduction.monoid.name, reduction.axis], fun(xs))


def fused(fun, xs, reduction, max_rows=8):
    return fused_reduce(fun, xs, reduction, max_rows=max_rows, interpret=True)


def assert_close(actual, expected, tol=None):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.shape == e.shape, (a.shape, e.shape)
        assert a.dtype == e.dtype, (a.dtype, e.dtype)
        t = TOL.get(np.dtype(e.dtype).name, 1e-5) if tol is None else tol
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=t, atol=t
        )


W4 = jnp.array([0.5, -1.0, 2.0, 0.25], jnp.float32)


def _normal(shape, dtype=jnp.float32, seed=0):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


# name: (fun, xs builder taking n, needs x64)
CASES = {
    "(N,)": (lambda x: jnp.sin(x) * 2.0, lambda n: _normal((n,)), False),
    "(N,4) closure": (lambda x: x * W4, lambda n: _normal((n, 4)), False),
    "(N,3)": (lambda x: jnp.cos(x) + 1.0, lambda n: _normal((n, 3)), False),
    "(N,4,8)": (lambda x: x * x - 0.5, lambda n: _normal((n, 4, 8)), False),
    "pytree": (
        lambda d: {"p": d["a"] * d["b"][:, None], "q": (jnp.exp(d["b"]),)},
        lambda n: {"a": _normal((n, 4)), "b": _normal((n,), seed=1)},
        False,
    ),
    "bf16": (lambda x: x * 2 + 1, lambda n: _normal((n, 4), jnp.bfloat16), False),
    "int32": (
        lambda x: x * 3 - 7,
        lambda n: jax.random.randint(jax.random.key(2), (n, 4), -50, 50),
        False,
    ),
    "f64": (jnp.sin, lambda n: _normal((n, 4), jnp.float64), True),
}


def _x64(enabled):
    return jax.enable_x64(True) if enabled else contextlib.nullcontext()


@pytest.mark.parametrize("reduction", REDUCTIONS, ids=RIDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_oracle(case, reduction):
    fun, make, x64 = CASES[case]
    with _x64(x64):
        xs = make(37)  # 5 blocks of 8 rows, the last one masked
        assert_close(fused(fun, xs, reduction), oracle(fun, xs, reduction))


@pytest.mark.parametrize("reduction", REDUCTIONS, ids=RIDS)
@pytest.mark.parametrize("n,max_rows", [(32, 8), (5, None), (1, 4)])
def test_block_counts(reduction, n, max_rows):
    fun, make, _ = CASES["(N,4) closure"]
    xs = make(n)
    assert_close(fused(fun, xs, reduction, max_rows), oracle(fun, xs, reduction))


@pytest.mark.parametrize("monoid", [ADD, MAX, MIN, LOGSUMEXP], ids=lambda m: m.name)
def test_negative_values_are_not_mixed_with_padding(monoid):
    # Masked rows must take the identity, never zeros: max of negatives, min of positives.
    xs = -jnp.abs(_normal((19, 4))) - 1.0 if monoid is not MIN else jnp.abs(_normal((19, 4))) + 1
    r = MonoidReduction(monoid, None)
    assert_close(fused(lambda x: x, xs, r), oracle(lambda x: x, xs, r))


# --------------------------------------------------------------------------- #
# logsumexp and max edge cases
# --------------------------------------------------------------------------- #


def test_logsumexp_infinities():
    r_all, r_rows = MonoidReduction(LOGSUMEXP, None), MonoidReduction(LOGSUMEXP, 0)
    ident = lambda x: x
    all_neg = jnp.full((21,), -jnp.inf)
    assert_close(fused(ident, all_neg, r_all), jax.nn.logsumexp(all_neg))
    some_pos = jnp.zeros((21,)).at[13].set(jnp.inf)
    assert_close(fused(ident, some_pos, r_all), jax.nn.logsumexp(some_pos))
    cols = _normal((21, 4)).at[:, 2].set(-jnp.inf).at[3, 1].set(jnp.inf).at[:17, 0].set(-jnp.inf)
    assert_close(fused(ident, cols, r_rows), jax.nn.logsumexp(cols, axis=0))
    big = _normal((21, 4)) * 1e3  # no overflow from the per-block shift
    assert_close(fused(ident, big, r_all), jax.nn.logsumexp(big), tol=1e-4)


def test_max_min_ties_forward_and_grad():
    xs = jnp.array([[1.0, 3.0], [3.0, 0.0], [2.0, 3.0], [3.0, -1.0], [0.0, 3.0]])
    w = jnp.array([1.0, 1.0])
    for monoid, axis in [(MAX, None), (MAX, 0), (MIN, 0)]:
        r = MonoidReduction(monoid, axis)

        def loss(x, w, engine, r=r):
            return jnp.sum(engine(lambda v: v * w, x, r) * jnp.array([1.0, 2.0]))

        assert_close(fused(lambda v: v * w, xs, r, 2), oracle(lambda v: v * w, xs, r))
        got = jax.grad(loss, argnums=(0, 1))(xs, w, lambda f, x, r: fused(f, x, r, 2))
        want = jax.grad(loss, argnums=(0, 1))(xs, w, oracle)
        assert_close(got, want)


# --------------------------------------------------------------------------- #
# Closures, transforms and gradients
# --------------------------------------------------------------------------- #


def test_closures_over_concrete_int_bool_and_numpy_constants():
    idx = jnp.arange(4)  # an int constant array
    mask = np.array([True, False, True, True])  # a NumPy bool constant
    scale = np.float32(1.5)
    fun = lambda x: jnp.where(mask, x * idx * scale, 0.0) + W4
    xs = _normal((23, 4))
    for r in (MonoidReduction(ADD, 0), MonoidReduction(LOGSUMEXP, None)):
        assert_close(fused(fun, xs, r), oracle(fun, xs, r))


def test_closure_over_traced_scalar_under_jit():
    r = MonoidReduction(LOGSUMEXP, 0)
    xs = _normal((29, 4))

    @jax.jit
    def f(s, xs):
        return fused(lambda x: jnp.sin(x) * s + s * s, xs, r)

    assert_close(f(1.7, xs), oracle(lambda x: jnp.sin(x) * 1.7 + 1.7 * 1.7, xs, r))
    lowered = jax.jit(f).lower(1.7, xs).as_text()
    assert contains_kernel(lowered, "cpu")


@pytest.mark.parametrize("reduction", REDUCTIONS, ids=RIDS)
def test_grad_wrt_inputs_and_closed_over_params(reduction):
    xs = _normal((27, 4))
    w, b = W4, jnp.float32(0.3)
    cot = jnp.array([1.0, -2.0, 0.5, 3.0])

    def loss(xs, w, b, engine):
        out = engine(lambda x: jnp.tanh(x * w) + b * x, xs, reduction)
        return jnp.sum(out * cot) if out.ndim else out

    got = jax.grad(loss, argnums=(0, 1, 2))(xs, w, b, fused)
    want = jax.grad(loss, argnums=(0, 1, 2))(xs, w, b, oracle)
    assert_close(got, want)


def test_grad_pytree_bf16_int_and_params_only():
    xs = {"a": _normal((21, 4)), "i": jnp.arange(21 * 4).reshape(21, 4) % 5}
    w = W4

    def loss(w, engine, r):
        fun = lambda d: {"s": d["a"] * w + d["i"], "c": jnp.cos(d["a"]) * w}
        out = engine(fun, xs, r)
        return sum(jnp.sum(v) for v in jax.tree.leaves(out))

    for r in (MonoidReduction(ADD, 0), MonoidReduction(LOGSUMEXP, None)):
        assert_close(jax.grad(loss)(w, fused, r), jax.grad(loss)(w, oracle, r))
    bf = _normal((21, 4), jnp.bfloat16)
    r = MonoidReduction(LOGSUMEXP, None)
    g = jax.grad(lambda x: fused(jnp.sin, x, r))(bf)
    assert_close(g, jax.grad(lambda x: oracle(jnp.sin, x, r))(bf))


def test_grad_under_jit():
    r = MonoidReduction(LOGSUMEXP, None)
    xs = _normal((19, 4))
    f = lambda w, e: e(lambda x: x * w, xs, r)
    assert_close(jax.jit(jax.grad(f), static_argnums=1)(W4, fused), jax.grad(f)(W4, oracle))


@pytest.mark.slow
def test_second_order():
    r = MonoidReduction(LOGSUMEXP, None)
    xs = _normal((19, 4))
    f = lambda w, e: e(lambda x: x * w, xs, r)
    assert_close(jax.hessian(f)(W4, fused), jax.hessian(f)(W4, oracle), tol=1e-4)


def test_jvp():
    r = MonoidReduction(MAX, 0)
    xs, t = _normal((22, 4)), _normal((22, 4), seed=3)
    f = lambda e: lambda x: e(lambda v: jnp.sin(v) * W4, x, r)
    assert_close(jax.jvp(f(fused), (xs,), (t,)), jax.jvp(f(oracle), (xs,), (t,)))


def test_vmap_over_inputs_and_params():
    r = MonoidReduction(LOGSUMEXP, 0)
    xs = _normal((3, 22, 4))
    ws = _normal((3, 4), seed=5)
    f = lambda e: lambda x, w: e(lambda v: jnp.sin(v) * w, x, r)
    assert_close(jax.vmap(f(fused))(xs, ws), jax.vmap(f(oracle))(xs, ws))
    assert_close(
        jax.vmap(f(fused), (None, 0))(xs[0], ws), jax.vmap(f(oracle), (None, 0))(xs[0], ws)
    )
    loss = lambda e: lambda x, w: jnp.sum(f(e)(x, w))
    g = jax.vmap(jax.grad(loss(fused), argnums=(0, 1)))(xs, ws)
    assert_close(g, jax.vmap(jax.grad(loss(oracle), argnums=(0, 1)))(xs, ws))


def test_fun_traced_once():
    calls = []

    def fun(x):
        calls.append(x.shape)
        return jnp.exp(x)

    r = MonoidReduction(ADD, None)
    xs = _normal((37, 4))
    jax.grad(lambda x: fused(fun, x, r))(xs)
    assert len(calls) == 1
    calls.clear()
    assert kernel_problem(fun, xs, r, platform="cuda", max_rows=None) is None
    calls.clear()  # the probe traced fun once; the kernel reuses what it learned
    run = lambda x: fused_reduce(fun, x, r, max_rows=None, interpret=False, platform="cuda")
    with use_abstract_mesh(_mesh("cuda")):
        jax.jit(run).trace(xs).lower(lowering_platforms=("cuda",))
    assert len(calls) == 1


@pytest.mark.slow
def test_gradient_memory_does_not_grow_with_intermediates():
    # fun's intermediates are 64x its input; the checkpointed scan keeps only inputs.
    r = MonoidReduction(ADD, None)
    proj = _normal((4, 64))

    def temp_bytes(n):
        xs = jax.ShapeDtypeStruct((n, 4), jnp.float32)
        g = jax.jit(jax.grad(lambda x: fused(lambda v: jnp.tanh(v @ proj), x, r, 256)))
        return g.lower(xs).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(4096), temp_bytes(16384)
    grown = large - small
    inputs = (16384 - 4096) * 4 * 4
    assert grown < 8 * inputs, (small, large)  # O(n * 64 * 4) bytes would be 64x inputs


# --------------------------------------------------------------------------- #
# Errors and reasons
# --------------------------------------------------------------------------- #


def test_errors_say_what_was_given():
    r = MonoidReduction(ADD, None)
    with pytest.raises(ValueError, match=r"different leading sizes \[4, 5\]"):
        fused(lambda d: d, (jnp.ones(4), jnp.ones(5)), r)
    with pytest.raises(ValueError, match="n == 0"):
        fused(jnp.sin, jnp.ones((0, 2)), r)
    with pytest.raises(ValueError, match="one output row per input row"):
        fused(lambda x: jnp.sum(x, axis=0), jnp.ones((9, 2)), r)
    with pytest.raises(ValueError, match="interpret=True"):
        fused_reduce(jnp.sin, jnp.ones((9, 2)), r, max_rows=None, interpret=False, platform="cpu")
    with pytest.raises(ValueError, match="max_rows=0"):
        fused(jnp.sin, jnp.ones((9, 2)), r, max_rows=0)
    assert "platform='metal'" in kernel_problem(
        jnp.sin, jnp.ones(3), r, platform="metal", max_rows=None
    )
    assert "0-d" in kernel_problem(jnp.sin, jnp.float32(1), r, platform="cpu", max_rows=None)
    assert "could not be traced" in kernel_problem(
        lambda x: x + jnp.ones((10, 2)), jnp.ones((10, 2)), r, platform="cpu", max_rows=None
    )


# --------------------------------------------------------------------------- #
# The compiled kernel, where a GPU or TPU is present (bench/device_check.sh)
# --------------------------------------------------------------------------- #

PLATFORM = jax.default_backend()
needs_accelerator = pytest.mark.accelerator  # deselected on CPU by the root conftest.py
FALLS_BACK = {"gpu": {"(N,3)"}, "tpu": {"f64"}}  # cases the kernel must decline, with a reason
DEVICE_TOL = {"float32": 2e-4, "float64": 1e-10, "bfloat16": 3e-2, "int32": 0}


def _device_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, (a, e)
        t = DEVICE_TOL[np.dtype(e.dtype).name]
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), t, t)


@needs_accelerator
@pytest.mark.parametrize("reduction", REDUCTIONS, ids=RIDS)
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_kernel_matches_oracle(case, reduction):
    fun, make, x64 = CASES[case]
    with _x64(x64):
        xs = make(1037)
        problem = kernel_problem(fun, xs, reduction, platform=PLATFORM, max_rows=256)
        if case in FALLS_BACK[PLATFORM]:
            assert problem is not None
            return
        assert problem is None, problem
        got = fused_reduce(fun, xs, reduction, max_rows=256, interpret=False)
        _device_close(got, oracle(fun, xs, reduction))


@needs_accelerator
@pytest.mark.parametrize("reduction", REDUCTIONS, ids=RIDS)
def test_compiled_kernel_many_blocks_grad_and_vmap(reduction):
    xs = _normal(((1 << 25) + 5,))  # Triton: 2^12 blocks of 8192 rows, looped in pairs
    square = lambda v: v * v
    assert kernel_problem(square, xs, reduction, platform=PLATFORM, max_rows=None) is None
    got = jax.jit(lambda x: fused_reduce(square, x, reduction, max_rows=None, interpret=False))
    _device_close(got(xs), oracle(square, xs, reduction))
    small = _normal((3, 4099, 4))

    def loss(w, x, engine):
        return jnp.sum(engine(lambda v: jnp.tanh(v * w), x, reduction))

    engine = functools.partial(fused_reduce, max_rows=1024, interpret=False)
    got = jax.vmap(jax.grad(loss), (None, 0, None))(W4, small, engine)
    _device_close(got, jax.vmap(jax.grad(loss), (None, 0, None))(W4, small, oracle))


# --------------------------------------------------------------------------- #
# Lowering for accelerators that are not present
# --------------------------------------------------------------------------- #

TARGETS = [pytest.param("cuda", id="H100-triton"), pytest.param("tpu", id="TPUv5e-mosaic")]
S = jax.ShapeDtypeStruct
_TG = np.linspace(-1, 1, 128 * 4, dtype=np.float32).reshape(128, 4)


def _nbody(src):
    """Field of sources (positions padded to 4 coordinates, masses) at 128 targets."""
    d = _TG[None, :, :] - src["pos"][:, None, :]
    r2 = jnp.sum(d * d, axis=-1, keepdims=True) + 1e-3
    return d * (src["m"][:, None, None] / (r2 * jnp.sqrt(r2)))


def _mesh(platform):
    if platform == "tpu":
        device = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    else:
        device = AbstractDevice(
            device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="cuda"
        )
    return AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)


LSE, SUM0 = MonoidReduction(LOGSUMEXP, None), MonoidReduction(ADD, 0)
# name: (fun, xs, reduction, max_rows, x64, GPU outcome, TPU outcome); None = takes the kernel
LOWERING = {
    "elementwise (N,)": (jnp.sin, S((4096,), jnp.float32), LSE, None, False, None, None),
    "2^25 rows: blocks looped in-kernel": (
        lambda x: x + 1.0,
        S((1 << 25,), jnp.float32),
        LSE,
        None,
        False,
        None,
        None,
    ),
    "closure (N,4)": (lambda x: x * W4, S((1000, 4), jnp.float32), SUM0, 64, False, None, None),
    "(N,4,8) max": (
        jnp.cos,
        S((300, 4, 8), jnp.float32),
        MonoidReduction(MAX, None),
        None,
        False,
        None,
        None,
    ),
    "pytree bf16/int": (
        lambda d: (d["a"] * 2, d["i"] + 1),
        {"a": S((999, 4), jnp.bfloat16), "i": S((999, 4), jnp.int32)},
        MonoidReduction(MAX, 0),
        None,
        False,
        None,
        None,
    ),
    "n-body": (
        _nbody,
        {"pos": S((5000, 4), jnp.float32), "m": S((5000,), jnp.float32)},
        SUM0,
        2048,
        False,
        None,
        None,
    ),
    "(N,3)": (jnp.sin, S((1000, 3), jnp.float32), LSE, None, False, "power-of-two", None),
    "float64": (jnp.sin, S((1000, 4), jnp.float64), LSE, None, True, None, "64-bit"),
    "sort": (
        lambda x: jnp.sort(x, axis=1),
        S((1000, 4), jnp.float32),
        LSE,
        None,
        False,
        "lowering failed",
        "lowering failed",
    ),
    "slice": (
        lambda x: x[:, 1:3] * x[:, :2],
        S((1000, 4), jnp.float32),
        LSE,
        None,
        False,
        "slice",
        None,
    ),
    "batch_size 4 (N,4)": (
        jnp.sin,
        S((100, 4), jnp.float32),
        LSE,
        4,
        False,
        None,
        "at least 8 rows",
    ),
    "batch_size 64 (N,)": (
        jnp.sin,
        S((1000,), jnp.float32),
        LSE,
        64,
        False,
        None,
        "at least 128 rows",
    ),
}


@pytest.mark.parametrize("platform", TARGETS)
@pytest.mark.parametrize("name", list(LOWERING))
def test_lowering_on_abstract_devices(name, platform):
    fun, xs, r, max_rows, x64, gpu, tpu = LOWERING[name]
    expected = gpu if platform == "cuda" else tpu
    with _x64(x64), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        problem = kernel_problem(fun, xs, r, platform=platform, max_rows=max_rows)
        if expected is not None:
            assert problem is not None and expected in problem, problem
            return
        assert problem is None, problem
        with use_abstract_mesh(_mesh(platform)):
            run = lambda x: fused_reduce(
                fun, x, r, max_rows=max_rows, interpret=False, platform=platform
            )
            text = jax.jit(run).trace(xs).lower(lowering_platforms=(platform,)).as_text()
    assert contains_kernel(text, platform)
    assert not contains_kernel(text, "tpu" if platform == "cuda" else "cuda")
    assert not [w for w in caught if "Triton backend is deprecated" in str(w.message)]


@pytest.mark.parametrize("platform", TARGETS)
def test_gradient_lowers_on_abstract_devices(platform):
    xs = S((4096, 4), jnp.float32)
    r = MonoidReduction(LOGSUMEXP, 0)

    def loss(w, x):
        out = fused_reduce(lambda v: v * w, x, r, max_rows=1024, interpret=False, platform=platform)
        return jnp.sum(out)

    with use_abstract_mesh(_mesh(platform)), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = jax.jit(jax.grad(loss)).trace(W4, xs).lower(lowering_platforms=(platform,)).as_text()
    assert contains_kernel(text, platform)
    assert not [w for w in caught if "Triton backend is deprecated" in str(w.message)]


def test_block_rows_follow_platform_rules():
    r = MonoidReduction(ADD, None)
    rows = functools.partial(_pallas.kernel_block_rows, jnp.sin, reduction=r)
    x1, x2 = S((1_000_000,), jnp.float32), S((1_000_000, 4), jnp.float32)
    for x in (x1, x2):
        gpu = rows(x, platform="gpu", max_rows=None)
        assert gpu & (gpu - 1) == 0 and gpu * np.prod(x.shape[1:]) <= 1 << 20
        assert rows(x, platform="gpu", max_rows=3000) <= 3000
    assert rows(x1, platform="tpu", max_rows=None) % 1024 == 0
    assert rows(x1, platform="tpu", max_rows=300) == 256
    assert rows(x2, platform="tpu", max_rows=300) == 296
    assert rows(S((37, 4), jnp.float32), platform="tpu", max_rows=None) == 37  # one whole block
    assert rows(x2, platform="cpu", max_rows=1000) == 1000
