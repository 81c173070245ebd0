"""The main job: headline workloads, chunked vs unchunked, in one table.

Run with ``make demo`` (``.venv/bin/python bench/demo.py``). For each workload of
``workloads.HEADLINE``: the engine adv_jax_math chose, run time (min of 5 after a
warm-up call), compiled temp memory, and the largest relative error against the
unchunked computation (the workload's oracle).
"""

from __future__ import annotations

import jax
from _timing import measure
from cases import max_rel_error
from cases.workloads import HEADLINE

import adv_jax_math as ajm


def main():
    print(
        f"adv_jax_math {ajm.__version__} | jax {jax.__version__} | "
        f"{jax.default_backend()} ({jax.device_count()} device(s))"
    )
    header = ("workload", "n", "B", "engine", "time", "plain", "temp MiB", "plain MiB", "rel err")
    rows = []
    for w in HEADLINE:
        args = w.inputs()
        chunked, plain = measure(w.program(), args), measure(w.oracle(), args)
        rows.append(
            (
                w.name,
                str(jax.tree.leaves(args[1])[0].shape[0]),
                str(w.batch_size),
                w.explain(*args).engine,
                f"{chunked.time.min * 1e3:.1f} ms",
                f"{plain.time.min * 1e3:.1f} ms",
                f"{chunked.temp_bytes / 2**20:.1f}",
                f"{plain.temp_bytes / 2**20:.1f}",
                f"{max_rel_error(chunked.out, plain.out):.1e}",
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
