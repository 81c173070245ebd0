"""``batch_size="auto"`` against a sweep of fixed power-of-two batch sizes.

Two workloads, both ``jax.value_and_grad`` of a chunked sum, over n = 16384 rows:

* MLP per-example gradients: the summed squared per-example gradient norms of a
  32 -> 128 -> 128 tanh MLP (``vmap(grad)`` inside each chunk), differentiated with
  respect to the parameters (DESIGN.md section 7);
* N-body energy gradient (``workloads.nbody("forces")``-style): the energy of a
  Biot-Savart field of the n sources at 256 targets, differentiated with respect to
  the targets.

For memory budgets of 8, 32 and 128 MiB: the compiled temp memory of the whole
call with ``batch_size="auto"`` must be within the budget, and its run time at most
1.2x the fastest fixed batch size (16 ... 8192) whose compiled temp memory fits the
same budget (ratios measured in one process, interleaved). Planning cost: the first
trace with "auto" against the compile time of the chosen program; the second trace
(a cache hit) against a trace with the chosen fixed size.

``python bench/bench_autotune.py`` writes ``bench/results/autotune_table.md``;
``pytest bench/bench_autotune.py`` checks the goals.
"""

from __future__ import annotations

import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import pytest
from _timing import compile_fn, interleaved

import adv_jax_math as ajm
from adv_jax_math import _autotune

from workloads import pair_field

N = 16384
BUDGETS_MIB = (8, 32, 128)
SWEEP = tuple(2**k for k in range(4, 14))  # 16 ... 8192
MIB = 2**20


# -- workloads: functions of (params, x) -> (value, grad) -----------------------------


def _mlp_inputs(n: int = N, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    params = {
        "w1": jax.random.normal(k[0], (32, 128)) / 32**0.5,
        "b1": jnp.zeros(128),
        "w2": jax.random.normal(k[1], (128, 128)) / 128**0.5,
        "b2": jnp.zeros(128),
    }
    return params, (jax.random.normal(k[2], (n, 32)), jax.random.normal(k[3], (n, 128)))


def _mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.sum((jnp.tanh(h @ params["w2"] + params["b2"]) - y) ** 2)


def mlp(batch_size):
    """value_and_grad of the summed squared per-example gradient norms."""

    def total(params, data):
        def chunk(rows):
            g = jax.vmap(jax.grad(_mlp_loss), (None, 0, 0))(params, *rows)
            return sum(
                jnp.sum(leaf**2, axis=tuple(range(1, leaf.ndim))) for leaf in jax.tree.leaves(g)
            )

        return ajm.batch_map(chunk, data, batch_size, reduction=jnp.add, chunk_reduction=jnp.sum)

    return jax.value_and_grad(total)


def _nbody_inputs(n: int = N, seed: int = 0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (256, 3)), jax.random.normal(k2, (n, 3))


def nbody(batch_size):
    """value_and_grad (targets) of the energy of the field of n sources."""

    def energy(targets, sources):
        field = ajm.batch_map(
            lambda s: pair_field(targets, s),
            sources,
            batch_size,
            reduction=jnp.add,
            chunk_reduction=jnp.add.reduce,
        )
        return jnp.sum(field**2)

    return jax.value_and_grad(energy)


WORKLOADS = {
    "MLP per-example grads": (mlp, _mlp_inputs),
    "N-body energy grad": (nbody, _nbody_inputs),
}


# -- measurement -----------------------------------------------------------------------


@functools.cache
def sweep(name: str) -> dict[int, tuple[int, float, float]]:
    """Fixed batch sizes: ``{B: (temp bytes, seconds per call, compile seconds)}``."""
    make, inputs = WORKLOADS[name]
    args = inputs()
    compiled = {b: compile_fn(make(b), args) for b in SWEEP}
    times = interleaved({b: c.executable for b, c in compiled.items()}, args, rounds=3)
    return {b: (compiled[b].temp_bytes, times[b].min, compiled[b].seconds) for b in SWEEP}


@functools.cache
def auto(name: str, budget_mib: int) -> dict:
    """``batch_size="auto"`` under a budget: choice, memory, time, planning cost."""
    make, inputs = WORKLOADS[name]
    args = inputs()
    _autotune.clear_cache()
    with ajm.config(memory_budget=budget_mib * MIB):
        first = compile_fn(make("auto"), args)
        decision = next(reversed(_autotune._MEMORY.values()))
        t0 = time.perf_counter()
        jax.jit(make("auto")).trace(*args)
        second = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.jit(make(decision.batch_size)).trace(*args)
    fixed_trace = time.perf_counter() - t0
    chosen = compile_fn(make(decision.batch_size), args)
    fits = {b: v for b, v in sweep(name).items() if v[0] <= budget_mib * MIB}
    best = min(fits, key=lambda b: fits[b][1]) if fits else None
    fs = {"auto": first.executable}
    if best is not None:
        fs["best"] = compile_fn(make(best), args).executable
    times = interleaved(fs, args, rounds=5)
    return {
        "B": decision.batch_size,
        "temp": first.temp_bytes,
        "time": times["auto"].min,
        "best": best,
        "best_time": times["best"].min if best is not None else None,
        "planning": decision.seconds,
        "compile_chosen": chosen.seconds,
        "second": second,
        "fixed_trace": fixed_trace,
    }


CASES = [(w, b) for w in WORKLOADS for b in BUDGETS_MIB]


@pytest.mark.parametrize(("name", "budget"), CASES, ids=[f"{w}-{b}MiB" for w, b in CASES])
def test_auto_fits_budget_and_is_fast(name, budget):
    r = auto(name, budget)
    assert r["temp"] <= budget * MIB, r
    assert r["best"] is not None and r["time"] <= 1.2 * r["best_time"], r


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_planning_cost(name):
    r = auto(name, 32)
    assert r["planning"] <= 3 * r["compile_chosen"], r
    assert r["second"] <= r["fixed_trace"] + 0.05, r  # a cache hit: as cheap as a fixed size


def table() -> str:
    lines = [
        "| workload | budget | auto: B | auto: temp | auto: time | best fixed B (fits) | "
        "its temp | its time | auto / best | planning (1st trace) | compile of chosen | "
        "2nd trace (fixed-B trace) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, budget in CASES:
        r, s = auto(name, budget), sweep(name)
        best = r["best"]
        lines.append(
            f"| {name} | {budget} MiB | {r['B']} | {r['temp'] / MIB:.1f} MiB | "
            f"{r['time'] * 1e3:.1f} ms | {best} | {s[best][0] / MIB:.1f} MiB | "
            f"{r['best_time'] * 1e3:.1f} ms | {r['time'] / r['best_time']:.2f} | "
            f"{r['planning']:.2f} s | {r['compile_chosen']:.2f} s | "
            f"{r['second'] * 1e3:.0f} ms ({r['fixed_trace'] * 1e3:.0f} ms) |"
        )
    lines += ["", "Fixed-size sweep (value_and_grad, n = 16384): temp MiB / ms per call", ""]
    lines.append("| B | " + " | ".join(WORKLOADS) + " |")
    lines.append("|---|" + "---|" * len(WORKLOADS))
    for b in SWEEP:
        cells = [
            f"{sweep(w)[b][0] / MIB:.1f} MiB / {sweep(w)[b][1] * 1e3:.1f} ms" for w in WORKLOADS
        ]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = table()
    print(text)
    out = pathlib.Path(__file__).parent / "results" / "autotune_table.md"
    out.write_text(f"{jax.devices()[0].device_kind}, jax {jax.__version__}\n\n{text}")
