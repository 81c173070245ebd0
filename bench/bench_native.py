"""Native CPU logsumexp vs ``jax.nn.logsumexp``, as ratios measured side by side.

Run with ``python -m pytest bench/bench_native.py --benchmark-enable -q``. Each test
times both functions alternately in this process (``_timing.interleaved``: best of 7
rounds after warm-up, each sample at least 50 ms of calls) and stores ``ratio`` = XLA
time / native time in ``benchmark.extra_info``; pytest-benchmark's own statistics are
for the native call. The native kernel is private (``_private``: ``native_*``).

- ``test_reduction``: one jitted reduction over axis 0 of a (2^14, 2^10) array. The
  target is ratio >= 1.5 in float32.
- ``test_chunk_threshold``: the per-chunk reduction inside ``lax.scan``, as the scan
  engine runs it, for several chunk sizes; ``native_worth_it`` (the chunk loop's
  rule: >= 4096 elements) is recorded.
- ``test_batch_map_end_to_end``: a ``batch_map`` logsumexp reduction with the native
  chunk reduction and with ``config(native="off")`` (more cases in
  ``bench_native_policy.py``).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _private import NATIVE_TARGET, native_logsumexp, native_status, native_worth_it
from _timing import interleaved

import adv_jax_math as ajm

TARGET_F32 = 1.5


@pytest.fixture(autouse=True)
def _x64_and_native():
    loaded, why = native_status()
    if not loaded:
        pytest.skip(f"native kernel unavailable: {why}")
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def record(benchmark, native, xla, arg, **info) -> float:
    """Time both side by side; store and print XLA time / native time."""
    t = interleaved({"native": native, "xla": xla}, (arg,), rounds=7, warmup=2, min_sample_s=0.05)
    native_s, xla_s = t["native"].min, t["xla"].min
    ratio = xla_s / native_s
    benchmark.extra_info.update(
        native_ms=round(native_s * 1e3, 4), xla_ms=round(xla_s * 1e3, 4), ratio=round(ratio, 3)
    )
    benchmark.extra_info.update(info)
    print(f"\n{info}: native {native_s * 1e3:.3f} ms, xla {xla_s * 1e3:.3f} ms, ratio {ratio:.2f}")
    return ratio


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reduction(benchmark, dtype):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1 << 14, 1 << 10)), dtype)
    native = jax.jit(lambda v: native_logsumexp(v, axis=0))
    xla = jax.jit(lambda v: jax.nn.logsumexp(v, axis=0))
    np.testing.assert_allclose(native(x), xla(x), rtol=1e-5 if dtype == "float32" else 1e-12)
    if not benchmark.disabled:
        ratio = record(benchmark, native, xla, x, shape=x.shape, dtype=dtype)
        if dtype == "float32" and ratio < TARGET_F32:
            warnings.warn(f"float32 ratio {ratio:.2f} < target {TARGET_F32}", stacklevel=1)
    benchmark.pedantic(lambda: jax.block_until_ready(native(x)), rounds=10, warmup_rounds=1)


@pytest.mark.parametrize("chunk", [64, 256, 1024, 4096])
@pytest.mark.parametrize(("columns", "axis"), [(1, 0), (16, 0), (16, None), (256, None)])
def test_chunk_threshold(benchmark, chunk, columns, axis):
    """Mixture-style log-likelihood chunks reduced inside a scan (float32, 2^16 rows)."""
    n = 1 << 16
    x = jnp.asarray(np.random.default_rng(1).normal(size=(n,)), jnp.float32)
    mu = jnp.linspace(-1.0, 1.0, columns, dtype=jnp.float32)
    init = jnp.full((columns,) if axis == 0 else (), -jnp.inf, jnp.float32)

    def engine(lse):
        def body(carry, xc):
            y = -0.5 * (xc[:, None] - mu[None, :]) ** 2
            return jnp.logaddexp(carry, lse(y, axis)), None

        return jax.jit(lambda v: jax.lax.scan(body, init, v.reshape(n // chunk, chunk))[0])

    native = engine(lambda y, a: native_logsumexp(y, axis=a))
    xla = engine(lambda y, a: jax.nn.logsumexp(y, axis=a))
    np.testing.assert_allclose(native(x), xla(x), rtol=1e-5)
    if not benchmark.disabled:
        record(
            benchmark,
            native,
            xla,
            x,
            chunk_elements=chunk * columns,
            worth_it=native_worth_it((chunk, columns), jnp.float32),
            axis=axis,
        )
    benchmark.pedantic(lambda: jax.block_until_ready(native(x)), rounds=5, warmup_rounds=1)


def test_batch_map_end_to_end(benchmark):
    """The batch_map logsumexp workload (axis 0 of (2^16, 256) float32 rows, chunks of
    2^12 rows) with the native chunk reduction and without it."""
    x = jnp.linspace(-3, 3, 1 << 24, dtype=jnp.float32).reshape(1 << 16, 256)
    chunked = lambda x: ajm.batch_map(lambda v: v * 1.5, x, 1 << 12, reduction=ajm.LOGSUMEXP)
    # Options are read at trace time: compile under each (a jitted function called
    # outside the block would be traced again under the options in force there).
    lowered = jax.jit(chunked).lower(x)  # native="auto": chunks of 2^20 elements
    with ajm.config(native="off"):
        xla = jax.jit(chunked).lower(x).compile()
    native = lowered.compile()
    assert NATIVE_TARGET in lowered.as_text()
    np.testing.assert_allclose(native(x), xla(x), rtol=1e-5)
    if not benchmark.disabled:
        record(benchmark, native, xla, x, workload="batch_map logsumexp")
    benchmark.pedantic(lambda: jax.block_until_ready(native(x)), rounds=5, warmup_rounds=1)
