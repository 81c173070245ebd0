"""Sharded vs unsharded batch_map on 2 CPU devices, side by side in one process.

Run: ``make bench`` (or ``.venv/bin/python -m pytest bench/bench_shard.py
--benchmark-enable``). Uses the virtual devices of the repository conftest.py and
the N-body field of ``workloads.NBODY`` (n = 2^15 + 3); the ratio (unsharded time /
sharded time) is stored in ``extra_info``.
"""

import jax
import pytest
from _timing import compile_fn, interleaved
from cases.workloads import NBODY
from jax.sharding import AxisType

import adv_jax_math as ajm


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (repository conftest.py)")
def test_sharded_vs_unsharded_nbody(benchmark):
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    args = NBODY.inputs(2**15 + 3)

    def engine(shard):
        def run(fun, x, batch_size, **reduce):
            return ajm.batch_map(
                fun, x, batch_size, **reduce, shard=shard, mesh=mesh if shard else None
            )

        return compile_fn(NBODY.program(run), args).executable

    fs = {"sharded": engine(True), "unsharded": engine(False)}
    t = interleaved(fs, args, rounds=15)  # interleaved to share the machine's noise
    ratio = t["unsharded"].min / t["sharded"].min
    benchmark.extra_info.update(
        sharded_min_ms=t["sharded"].min * 1e3,
        unsharded_min_ms=t["unsharded"].min * 1e3,
        sharded_median_ms=t["sharded"].median * 1e3,
        unsharded_median_ms=t["unsharded"].median * 1e3,
        speedup=ratio,
    )
    print(f"\nsharded {t['sharded']}, unsharded {t['unsharded']}, speedup {ratio:.2f}x")
    benchmark.pedantic(fs["sharded"], args=args, rounds=5, warmup_rounds=1)
