"""Sharded vs unsharded batch_map on 2 CPU devices, side by side in one process.

Run: ``make bench`` (or ``.venv/bin/python -m pytest bench/bench_shard.py
--benchmark-enable``). Uses the virtual devices of the repository conftest.py;
the ratio (unsharded time / sharded time) is stored in ``extra_info``.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import adv_jax_math as ajm

from workloads import field_contributions


def _times(f, args, repeats=15):
    jax.block_until_ready(f(*args))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        out.append(time.perf_counter() - t0)
    return out


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (repository conftest.py)")
def test_sharded_vs_unsharded_nbody(benchmark):
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    k1, k2 = jax.random.split(jax.random.key(0))
    targets, sources = jax.random.normal(k1, (256, 3)), jax.random.normal(k2, (2**15 + 3, 3))

    def make(shard):
        def run(t, s):
            return ajm.batch_map(
                lambda s: field_contributions(t, s),
                s,
                1024,
                reduction=jnp.add,
                chunk_reduction=jnp.add.reduce,
                shard=shard,
                mesh=mesh if shard else None,
            )

        return jax.jit(run)

    sharded, plain = make(True), make(False)
    ts, tp = [], []
    for _ in range(3):  # interleave to share the machine's noise
        ts += _times(sharded, (targets, sources), 5)
        tp += _times(plain, (targets, sources), 5)
    ratio = min(tp) / min(ts)
    benchmark.extra_info.update(
        sharded_min_ms=min(ts) * 1e3,
        unsharded_min_ms=min(tp) * 1e3,
        sharded_median_ms=statistics.median(ts) * 1e3,
        unsharded_median_ms=statistics.median(tp) * 1e3,
        speedup=ratio,
    )
    print(
        f"\nsharded {min(ts) * 1e3:.1f} ms, unsharded {min(tp) * 1e3:.1f} ms, speedup {ratio:.2f}x"
    )
    benchmark.pedantic(sharded, args=(targets, sources), rounds=5, warmup_rounds=1)
