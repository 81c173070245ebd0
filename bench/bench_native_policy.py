"""Whether the native logsumexp and ``remat=False`` pay off where they run, side by side.

Run with ``python -m pytest bench/bench_native_policy.py --benchmark-enable -q -s``.
Each test times its pair alternately in this process (``_timing.interleaved``: 7
rounds in a shuffled order after warm-up, each sample at least 50 ms of calls) and
stores min- and median-based ratios in ``benchmark.extra_info``; pytest-benchmark's
own statistics are for the library's default choice.

- ``test_native_in_batch_map``: a ``batch_map`` logsumexp reduction with the native
  chunk reduction (``config(native="auto")``: chunks of >= 4096 elements) and without
  it (``"off"``), for a materialized chunk (identity), an elementwise producer and
  Sinkhorn's ``(f + g - C(x, y)) / eps``, float32 and float64; ``ratio`` = XLA time /
  native time (> 1: the kernel is faster). With ``bench_native.py::test_chunk_threshold``
  (the same below the threshold, in a ``lax.scan``) this is what
  ``kernels.native.MIN_ELEMENTS`` rests on.
- ``test_chunked_logsumexp_against_unchunked``: issue 28's workload (2^18 rows,
  batch_size 2^14) against ``jax.nn.logsumexp(fun(x), 0)``; target <= 1.1.
- ``test_remat``: ``jax.value_and_grad`` of a Sinkhorn-like logsumexp and of an
  elementwise sum with ``remat=True`` and ``remat=False``: time ratio (False / True)
  and compiled temp memory of each (``docs/guides/gradients.md`` has the table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _private import NATIVE_TARGET, native_status
from _timing import Timing, interleaved, temp_bytes

import adv_jax_math as ajm

EPS = 0.2


@pytest.fixture(autouse=True)
def _x64():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def jitted(make, args, **options):
    """``jax.jit(make())`` compiled under ``config(**options)`` and run once, with its
    compiled temp bytes and whether it calls the kernel. The compiled executable, not
    the jitted function: options are read at trace time, and a jitted function called
    outside the ``config`` block is traced again under the options in force there."""
    with ajm.config(**options):
        lowered = jax.jit(make()).lower(*args)
    compiled = lowered.compile()
    jax.block_until_ready(compiled(*args))
    return compiled, temp_bytes(compiled), NATIVE_TARGET in lowered.as_text()


def side_by_side(benchmark, fs: dict, args, default: str) -> dict[str, Timing]:
    """Time ``fs`` interleaved (when benchmarks are enabled) and benchmark ``default``."""
    t = {}
    if not benchmark.disabled:
        t = interleaved(fs, args, rounds=7, warmup=1, min_sample_s=0.05, shuffle=0)
        for name, timing in t.items():
            print(f"\n  {name}: {timing}", end="")
    benchmark.pedantic(lambda: jax.block_until_ready(fs[default](*args)), rounds=3)
    return t


def ratios(benchmark, t: dict[str, Timing], num: str, den: str, **info) -> None:
    if t:
        info.update(
            ratio=round(t[num].min / t[den].min, 3),
            ratio_median=round(t[num].median / t[den].median, 3),
        )
    benchmark.extra_info.update(info)
    print(f"\n{info}")


def sinkhorn_inputs(n, m, d, dtype):
    k = jax.random.split(jax.random.key(1), 4)
    x, y = jax.random.normal(k[0], (n, d), dtype), jax.random.normal(k[1], (m, d), dtype)
    return x, jax.random.normal(k[2], (n,), dtype), y, jax.random.normal(k[3], (m,), dtype)


def sinkhorn_lse(batch_size):
    """``logsumexp_i((f_i + g_j - |x_i - y_j|^2) / eps)`` over chunks of the rows of x."""

    def run(x, f, y, g):
        def scores(rows):
            xc, fc = rows
            cost = jnp.sum(xc**2, 1)[:, None] + jnp.sum(y**2, 1)[None] - 2 * xc @ y.T
            return (fc[:, None] + g[None] - cost) / EPS

        return ajm.batch_map(scores, (x, f), batch_size, reduction=ajm.LOGSUMEXP)

    return run


def elementwise(fun, batch_size):
    return lambda x: ajm.batch_map(fun, x, batch_size, reduction=ajm.LOGSUMEXP)


WORKLOADS = {
    "identity (2^14, 2^10)": (
        lambda dt: (jax.random.normal(jax.random.key(0), (1 << 14, 1 << 10), dt),),
        lambda: elementwise(lambda v: v, 1 << 12),
    ),
    "-(v^2)/eps (2^14, 2^10)": (
        lambda dt: (jax.random.normal(jax.random.key(0), (1 << 14, 1 << 10), dt),),
        lambda: elementwise(lambda v: -(v**2) / EPS, 1 << 12),
    ),
    "sinkhorn 2000x3 vs 1500x3": (
        lambda dt: sinkhorn_inputs(2000, 1500, 3, dt),
        lambda: sinkhorn_lse(256),
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_native_in_batch_map(benchmark, workload, dtype):
    loaded, why = native_status()
    if not loaded:
        pytest.skip(f"native kernel unavailable: {why}")
    inputs, make = WORKLOADS[workload]
    args = inputs(jnp.dtype(dtype))
    native, _, calls_native = jitted(make, args, native="auto")
    xla, _, calls_xla = jitted(make, args, native="off")
    assert calls_native and not calls_xla
    rtol = 1e-4 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(native(*args), xla(*args), rtol=rtol)
    t = side_by_side(benchmark, {"native": native, "xla": xla}, args, "xla")
    ratios(benchmark, t, "xla", "native", workload=workload, dtype=dtype)


def test_chunked_logsumexp_against_unchunked(benchmark):
    """Issue 28: ``reduction=jnp.logaddexp, chunk_reduction=jax.nn.logsumexp``."""
    c = 2.0 * jax.random.normal(jax.random.key(2), (1 << 18,), jnp.float32)
    fun = lambda v: -0.5 * (v - 0.5) ** 2 + jnp.cos(3 * v)
    lse0 = lambda y: jax.nn.logsumexp(y, 0)
    make = lambda: (
        lambda v: ajm.batch_map(fun, v, 1 << 14, reduction=jnp.logaddexp, chunk_reduction=lse0)
    )
    chunked, _, _ = jitted(make, (c,))
    unchunked = jax.jit(lambda v: lse0(fun(v)))
    np.testing.assert_allclose(chunked(c), unchunked(c), rtol=1e-5)
    t = side_by_side(benchmark, {"chunked": chunked, "unchunked": unchunked}, (c,), "chunked")
    ratios(benchmark, t, "chunked", "unchunked", workload="logsumexp 2^18 rows, 2^14")


REMAT = {
    "sinkhorn lse 2000x3 vs 1500x3": (
        lambda: sinkhorn_inputs(2000, 1500, 3, jnp.float32),
        lambda: jax.value_and_grad(lambda *a: jnp.sum(sinkhorn_lse(256)(*a)), argnums=(0, 1)),
    ),
    "add sin(w c) exp(-c^2/2), 2^20 rows": (
        lambda: (jnp.float32(1.3), jax.random.normal(jax.random.key(0), (1 << 20,))),
        lambda: jax.value_and_grad(
            lambda w, x: ajm.batch_map(
                lambda c: jnp.sin(w * c) * jnp.exp(-0.5 * c * c),
                x,
                1 << 14,
                reduction=jnp.add,
                chunk_reduction=jnp.sum,
            )
        ),
    ),
}


@pytest.mark.parametrize("workload", list(REMAT))
def test_remat(benchmark, workload):
    inputs, make = REMAT[workload]
    args = inputs()
    on, on_bytes, _ = jitted(make, args, remat=True)
    off, off_bytes, _ = jitted(make, args, remat=False)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4), on(*args), off(*args))
    t = side_by_side(benchmark, {"remat=True": on, "remat=False": off}, args, "remat=True")
    ratios(
        benchmark,
        t,
        "remat=False",
        "remat=True",
        workload=workload,
        temp_mib_remat=round(on_bytes / 2**20, 2),
        temp_mib_no_remat=round(off_bytes / 2**20, 2),
    )
