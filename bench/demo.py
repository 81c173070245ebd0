"""The main job: headline workloads, chunked vs unchunked, in one table.

Run with ``make demo``. For each workload: the backend adv_jax_math chose, run
time (min of 5 after warm-up), compiled temp memory, and the largest relative
error against the unchunked computation.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import adv_jax_math as ajm

from workloads import HEADLINE


def best_time(f, args, repeats=5):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def temp_mib(f, args):
    stats = f.lower(*args).compile().memory_analysis()
    return stats.temp_size_in_bytes / 2**20


def rel_error(a, b):
    errs = [
        float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ]
    return max(errs)


def main():
    print(
        f"adv_jax_math {ajm.__version__} | jax {jax.__version__} | "
        f"{jax.default_backend()} ({jax.device_count()} device(s))"
    )
    header = ("workload", "backend", "time", "plain", "temp MiB", "plain MiB", "rel err")
    rows = []
    for make in HEADLINE:
        w = make()
        chunked, plain = jax.jit(w.chunked), jax.jit(w.plain)
        backend = w.explain(*w.args).backend if w.explain else "scan (batch_vmap)"
        rows.append(
            (
                w.name,
                backend,
                f"{best_time(chunked, w.args) * 1e3:.1f} ms",
                f"{best_time(plain, w.args) * 1e3:.1f} ms",
                f"{temp_mib(chunked, w.args):.1f}",
                f"{temp_mib(plain, w.args):.1f}",
                f"{rel_error(chunked(*w.args), plain(*w.args)):.1e}",
            )
        )
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
