"""The native CPU logsumexp (kernels/cpu/logsumexp.cc through adv_jax_math.kernels.native).

Oracles: ``jax.nn.logsumexp`` in float64 and a ``math.fsum`` reference; never our own
code. Tests that need the library fail when it does not load (a broken build must
not pass quietly), unless ``ADV_JAX_MATH_NATIVE=off`` is set.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close

import adv_jax_math as ajm
from adv_jax_math.core import config as _config
from adv_jax_math.engines.scan import TWO_PASSES
from adv_jax_math.kernels import native as _native

NEG_INF, POS_INF, NAN = -np.inf, np.inf, np.nan


@pytest.fixture
def native() -> Iterator[None]:
    """Require the native kernel (mode "auto"); skip only when switched off by env."""
    if os.environ.get("ADV_JAX_MATH_NATIVE", "").strip().lower() == "off":
        pytest.skip("ADV_JAX_MATH_NATIVE=off")
    with _config.config(native="auto"):
        loaded, why = _native.status()
        assert loaded, f"native library did not load: {why}"
        yield


@pytest.fixture
def fresh_load() -> Iterator[None]:
    """Forget the cached load result before and after a test that fakes the library."""
    _native._load.cache_clear()
    try:
        yield
    finally:
        _native._load.cache_clear()


def uses_native(fn, *args) -> bool:
    """Whether the lowered computation calls the native kernel."""
    return _native.TARGET in jax.jit(fn).lower(*args).as_text()


def fsum_reference(x: np.ndarray, axis: int | None) -> np.ndarray:
    """log(sum(exp(x))) along `axis` with an exactly rounded sum (math.fsum), float64."""
    x = np.asarray(x, np.float64)
    if axis is None:
        x, axis = x.reshape(-1, 1), 0
    moved = np.moveaxis(x, axis, -1)
    out = np.empty(moved.shape[:-1])
    for idx in np.ndindex(*out.shape):
        col = moved[idx]
        if np.isnan(col).any():
            out[idx] = np.nan
        elif col.size == 0 or np.all(col == NEG_INF):
            out[idx] = NEG_INF
        elif np.any(col == POS_INF):
            out[idx] = POS_INF
        else:
            top = float(col.max())
            out[idx] = top + math.log(math.fsum(math.exp(v - top) for v in col))
    return out


def random_input(shape, dtype, seed=0, scale=3.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype(dtype)


# Shapes cover: 1-d (narrow path, m == 1), few columns (narrow, gathered), many
# columns (wide), widths that are not multiples of the SIMD width, several row
# segments and column blocks (threaded work items), leading batch dimensions.
CASES = [
    ((1,), 0),
    ((7,), 0),
    ((7,), None),
    ((1000,), 0),
    ((200_000,), 0),
    ((3, 5), 0),
    ((64, 17), 0),
    ((1000, 3), 0),
    ((50_000, 3), 0),
    ((257, 300), 0),
    ((2000, 64), 0),
    ((300, 1500), 0),
    ((2, 3, 4), 0),
    ((2, 3, 4), 1),
    ((2, 3, 4), -1),
    ((5, 6, 7), None),
    ((4, 33, 40), 1),
]


@pytest.mark.parametrize(("shape", "axis"), CASES)
@pytest.mark.usefixtures("native", "x64")
def test_float64_matches_jax_and_fsum(shape, axis):
    x = random_input(shape, np.float64)
    got = np.asarray(_native.logsumexp(x, axis=axis))
    want = np.asarray(jax.nn.logsumexp(jnp.asarray(x), axis=axis))
    assert got.shape == want.shape and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    if x.size <= 20_000:
        np.testing.assert_allclose(got, fsum_reference(x, axis), rtol=1e-14, atol=1e-14)
    assert uses_native(lambda v: _native.logsumexp(v, axis=axis), x)


@pytest.mark.parametrize(("shape", "axis"), CASES)
@pytest.mark.usefixtures("native")
def test_float32_matches_fsum(shape, axis):
    x = random_input(shape, np.float32, seed=1)
    got = np.asarray(_native.logsumexp(x, axis=axis))
    assert got.dtype == np.float32
    want = np.asarray(jax.nn.logsumexp(x, axis=axis))
    np.testing.assert_allclose(got, want, rtol=5e-6, atol=5e-6)
    if x.size <= 20_000:
        np.testing.assert_allclose(got, fsum_reference(x, axis), rtol=2e-6, atol=2e-6)


SPECIAL_COLUMNS = {
    "all -inf": [NEG_INF] * 5,
    "one +inf": [1.0, POS_INF, -2.0, 0.5, 3.0],
    "+inf and -inf": [NEG_INF, POS_INF, NEG_INF, 0.0, 1.0],
    "nan": [1.0, 2.0, NAN, 0.0, -1.0],
    "nan and +inf": [POS_INF, NAN, 1.0, 2.0, 3.0],
    "nan and -inf": [NEG_INF, NAN, NEG_INF, NEG_INF, NEG_INF],
    "some -inf": [NEG_INF, -1.0, NEG_INF, 2.0, NEG_INF],
    "huge": [3e38, 3e38, -3e38, 1e30, 0.0],
    "tiny": [-3e38, -3e38, -1e30, -3e38, -3e38],
    "-inf then finite far below": [NEG_INF, NEG_INF, -1000.0, -1000.0, NEG_INF],
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.usefixtures("native", "x64")
def test_special_values_like_jax(dtype):
    names = sorted(SPECIAL_COLUMNS)
    columns = np.array([SPECIAL_COLUMNS[k] for k in names], dtype).T  # (5, len(names))
    # Spread each column's values over a long axis, so they land in different tiles,
    # segments and lanes, next to ordinary columns (wide path); then the same with a
    # -inf background; then the short columns alone (narrow path, 1-d, axis=None).
    rows = [0, 9, 4_999, 13_333, 19_999]
    wide = random_input((20_000, 3 * len(names)), dtype, seed=2)
    wide[rows, : len(names)] = columns
    wide[:, len(names) : 2 * len(names)] = NEG_INF
    wide[rows, len(names) : 2 * len(names)] = columns
    cases = [(wide, 0), (columns, 0), (np.ascontiguousarray(columns.T), 1)]
    cases += [(columns[:, j], None) for j in range(len(names))]
    cases += [(wide[:, j], 0) for j in range(len(names))]
    rtol = 1e-6 if dtype == np.float32 else 1e-13
    for arr, axis in cases:
        got = np.asarray(_native.logsumexp(arr, axis=axis))
        want = np.asarray(jax.nn.logsumexp(jnp.asarray(arr), axis=axis))
        np.testing.assert_allclose(got, want, rtol=rtol, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.usefixtures("native", "x64")
def test_empty_reduction_is_minus_inf(dtype):
    for shape, axis, out_shape in [((0,), 0, ()), ((0, 3), 0, (3,)), ((4, 0, 2), 1, (4, 2))]:
        got = _native.logsumexp(np.zeros(shape, dtype), axis=axis)
        assert got.shape == out_shape and got.dtype == dtype
        assert np.all(np.asarray(got) == NEG_INF)
    empty_out = _native.logsumexp(np.zeros((3, 0), dtype), axis=0)
    assert empty_out.shape == (0,)
    assert _native.logsumexp(np.zeros((0, 3), dtype), axis=None) == NEG_INF


@pytest.mark.usefixtures("native", "x64")
def test_single_row_is_identity():
    x = random_input((1, 37), np.float64)
    np.testing.assert_allclose(_native.logsumexp(x, axis=0), x[0], rtol=1e-15)
    assert float(_native.logsumexp(np.float64(2.5), axis=None)) == 2.5


@pytest.mark.parametrize("axis", [0, 1, None])
@pytest.mark.usefixtures("native", "x64")
def test_grad_matches_jax(axis):
    x = random_input((40, 6), np.float64, seed=3)
    x[3, 2] = NEG_INF  # a -inf entry gets a zero gradient, as with jax

    def ours(v):
        return jnp.sum(jnp.sin(_native.logsumexp(v, axis=axis)))

    def ref(v):
        return jnp.sum(jnp.sin(jax.nn.logsumexp(v, axis=axis)))

    np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(ref)(x), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(jax.jit(jax.grad(ours))(x), jax.grad(ref)(x), rtol=1e-12, atol=1e-14)
    assert uses_native(jax.grad(ours), x)


@pytest.mark.usefixtures("native", "x64")
def test_jvp_and_hessian_match_jax():
    x = random_input((9, 3), np.float64, seed=4)
    t = random_input((9, 3), np.float64, seed=5)
    y, dy = jax.jvp(lambda v: _native.logsumexp(v, axis=0), (x,), (t,))
    y_ref, dy_ref = jax.jvp(lambda v: jax.nn.logsumexp(v, axis=0), (x,), (t,))
    np.testing.assert_allclose(y, y_ref, rtol=1e-14)
    np.testing.assert_allclose(dy, dy_ref, rtol=1e-12, atol=1e-14)
    v = x[:, 0]
    np.testing.assert_allclose(
        jax.hessian(lambda u: _native.logsumexp(u, axis=0))(v),
        jax.hessian(lambda u: jax.nn.logsumexp(u, axis=0))(v),
        rtol=1e-10,
        atol=1e-14,
    )


@pytest.mark.usefixtures("native", "x64")
def test_vmap_matches_jax():
    x = random_input((5, 300, 20), np.float64, seed=6)
    # Mapped axis first and in the middle; the kernel sees the batch as leading dims.
    got = jax.vmap(lambda v: _native.logsumexp(v, axis=0))(x)
    np.testing.assert_allclose(got, jax.nn.logsumexp(x, axis=1), rtol=1e-13)
    got = jax.vmap(lambda v: _native.logsumexp(v, axis=0), in_axes=2)(x)
    np.testing.assert_allclose(got, jax.nn.logsumexp(x, axis=0).T, rtol=1e-13)
    got = jax.jit(jax.vmap(lambda v: _native.logsumexp(v, axis=None)))(x)
    np.testing.assert_allclose(got, jax.nn.logsumexp(x, axis=(1, 2)), rtol=1e-13)
    got = jax.vmap(jax.vmap(lambda v: _native.logsumexp(v, axis=0)))(x.reshape(5, 10, 30, 20))
    np.testing.assert_allclose(got, jax.nn.logsumexp(x.reshape(5, 10, 30, 20), axis=2), rtol=1e-13)
    assert uses_native(jax.vmap(lambda v: _native.logsumexp(v, axis=0)), x)


@pytest.mark.usefixtures("native")
def test_results_do_not_depend_on_threads_or_batching(monkeypatch):
    x = random_input((6000, 700), np.float32, seed=7)  # many work items
    fn = jax.jit(lambda v: _native.logsumexp(v, axis=0))
    threaded = np.asarray(fn(x))
    monkeypatch.setenv("ADV_JAX_MATH_NATIVE_THREADS", "1")  # read by the kernel per call
    single = np.asarray(fn(x))
    monkeypatch.delenv("ADV_JAX_MATH_NATIVE_THREADS")
    np.testing.assert_array_equal(threaded, single)
    batched = np.asarray(jax.vmap(fn)(np.stack([x, x[::-1], x])))
    np.testing.assert_array_equal(batched[0], threaded)
    np.testing.assert_array_equal(batched[2], threaded)


@pytest.mark.usefixtures("native")
def test_kernel_rejects_bad_calls_with_clear_errors():
    call = jax.ffi.ffi_call
    x = np.ones((5, 3), np.float32)
    bad = [
        (
            call(_native.TARGET, jax.ShapeDtypeStruct((3,), np.int32)),
            np.ones((5, 3), np.int32),
            {"reduced_rank": np.int64(1), "rest_rank": np.int64(1)},
            "only float32 and float64",
        ),
        (
            call(_native.TARGET, jax.ShapeDtypeStruct((4,), np.float32)),
            x,
            {"reduced_rank": np.int64(1), "rest_rank": np.int64(1)},
            r"input \(5, 3\) float32, output \(4,\) float32.*without its reduced dimensions",
        ),
        (
            call(_native.TARGET, jax.ShapeDtypeStruct((3,), np.float32)),
            x,
            {"reduced_rank": np.int64(2), "rest_rank": np.int64(1)},
            "reduced_rank \\+ rest_rank <= the input rank",
        ),
        (
            call(_native.TARGET, jax.ShapeDtypeStruct((3,), np.float64)),
            x,
            {"reduced_rank": np.int64(1), "rest_rank": np.int64(1)},
            "output dtype must equal the input dtype",
        ),
    ]
    for fn, arg, attrs, message in bad:
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(jax.jit(lambda v, fn=fn, attrs=attrs: fn(v, **attrs))(arg))


@pytest.mark.usefixtures("native")
def test_other_dtypes_fall_back_to_jax():
    for x in [np.arange(12, dtype=np.int32).reshape(4, 3), jnp.ones((4, 3), jnp.bfloat16)]:
        np.testing.assert_array_equal(_native.logsumexp(x, axis=0), jax.nn.logsumexp(x, axis=0))
        assert not uses_native(lambda v: _native.logsumexp(v, axis=0), x)


def test_axis_validation():
    with pytest.raises(ValueError, match="out of bounds"):
        _native.logsumexp(np.ones((2, 3)), axis=2)
    with pytest.raises(TypeError, match="must be an int or None"):
        _native.logsumexp(np.ones((2, 3)), axis=(0, 1))


@pytest.mark.usefixtures("native", "fresh_load")
def test_first_load_inside_a_trace_still_uses_native():
    x = np.ones((8, 4), np.float32)
    assert uses_native(lambda v: _native.logsumexp(v, axis=0), x)


@pytest.mark.usefixtures("native", "fresh_load")
def test_registration_happens_once(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *a, **k: calls.append(a))
    for _ in range(2):
        _native._load.cache_clear()
        assert _native.status()[0]
    assert calls == []  # already registered by the first load in this process


# --- when batch_map's chunk loop runs the native kernel -----------------------

_loaded, _why = _native.status()
ENGINES = {
    "scan": dict(backend="scan"),
    "interpret": dict(backend="interpret"),
    "shard": dict(backend="scan", shard=True),
}


@pytest.mark.skipif(not _loaded, reason=f"native logsumexp not loaded: {_why}")
@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize(
    "reduction, chunk_reduction, axis",
    [(jnp.logaddexp, jax.nn.logsumexp, None), (ajm.LOGSUMEXP, ajm.identity, 0)],
    ids=["all axes", "axis 0"],
)
def test_batch_map_uses_native_for_large_chunks(engine, reduction, chunk_reduction, axis):
    # 4400 rows (1100 per device with shard): chunks of 1100 rows x 4 = 4400 >=
    # MIN_ELEMENTS elements reduce natively, forward and reverse; chunks of at most
    # 300 rows (294 or 275 rows x 4: the old 1024-element rule took the kernel there,
    # measured slower) do not. The fused kernel (interpret) never calls it (where the
    # kernel cannot run, jax < 0.10, the scan engine serves and does). fun mixes the
    # columns (a matmul): an elementwise fun is computed again per pass instead (see
    # test_elementwise_fun_is_read_twice_not_stored).
    opts = dict(ENGINES[engine])
    shard = opts.pop("shard", False)
    if shard and jax.device_count() != 4:
        pytest.skip("needs the 4 virtual CPU devices of conftest")
    x = random_input((4400, 4), np.float32, seed=8)
    kw = dict(reduction=reduction, chunk_reduction=chunk_reduction, shard=shard)
    m = np.eye(4, dtype=np.float32) + 0.1
    g = lambda v: -((v @ m) ** 2) / 0.1
    loss = lambda w, run, bs: jnp.sum(run(lambda v: jnp.sin((v @ m) * w), x, bs, **kw))
    plain = lambda f, x, bs, **_: jax.nn.logsumexp(f(x), axis=axis)
    with _config.config(native="auto", **opts):
        for batch_size, large in [(1100, True), (300, False)]:
            plan = ajm.explain(g, x, batch_size, **kw)
            plan = plan.shard.local if shard else plan  # each device's chunks
            native = large and plan.engine == "scan"
            f = lambda x, bs=batch_size: ajm.batch_map(g, x, bs, **kw)
            assert uses_native(f, x) == native, batch_size
            said = [n for n in plan.notes if n.startswith("native logsumexp")]
            if plan.engine != "scan":  # explain() speaks of the kernel only where it may run
                assert not said, plan.notes
            else:
                assert len(said) == 1 and ("reduces each chunk" in said[0]) == native, said
            assert_tree_close(jax.jit(f)(x), jax.nn.logsumexp(g(x), axis=axis))
            vg = lambda w, bs=batch_size: jax.value_and_grad(loss)(w, ajm.batch_map, bs)
            assert uses_native(vg, 0.5) == native, batch_size
            want = jax.value_and_grad(loss)(0.5, plain, batch_size)
            assert_tree_close(jax.jit(vg)(0.5), want, rtol=1e-5, atol=1e-4)
    if engine == "scan":
        with _config.config(native="off", **opts):
            plan = ajm.explain(g, x, 1100, **kw)
        assert "native logsumexp not used: disabled" in str(plan), str(plan)
        # rows the chunks do not divide: 4 chunks of 1025 rows (x 4 >= MIN_ELEMENTS),
        # the last overlapping the one before by a row, all reduced natively
        odd = random_input((4099, 4), np.float32, seed=9)
        f = lambda x: ajm.batch_map(g, x, 1100, **kw)
        with _config.config(native="auto", **opts):
            assert uses_native(f, odd)
            assert_tree_close(jax.jit(f)(odd), jax.nn.logsumexp(g(odd), axis=axis))


@pytest.mark.skipif(not _loaded, reason=f"native logsumexp not loaded: {_why}")
@pytest.mark.parametrize("shard", [False, True], ids=["scan", "shard"])
@pytest.mark.parametrize("axis", [None, 0], ids=["all axes", "axis 0"])
def test_elementwise_fun_is_read_twice_not_stored(shard, axis):
    # An elementwise fun is computed once per pass of the logsumexp fold (max, then the
    # shifted sum), each fused into its reduction: no native call on a stored chunk, two
    # copies of fun's cos in the compiled loop; values and gradients as plain JAX, and
    # explain() says why.
    if shard and jax.device_count() != 4:
        pytest.skip("needs the 4 virtual CPU devices of conftest")
    x = random_input((4400, 4), np.float32, seed=8)
    reduction, chunk_reduction = (
        (jnp.logaddexp, jax.nn.logsumexp) if axis is None else (ajm.LOGSUMEXP, ajm.identity)
    )
    kw = dict(reduction=reduction, chunk_reduction=chunk_reduction, shard=shard)
    g = lambda w: lambda v: jnp.cos(3 * v) * w - 0.5 * v**2
    f = lambda w, x: ajm.batch_map(g(w), x, 1100, **kw)
    with _config.config(native="auto", backend="scan"):
        plan = ajm.explain(g(1.5), x, 1100, **kw)
        plan = plan.shard.local if shard else plan
        assert TWO_PASSES in plan.notes, plan.notes
        assert not uses_native(lambda x: f(1.5, x), x)
        hlo = jax.jit(f).lower(1.5, x).compile().as_text()
        assert hlo.count(" cosine(") == 2, hlo
        want = lambda w: jax.nn.logsumexp(g(w)(x), axis=axis)
        assert_tree_close(jax.jit(f)(1.5, x), want(1.5))
        loss = lambda w: jnp.sum(f(w, x))
        assert_tree_close(jax.jit(jax.grad(loss))(1.5), jax.grad(lambda w: jnp.sum(want(w)))(1.5))


@pytest.mark.usefixtures("native")
def test_decision_says_whether_and_why(monkeypatch):
    runs = "native logsumexp reduces each chunk"
    cases = [
        ("auto", (4096, 16), np.float32, True, f"{runs} (4096x16 float32): side by side"),
        ("require", (1 << 20,), jnp.float64, True, f"{runs} (1048576 float64)"),
        ("auto", (256, 4), np.float32, False, "a chunk of 1024 elements (256x4) is below 4096"),
        ("off", (4096, 16), np.float32, False, "disabled by adv_jax_math.config(native='off')"),
        ("auto", (1 << 20,), jnp.bfloat16, False, "float32/float64 chunks, not bfloat16"),
        ("auto", (1 << 20,), np.int32, False, "float32/float64 chunks, not int32"),
        ("auto", (1 << 20,), "not a dtype", False, "'not a dtype' is not a dtype"),
    ]
    for mode, shape, dtype, expected, why in cases:
        with _config.config(native=mode):
            got = _native.decision(shape, dtype)
            assert got[0] is expected and why in got[1], (mode, shape, dtype, got)
            assert _native.worth_it(shape, dtype) is expected
    # a library that does not load: "auto" says why and leaves it to XLA
    _native._load.cache_clear()
    monkeypatch.setattr(_native, "_find_library", lambda: (None, "library not found"))
    try:
        with _config.config(native="auto"):
            assert _native.decision((4096, 16), np.float32) == (
                False,
                "native logsumexp not used: library not found",
            )
    finally:
        _native._load.cache_clear()


# --- the library is absent, disabled or broken -----------------------------------


@pytest.mark.usefixtures("fresh_load")
def test_fallback_when_library_is_absent(monkeypatch):
    reason = "library not found (package built without CMake?): reinstall"
    monkeypatch.setattr(_native, "_find_library", lambda: (None, reason))
    x = random_input((100, 3), np.float32)
    with _config.config(native="auto"):
        assert _native.status() == (False, reason)
        np.testing.assert_array_equal(_native.logsumexp(x, axis=0), jax.nn.logsumexp(x, axis=0))
        assert not uses_native(lambda v: _native.logsumexp(v, axis=0), x)
    with _config.config(native="require"), pytest.raises(RuntimeError, match="library not found"):
        _native.logsumexp(x, axis=0)


@pytest.mark.usefixtures("fresh_load")
def test_explicit_library_path_that_is_missing_or_broken(monkeypatch, tmp_path):
    monkeypatch.setenv(_native.ENV_LIB, str(tmp_path / "missing.so"))
    with _config.config(native="auto"):
        loaded, why = _native.status()
        assert not loaded and "is not a file" in why and _native.ENV_LIB in why
        _native._load.cache_clear()
        junk = tmp_path / "junk.so"
        junk.write_bytes(b"not a shared library")
        monkeypatch.setenv(_native.ENV_LIB, str(junk))
        loaded, why = _native.status()
        assert not loaded and why.startswith(f"cannot load {junk}")


def test_disabled_by_env_or_config(monkeypatch):
    x = random_input((100, 3), np.float32)
    monkeypatch.setenv("ADV_JAX_MATH_NATIVE", "off")
    assert _native.status() == (False, "disabled by ADV_JAX_MATH_NATIVE=off")
    assert not uses_native(lambda v: _native.logsumexp(v, axis=0), x)
    monkeypatch.setenv("ADV_JAX_MATH_NATIVE", "auto")
    with _config.config(native="off"):
        assert _native.status() == (False, "disabled by adv_jax_math.config(native='off')")
        assert not uses_native(lambda v: _native.logsumexp(v, axis=0), x)
