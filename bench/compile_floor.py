"""Where the compile time of a chunked sum goes on XLA:CPU, piece by piece.

The elementwise sum of ``workloads.ELEMENTWISE`` at n = 1000003 (not a multiple of
its batch size) compiled as: the original library; adv_jax_math; and hand-written
loops that add one piece of the engine at a time: a bare ``lax.fori_loop`` summing
``fun`` over equal chunks (the last one overlapping, its repeats counted twice, so
its result is wrong: the floor a one-copy loop can compile in), then the overlap
weights, then the compensated (TwoSum) carry. Run time and relative error against
float64 are printed too, all measured in one process.

Run with ``.venv/bin/python bench/compile_floor.py`` (about a minute).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _timing import compile_fn, interleaved
from cases.workloads import ELEMENTWISE
from jax import lax

N = 1_000_003
REPEATS = 11


def hand_written(weights: bool, compensated: bool):
    """The engine's loop for a sum over all axes, written out, with or without its
    overlap weights and its compensated carry."""
    w, b = ELEMENTWISE, ELEMENTWISE.batch_size
    k = -(-N // b)
    r = k * b - N
    table = np.ones((3, b), np.float32)
    table[1, -r:] = table[2, :r] = 0.5

    def f(params, x):
        def part(i):
            y = w.fun(params, lax.dynamic_slice_in_dim(x, jnp.minimum(i * b, N - b), b))
            if weights:
                place = (i == k - 2).astype(jnp.int32) + 2 * (i == k - 1).astype(jnp.int32)
                y = y * lax.dynamic_index_in_dim(table, place, 0, False)
            return jnp.sum(y)

        def step(i, acc):
            s, c = acc
            p = part(i)
            if not compensated:
                return s + p, c
            t = s + p
            z = t - s
            return t, c + ((s - (t - z)) + (p - z))

        s, c = lax.fori_loop(0, k, step, (jnp.float32(0), jnp.float32(0)))
        return s + c

    return f


def main() -> None:
    args = ELEMENTWISE.inputs(N)
    exact = float(np.sum(np.asarray(ELEMENTWISE.fun(*args), np.float64)))
    programs = {
        "original 1.3": lambda: ELEMENTWISE.program("original 1.3"),
        "adv_jax_math": lambda: ELEMENTWISE.program("ours"),
        "bare loop (wrong result)": lambda: hand_written(False, False),
        "+ overlap weights": lambda: hand_written(True, False),
        "+ weights + TwoSum carry": lambda: hand_written(True, True),
        "unchunked": lambda: ELEMENTWISE.program("plain"),
    }
    compiled = {}
    for name, make in programs.items():
        runs = [compile_fn(make(), args) for _ in range(REPEATS)]
        compiled[name] = min(runs, key=lambda c: c.seconds)
    times = interleaved(
        {name: c.executable for name, c in compiled.items()}, args, seconds=10, shuffle=0
    )
    orig = compiled["original 1.3"].seconds
    print(f"elementwise sum, n={N}, batch_size={ELEMENTWISE.batch_size}, jax {jax.__version__}")
    print(f"min of {REPEATS} compiles (tracing included; XLA part in parentheses)\n")
    print("| program | compile ms | original / this | run ms (min) | rel. error |")
    print("|---|---|---|---|---|")
    for name, c in compiled.items():
        err = abs(float(c.executable(*args)) - exact) / abs(exact)
        print(
            f"| {name} | {c.seconds * 1e3:.0f} ({c.xla_seconds * 1e3:.0f}) | "
            f"{orig / c.seconds:.2f}x | {times[name].min * 1e3:.2f} | {err:.1e} |"
        )


if __name__ == "__main__":
    main()
