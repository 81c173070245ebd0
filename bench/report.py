"""Measure every workload of ``bench_compare`` with every engine; write ``bench/results``.

Run with ``.venv/bin/python bench/report.py`` (about 5-10 minutes on 2 cores).

All engines of a case are measured in one process, interleaved round by round in a
shuffled order (a call that follows a big one, like the unchunked N-body, runs ~20%
slower: a fixed order would bias the ratios), so load from other processes hits them
alike; ratios are reported from min times and from median times. Metrics per case and engine:

* run time: min and median of >= 15 calls after a warm-up call;
* compile time: ``jax.jit(f).lower(*args).compile()`` of a fresh function object
  (tracing included), min of 5;
* traces: how many times ``fun`` ran in Python during one such compile;
* temp memory: ``memory_analysis().temp_size_in_bytes`` of the compiled function;
* error: max |result - plain| / max |plain| against the unchunked computation.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import matplotlib
import numpy as np
from bench_compare import CASES, GRAD_NBODY, NBODY, Case, temp_bytes

import adv_jax_math as ajm

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import NullLocator

HERE = Path(__file__).resolve().parent
OUT = HERE / "results"
ORIG, OURS, NO_REMAT = "original 1.3", "ours", "ours remat=False"
COMPILE_REPEATS = 5
MIN_ROUNDS, MAX_ROUNDS, SECONDS_PER_CASE = 15, 60, 10.0
BATCH_SIZES = (256, 512, 1024, 2048, 4096, 8192)  # time vs batch_size, N-body n = 2**15
MEMORY_NS = (4096, 8192, 16384, 32768, 65536)  # grad memory vs n, N-body


def call_time(f, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def run_times(fs: dict, args: tuple, min_rounds=MIN_ROUNDS, max_rounds=MAX_ROUNDS) -> dict:
    """Interleaved timings ``{engine: [seconds]}`` after one warm-up call each."""
    round_s = sum(call_time(f, args) for f in fs.values())
    rounds = min(max_rounds, max(min_rounds, math.ceil(SECONDS_PER_CASE / max(round_s, 1e-9))))
    times = {e: [] for e in fs}
    order, rng = list(fs), random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for e in order:
            times[e].append(call_time(fs[e], args))
    return times


def rel_error(out, ref) -> float:
    errs = []
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs.append(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))
    return float(max(errs))


def compile_once(case: Case, engine: str, args: tuple) -> tuple:
    """Fresh function object: ``(traces of fun, compiled, total seconds, XLA compile seconds)``."""
    calls = []
    f = case.function(engine, lambda: calls.append(1))
    t0 = time.perf_counter()
    lowered = jax.jit(f).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return len(calls), compiled, t2 - t0, t2 - t1


def measure(case: Case) -> list[dict]:
    args = case.args()
    compile_s = {e: [] for e in case.engines}
    xla_s = {e: [] for e in case.engines}
    traces, compiled = {}, {}
    order, rng = list(case.engines), random.Random(1)
    for _ in range(COMPILE_REPEATS):
        rng.shuffle(order)
        for e in order:
            traces[e], compiled[e], total, xla = compile_once(case, e, args)
            compile_s[e].append(total)
            xla_s[e].append(xla)
    ref = compiled["plain"](*args)
    times = run_times(compiled, args)
    return [
        {
            "workload": case.workload.name,
            "n": case.n,
            "batch_size": case.workload.batch_size,
            "divisible": case.divisible,
            "grad": case.workload.grad,
            "engine": e,
            "time_min_s": min(times[e]),
            "time_median_s": statistics.median(times[e]),
            "runs": len(times[e]),
            "compile_min_s": min(compile_s[e]),
            "compile_median_s": statistics.median(compile_s[e]),
            "xla_compile_min_s": min(xla_s[e]),
            "traces": traces[e],
            "temp_bytes": temp_bytes(compiled[e]),
            "rel_error": rel_error(compiled[e](*args), ref),
        }
        for e in case.engines
    ]


def ratios(records: list[dict]) -> list[dict]:
    """Per case: the original's time (memory) over ours; > 1 means we are faster (smaller)."""
    by = {(r["workload"], r["n"], r["engine"]): r for r in records}
    out = []
    for (w, n, e), r in by.items():
        if e not in (OURS, NO_REMAT):
            continue
        o = by[(w, n, ORIG)]
        out.append(
            {
                "workload": w,
                "n": n,
                "divisible": r["divisible"],
                "grad": r["grad"],
                "engine": e,
                "time_min": o["time_min_s"] / r["time_min_s"],
                "time_median": o["time_median_s"] / r["time_median_s"],
                "compile_min": o["compile_min_s"] / r["compile_min_s"],
                "memory": o["temp_bytes"] / max(r["temp_bytes"], 1),
            }
        )
    return out


def time_vs_batch() -> dict:
    engines = (OURS, ORIG, "lax.map", "plain")
    result = {e: [] for e in engines}
    for b in BATCH_SIZES:
        case = Case(dataclasses.replace(NBODY, batch_size=b), 2**15)
        args = case.args()
        fs = {e: compile_once(case, e, args)[1] for e in engines}
        times = run_times(fs, args, min_rounds=5, max_rounds=5)
        for e in engines:
            result[e].append(min(times[e]))
    return {"workload": NBODY.name, "n": 2**15, "batch_sizes": list(BATCH_SIZES), "min_s": result}


def grad_memory_vs_n() -> dict:
    engines = (OURS, NO_REMAT, ORIG, "plain")
    cases = [Case(GRAD_NBODY, n) for n in MEMORY_NS]
    mem = {
        e: [temp_bytes(compile_once(case, e, case.args())[1]) for case in cases] for e in engines
    }
    return {
        "workload": GRAD_NBODY.name,
        "batch_size": GRAD_NBODY.batch_size,
        "ns": list(MEMORY_NS),
        "temp_bytes": mem,
    }


def goals(rat: list[dict], memory: dict) -> list[dict]:
    """Each goal: met when both the min- and median-based ratios meet it, "borderline" if one."""

    def verdict(values: list[float], bound: float) -> str:
        return {2: "yes", 1: "borderline", 0: "no"}[sum(v >= bound for v in values)]

    def timing(name: str, rows: list[dict], bound: float) -> dict:
        worst = min(rows, key=lambda r: min(r["time_min"], r["time_median"]))
        values = [worst["time_min"], worst["time_median"]]
        where = f"{worst['workload']}, n={worst['n']}, {worst['engine']}"
        return {
            "goal": name,
            "met": verdict(values, bound),
            "value": f"{range_text(*values)} ({where})",
        }

    fwd = [r for r in rat if not r["grad"]]
    geo = [
        math.exp(statistics.mean(math.log(r[k]) for r in fwd)) for k in ("time_min", "time_median")
    ]
    nondiv = min(
        (r for r in rat if not r["divisible"] and r["engine"] == OURS),
        key=lambda r: r["compile_min"],
    )
    mem, ns = memory["temp_bytes"], memory["ns"]
    ours, orig = mem[OURS], mem[ORIG]
    return [
        timing("forward run time >= 0.9x original, every case", fwd, 0.9),
        {
            "goal": "forward run time, geometric mean >= 1.0x",
            "met": verdict(geo, 1.0),
            "value": range_text(*geo),
        },
        timing(
            "gradient run time >= 0.75x original (remat on)",
            [r for r in rat if r["grad"] and r["engine"] == OURS],
            0.75,
        ),
        timing(
            "gradient run time >= 0.9x original (remat off)",
            [r for r in rat if r["engine"] == NO_REMAT],
            0.9,
        ),
        {
            "goal": "compile time >= 1.5x faster than original, non-divisible n",
            "met": "yes" if nondiv["compile_min"] >= 1.5 else "no",
            "value": f"{nondiv['compile_min']:.2f}x ({nondiv['workload']}, n={nondiv['n']})",
        },
        {
            "goal": f"N-body gradient temp memory at n={ns[-1]} >= 10x below original",
            "met": "yes" if orig[-1] >= 10 * ours[-1] else "no",
            "value": f"{orig[-1] / ours[-1]:.0f}x ({mib(ours[-1])} vs {mib(orig[-1])} MiB)",
        },
        {
            "goal": f"N-body gradient temp memory flat in n (max/min <= 1.1, n={ns[0]}..{ns[-1]})",
            "met": "yes" if max(ours) <= 1.1 * min(ours) else "no",
            "value": f"{mib(min(ours))}..{mib(max(ours))} MiB",
        },
    ]


def mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    models = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": models[0] if models else platform.processor(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "platform": f"{jax.default_backend()} ({jax.device_count()} device(s))",
        "adv_jax_math": ajm.__version__,
        "commit": subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=HERE,
        ).stdout.strip(),
        "load_average_start": os.getloadavg(),
    }


def table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def range_text(a: float, b: float) -> str:
    lo, hi = sorted((a, b))
    return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"


def n_text(r: dict) -> str:
    return f"{r['n']}" + ("" if r["divisible"] else " *")


def goal_table(goals: list[dict]) -> str:
    bold = lambda met: met if met == "yes" else f"**{met}**"
    return table(
        [["goal", "met", "worst case"]] + [[g["goal"], bold(g["met"]), g["value"]] for g in goals]
    )


def markdown(data: dict) -> str:
    m = data["machine"]
    head = [
        "workload",
        "n",
        "engine",
        "time min / median (ms)",
        "compile (XLA) ms",
        "traces",
        "temp MiB",
        "rel err",
    ]
    rows = [
        [
            r["workload"],
            n_text(r),
            r["engine"],
            f"{r['time_min_s'] * 1e3:.2f} / {r['time_median_s'] * 1e3:.2f}",
            f"{r['compile_min_s'] * 1e3:.0f} ({r['xla_compile_min_s'] * 1e3:.0f})",
            str(r["traces"]),
            mib(r["temp_bytes"]),
            f"{r['rel_error']:.1e}",
        ]
        for r in data["records"]
    ]
    rat = [
        [
            r["workload"],
            n_text(r),
            r["engine"],
            range_text(r["time_min"], r["time_median"]),
            f"{r['compile_min']:.2f}x",
            f"{r['memory']:.1f}x",
        ]
        for r in data["ratios"]
    ]
    mem = data["grad_memory_vs_n"]
    mm = [
        [str(n), *(mib(v[i]) for v in mem["temp_bytes"].values())] for i, n in enumerate(mem["ns"])
    ]
    return "\n\n".join(
        [
            "# Benchmarks: adv_jax_math vs adv-jax-math 1.3, jax.lax.map and plain XLA",
            f"Machine: {m['nproc']} cores ({m['cpu']}), {m['platform']}; Python {m['python']}, "
            f"jax {m['jax']}, jaxlib {m['jaxlib']}; adv_jax_math at commit {m['commit']}; "
            f"load average {m['load_average_start'][0]:.1f} "
            f"at start, {m['load_average_end'][0]:.1f} at the end (other processes share the "
            f"cores). Generated by `.venv/bin/python bench/report.py` in {data['seconds']:.0f} s.",
            "`*`: n is not a multiple of batch_size. Times: min / median of interleaved runs. "
            "Compile: `jax.jit(f).lower(*args).compile()` of a fresh function object, tracing "
            "included, min of 5 (in parentheses: its XLA compile part). Traces: Python calls of "
            "`fun` during that compile. Temp MiB: "
            "`memory_analysis().temp_size_in_bytes`. Rel err: max |out - plain| / max |plain|.",
            "## Goals",
            "Speed goals use ratios of the original's time to ours, shown as the range between "
            "the min-based and the median-based ratio; a goal is met when both meet it.",
            goal_table(data["goals"]),
            "## Ratios: original 1.3 / ours (> 1: ours faster or smaller)",
            table([["workload", "n", "engine", "run time", "compile", "temp memory"], *rat]),
            "## All measurements",
            table([head, *rows]),
            f"## {mem['workload']}: temp memory (MiB) vs n, batch_size {mem['batch_size']}",
            table([["n", *mem["temp_bytes"]], *mm]),
            "![time vs batch_size](time_vs_batch.png)",
            "![gradient memory vs n](grad_memory_vs_n.png)",
        ]
    )


def readme_section(data: dict) -> str:
    rat, m = data["ratios"], data["machine"]
    mem, ns = data["grad_memory_vs_n"]["temp_bytes"], data["grad_memory_vs_n"]["ns"]

    def span(key: str, keep) -> str:
        vals = [r[key] for r in rat if keep(r)]
        return range_text(min(vals), max(vals))

    def vs(engine: str) -> str:  # the engine's min time over ours, every case
        t = {(r["workload"], r["n"], r["engine"]): r["time_min_s"] for r in data["records"]}
        vals = [t[w, n, engine] / v for (w, n, e), v in t.items() if e == OURS]
        return range_text(min(vals), max(vals))

    return "\n".join(
        [
            "## Performance",
            "",
            "Compared with `adv-jax-math` 1.3, `jax.lax.map(f, xs, batch_size=)` and the unchunked "
            f"computation on {m['nproc']} CPU cores ({m['cpu']}), jax {m['jax']}, in one process "
            "with interleaved runs. Ratios are the original's min time (or memory) over ours, so "
            "> 1 means adv_jax_math is faster (smaller); the goal table gives min- and "
            "median-based ratios:",
            "",
            f"- forward run time: {span('time_min', lambda r: not r['grad'])} over "
            f"{sum(not r['grad'] for r in rat)} cases (elementwise sum, N-body, logsumexp, "
            "dict-pytree map; n a multiple of batch_size or not);",
            f"- gradients: {span('time_min', lambda r: r['grad'] and r['engine'] == OURS)} "
            "with per-chunk rematerialization (default), "
            f"{span('time_min', lambda r: r['engine'] == NO_REMAT)} with "
            "`config(remat=False)`;",
            "- compile time when n is not a multiple of batch_size: "
            f"{span('compile_min', lambda r: not r['divisible'] and r['engine'] == OURS)} "
            "(`fun` is traced and compiled once, with no separate remainder call);",
            f"- against `jax.lax.map` (per-row outputs stacked, then reduced): {vs('lax.map')} "
            f"over all cases; against the unchunked computation: {vs('plain')};",
            f"- N-body gradient temp memory at n = {ns[-1]}: {mib(mem[OURS][-1])} MiB, against "
            f"{mib(mem[ORIG][-1])} MiB for the original and {mib(mem['plain'][-1])} MiB "
            f"unchunked; {mib(min(mem[OURS]))}-{mib(max(mem[OURS]))} MiB for all n from {ns[0]} "
            f"to {ns[-1]}.",
            "",
            goal_table(data["goals"]),
            "",
            "Reproduce with `.venv/bin/python bench/report.py` (tables and plots in "
            "`bench/results/`) or `make bench` (pytest-benchmark).",
            "",
            "![time vs batch_size](bench/results/time_vs_batch.png)",
            "![gradient memory vs n](bench/results/grad_memory_vs_n.png)",
            "",
        ]
    )


def plots(data: dict) -> None:
    tb = data["time_vs_batch"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for e, ts in tb["min_s"].items():
        style = {"linestyle": "--"} if e == "plain" else {"marker": "o"}
        ax.plot(tb["batch_sizes"], [t * 1e3 for t in ts], label=e, **style)
    ax.set(xscale="log", yscale="log", xlabel="batch_size", ylabel="time (ms, min of 5)")
    ax.set_xticks(tb["batch_sizes"], [str(b) for b in tb["batch_sizes"]])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_title(f"{tb['workload']}, n={tb['n']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "time_vs_batch.png", dpi=120)

    gm = data["grad_memory_vs_n"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for e, bs in gm["temp_bytes"].items():
        ax.plot(gm["ns"], [b / 2**20 for b in bs], marker="o", label=e)
    ax.set(xscale="log", yscale="log", xlabel="n (sources)", ylabel="compiled temp memory (MiB)")
    ax.set_xticks(gm["ns"], [str(n) for n in gm["ns"]])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_title(f"{gm['workload']}, batch_size={gm['batch_size']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "grad_memory_vs_n.png", dpi=120)


def main() -> None:
    jax.config.update("jax_enable_compilation_cache", False)
    start = time.perf_counter()
    data = {"machine": machine(), "records": []}
    for case in CASES:
        print(f"{case} ...", file=sys.stderr, flush=True)
        data["records"] += measure(case)
    data["ratios"] = ratios(data["records"])
    print("time vs batch_size, grad memory vs n ...", file=sys.stderr, flush=True)
    data["time_vs_batch"] = time_vs_batch()
    data["grad_memory_vs_n"] = grad_memory_vs_n()
    data["goals"] = goals(data["ratios"], data["grad_memory_vs_n"])
    data["machine"]["load_average_end"] = os.getloadavg()
    data["seconds"] = time.perf_counter() - start
    OUT.mkdir(exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    (OUT / "results.md").write_text(markdown(data) + "\n")
    (OUT / "README_section.md").write_text(readme_section(data))
    plots(data)
    print(markdown(data))


if __name__ == "__main__":
    main()
