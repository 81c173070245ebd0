"""Measure every workload of ``workloads.COMPARE`` with every engine; write ``bench/results``
and the README's performance section.

Run with ``.venv/bin/python bench/report.py`` (a few minutes on 2 cores);
``--quick`` is a smoke test (small n, few repeats; writes to ``bench/.cache/quick``,
never to the README). The README section between ``<!-- bench:begin -->`` and
``<!-- bench:end -->`` is rewritten (``publish.py``) only when the git tree is clean
(``git status --porcelain`` empty, except for the reports' own outputs);
``--allow-dirty`` writes it anyway, with the numbers marked as measured at uncommitted
changes.

All engines of a case are measured in one process, interleaved round by round in a
shuffled order (a call that follows a big one, like the unchunked N-body, runs ~20%
slower: a fixed order would bias the ratios), so load from other processes hits them
alike; ratios are reported from min times and from median times. Metrics per case and
engine (timed by ``_timing``):

* run time: min and median of >= 15 calls after a warm-up call;
* compile time: ``jax.jit(f).lower(*args).compile()`` of a fresh function object
  (tracing included), min of 5;
* traces: how many times ``fun`` ran in Python during one such compile;
* temp memory: ``memory_analysis().temp_size_in_bytes`` of the compiled function;
* error: max |result - plain| / max |plain| against the unchunked computation.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import matplotlib
from _timing import compile_fn, interleaved
from cases import max_rel_error
from cases.workloads import CASES, NBODY, NBODY_FORCES, Case

import adv_jax_math as ajm

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import NullLocator
from publish import generated_note, provisional, publish, tree_state
from publish import markdown_table as table

HERE = Path(__file__).resolve().parent
ORIG, OURS, NO_REMAT = "original 1.3", "ours", "ours remat=False"


@dataclasses.dataclass(frozen=True)
class Settings:
    compile_repeats: int = 5
    min_rounds: int = 15
    max_rounds: int = 60
    seconds_per_case: float = 10.0
    batch_sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)  # N-body time vs B
    batch_n: int = 2**15  # N-body n for time vs batch_size
    batch_rounds: int = 5
    memory_ns: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536)  # grad memory vs n
    quick: bool = False

    def cases(self) -> tuple[Case, ...]:
        """Every case; in quick mode each at 4 chunks (and 4 chunks + 3 rows)."""
        if not self.quick:
            return CASES
        small = {}
        for c in CASES:
            b = c.workload.batch_size
            small[c.workload, 4 * b + (0 if c.divisible else 3)] = None
        return tuple(Case(w, n) for w, n in small)


FULL = Settings()
QUICK = Settings(
    compile_repeats=1,
    min_rounds=3,
    max_rounds=3,
    seconds_per_case=0.0,
    batch_sizes=(256, 1024),
    batch_n=4096,
    batch_rounds=2,
    memory_ns=(2048, 4096),
    quick=True,
)


def measure(case: Case, s: Settings) -> list[dict]:
    args = case.args()
    compile_s = {e: [] for e in case.engines}
    xla_s = {e: [] for e in case.engines}
    traces, compiled = {}, {}
    order, rng = list(case.engines), random.Random(1)
    for _ in range(s.compile_repeats):
        rng.shuffle(order)
        for e in order:
            calls = []
            c = compile_fn(case.function(e, lambda calls=calls: calls.append(1)), args)
            traces[e], compiled[e] = len(calls), c
            compile_s[e].append(c.seconds)
            xla_s[e].append(c.xla_seconds)
    fs = {e: c.executable for e, c in compiled.items()}
    ref = fs["plain"](*args)
    times = interleaved(
        fs,
        args,
        seconds=s.seconds_per_case,
        min_rounds=s.min_rounds,
        max_rounds=s.max_rounds,
        shuffle=0,
    )
    return [
        {
            "workload": case.workload.name,
            "n": case.n,
            "batch_size": case.workload.batch_size,
            "divisible": case.divisible,
            "grad": case.workload.grad,
            "engine": e,
            "time_min_s": times[e].min,
            "time_median_s": times[e].median,
            "runs": len(times[e]),
            "compile_min_s": min(compile_s[e]),
            "compile_median_s": statistics.median(compile_s[e]),
            "xla_compile_min_s": min(xla_s[e]),
            "traces": traces[e],
            "temp_bytes": compiled[e].temp_bytes,
            "rel_error": max_rel_error(fs[e](*args), ref),
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


def time_vs_batch(s: Settings) -> dict:
    engines = (OURS, ORIG, "lax.map", "plain")
    result = {e: [] for e in engines}
    for b in s.batch_sizes:
        case = Case(NBODY.replace(batch_size=b), s.batch_n)
        args = case.args()
        fs = {e: compile_fn(case.function(e), args).executable for e in engines}
        times = interleaved(fs, args, rounds=s.batch_rounds, shuffle=0)
        for e in engines:
            result[e].append(times[e].min)
    return {
        "workload": NBODY.name,
        "n": s.batch_n,
        "batch_sizes": list(s.batch_sizes),
        "rounds": s.batch_rounds,
        "min_s": result,
    }


def grad_memory_vs_n(s: Settings) -> dict:
    engines = (OURS, NO_REMAT, ORIG, "plain")
    cases = [Case(NBODY_FORCES, n) for n in s.memory_ns]
    mem = {
        e: [compile_fn(case.function(e), case.args()).temp_bytes for case in cases] for e in engines
    }
    rows = jax.tree.leaves(cases[0].args()[1])  # the mapped input
    return {
        "workload": NBODY_FORCES.name,
        "batch_size": NBODY_FORCES.batch_size,
        "ns": list(s.memory_ns),
        "temp_bytes": mem,
        "row_bytes": sum(a.nbytes // a.shape[0] for a in rows),
    }


ROW_COPIES = 4  # the memory goal: copies of each added input row allowed (see goals)


LSE_BATCH = 2**14  # the logsumexp goal: against the unchunked program at this batch_size


def goals(rat: list[dict], memory: dict, records: list[dict]) -> list[dict]:
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
    by = {(r["workload"], r["n"], r["engine"]): r for r in records}
    lse = [  # the unchunked program's time over ours
        {
            "workload": w,
            "n": n,
            "engine": f"{OURS} vs plain",
            **{k: by[w, n, "plain"][f"{k}_s"] / r[f"{k}_s"] for k in ("time_min", "time_median")},
        }
        for (w, n, e), r in by.items()
        if w == "logsumexp" and e == OURS and r["batch_size"] == LSE_BATCH
    ]
    nondiv = min(
        (r for r in rat if not r["divisible"] and r["engine"] == OURS),
        key=lambda r: r["compile_min"],
    )
    large = min(
        (r for r in rat if r["workload"].startswith("large fun") and r["engine"] == OURS),
        key=lambda r: r["compile_min"],
    )
    mem, ns, row_bytes = memory["temp_bytes"], memory["ns"], memory["row_bytes"]
    ours, orig = mem[OURS], mem[ORIG]
    grown = row_bytes * (ns[-1] - ns[0])
    return [
        timing("forward: time <= 1.0x original's (speed >= 1.0x), every case", fwd, 1.0),
        {
            "goal": "forward: geometric mean time <= 0.9x original's (speed >= 1.11x)",
            "met": verdict(geo, 1 / 0.9),
            "value": range_text(*geo),
        },
        timing(
            f"logsumexp, batch_size {LSE_BATCH}: time <= 1.1x unchunked (speed >= 0.91x)",
            lse,
            1 / 1.1,
        ),
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
            "goal": "compile time >= 1.8x faster than original, large fun (360 eqns)",
            "met": "yes" if large["compile_min"] >= 1.8 else "no",
            "value": f"{large['compile_min']:.2f}x ({large['workload']}, n={large['n']})",
        },
        {
            "goal": f"N-body gradient temp memory at n={ns[-1]} >= 10x below original",
            "met": "yes" if orig[-1] >= 10 * ours[-1] else "no",
            "value": f"{orig[-1] / ours[-1]:.0f}x ({mib(ours[-1])} vs {mib(orig[-1])} MiB)",
        },
        {
            # O(batch_size), not O(n): beyond 1.1x the smallest n's, at most a few
            # re-laid-out copies of each added input row (the pairwise tiles' y columns,
            # one per pass), where the original keeps every row's pair terms (~9 KB)
            "goal": (
                f"N-body gradient temp memory flat in n (n={ns[0]}..{ns[-1]}: max <= 1.1x "
                f"min + {ROW_COPIES} copies of the added input rows)"
            ),
            "met": "yes" if max(ours) <= 1.1 * min(ours) + ROW_COPIES * grown else "no",
            "value": (
                f"{mib(min(ours))}..{mib(max(ours))} MiB, "
                f"{(max(ours) - min(ours)) / (ns[-1] - ns[0]):.0f} bytes per added row of "
                f"{row_bytes}"
            ),
        },
    ]


def mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def machine(tree: dict) -> dict:
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
        "commit": tree["commit"] + ("-dirty" if tree["changes"] else ""),
        "uncommitted": tree["changes"],
        "load_average_start": os.getloadavg(),
    }


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


def run_warnings(data: dict) -> list[str]:
    """What a results file says first when its run is no result: quick, or measured at
    uncommitted changes."""
    m, out = data["machine"], []
    if data["quick"]:
        out.append("**Quick smoke run (`--quick`): small n, few repeats; not results.**")
    if m["uncommitted"]:
        out.append(
            "**Uncommitted changes at the time of the run** (`git status --porcelain`): "
            + ", ".join(f"`{c}`" for c in m["uncommitted"])
        )
    return out


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
            *run_warnings(data),
            f"Machine: {m['nproc']} cores ({m['cpu']}), {m['platform']}; Python {m['python']}, "
            f"jax {m['jax']}, jaxlib {m['jaxlib']}; adv_jax_math at commit {m['commit']}; "
            f"load average {m['load_average_start'][0]:.1f} "
            f"at start, {m['load_average_end'][0]:.1f} at the end (other processes share the "
            f"cores). Generated by `.venv/bin/python bench/report.py` in {data['seconds']:.0f} s.",
            "`*`: n is not a multiple of batch_size. Times: min / median of interleaved runs. "
            "Compile: `jax.jit(f).lower(*args).compile()` of a fresh function object, tracing "
            f"included, min of {data['compile_repeats']} (in parentheses: its XLA compile "
            "part). Traces: Python calls of "
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
    """The README text between the markers: every number in it comes from ``data``."""
    rat, recs, m = data["ratios"], data["records"], data["machine"]
    mem, ns = data["grad_memory_vs_n"]["temp_bytes"], data["grad_memory_vs_n"]["ns"]

    def span(values) -> str:
        values = list(values)
        return range_text(min(values), max(values))

    def ratio(key: str, keep) -> str:
        return span(r[key] for r in rat if keep(r))

    def vs(engine: str) -> str:  # the engine's min time over ours, every case
        t = {(r["workload"], r["n"], r["engine"]): r["time_min_s"] for r in recs}
        return span(t[w, n, engine] / v for (w, n, e), v in t.items() if e == OURS)

    commit = m["commit"].removesuffix("-dirty")
    lines = [
        generated_note("bench/report.py", "bench/results/results.json", "report.py"),
        "",
        f"Measured by `bench/report.py` at commit `{commit}` on {m['nproc']} CPU cores "
        f"({m['cpu']}), jax {m['jax']}, in {data['seconds']:.0f} s; "
        "`bench/results/results.md` has every number, the machine and versions.",
    ]
    lines += provisional(m)
    lines += [
        "",
        "Compared with `adv-jax-math` 1.3, `jax.lax.map(f, xs, batch_size=)` and the unchunked "
        "computation, in one process with interleaved runs. Ratios are the original's min "
        "time (or memory) over ours, so > 1 means adv_jax_math is faster (smaller); the goal "
        "table gives min- and median-based ratios:",
        "",
        f"- forward run time: {ratio('time_min', lambda r: not r['grad'])} over "
        f"{sum(not r['grad'] for r in rat)} cases (elementwise sum, N-body, logsumexp, "
        "dict-pytree map; n a multiple of batch_size or not);",
        f"- gradients: {ratio('time_min', lambda r: r['grad'] and r['engine'] == OURS)} "
        "with per-chunk rematerialization (default), "
        f"{ratio('time_min', lambda r: r['engine'] == NO_REMAT)} with "
        "`config(remat=False)`;",
        "- compile time when n is not a multiple of batch_size: "
        f"{ratio('compile_min', lambda r: not r['divisible'] and r['engine'] == OURS)} "
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
        "`bench/results/`, and this section) or `make bench` (pytest-benchmark).",
        "",
        "![time vs batch_size](bench/results/time_vs_batch.png)",
        "![gradient memory vs n](bench/results/grad_memory_vs_n.png)",
    ]
    if any(g["met"] != "yes" for g in data["goals"] if g["goal"].startswith("compile time")):
        lines += ["", missed_compile(recs)]
    return "\n".join(lines) + "\n"


def missed_compile(recs: list[dict]) -> str:
    """Why the compile goals are missed, from the records: how much of our compile is
    XLA's, and how fast the unchunked program (no loop, one copy of ``fun``: the
    floor for any chunked program) compiles against the original."""
    nondiv = [r for r in recs if not r["divisible"]]
    by = {(r["workload"], r["n"], r["engine"]): r for r in nondiv}
    xla = [100 * r["xla_compile_min_s"] / r["compile_min_s"] for r in nondiv if r["engine"] == OURS]
    orig_traces = [r["traces"] for r in nondiv if r["engine"] == ORIG]
    large_map = [key for key in by if key[2] == "plain" and key[0].endswith(", map")]
    ceiling = ", ".join(
        f"{by[w, n, ORIG]['compile_min_s'] / by[w, n, 'plain']['compile_min_s']:.2f}x for "
        f"the {w} (over ours: "
        f"{by[w, n, ORIG]['compile_min_s'] / by[w, n, OURS]['compile_min_s']:.2f}x)"
        for w, n, _ in large_map
    )
    lse = ", ".join(
        f"n={n}: {by[w, n, ORIG]['compile_min_s'] / by[w, n, OURS]['compile_min_s']:.2f}x"
        for w, n, e in by
        if w == "logsumexp" and e == OURS
    )
    return (
        "**Missed: compile time.** For non-divisible `n` we trace `fun` once and the "
        "compiled program holds one copy of it, where the original traces it "
        f"{min(orig_traces)} to {max(orig_traces)} times and compiles as many copies. XLA's "
        f"compile time dominates ({min(xla):.0f}-{max(xla):.0f}% of ours). The unchunked "
        "program, with no loop and one copy of `fun`, is the floor for any chunked one; the "
        f"original's compile time over it is only {ceiling}, so removing the second copy "
        "cannot reach 1.8x on XLA:CPU. For small `fun`s the loop's own pieces cost what the "
        "saved copies would: `bench/compile_floor.py` breaks the elementwise sum down (see "
        "below)."
        + (
            f" The logsumexp of a small elementwise `fun` ({lse}) holds two copies on purpose, "
            "one per pass of its fold, each fused into its reduction (its run time is what "
            "gained)."
            if lse
            else ""
        )
        + nbody_trade(recs)
    )


def nbody_trade(recs: list[dict]) -> str:
    """The N-body workloads' compile time against their run time: their ``fun`` closes
    over the targets, so they run on the pairwise tiles."""
    by = {(r["workload"], r["n"], r["engine"]): r for r in recs}
    ratio = lambda w, k: [
        by[w, n, ORIG][k] / by[w, n, OURS][k] for ww, n, e in by if ww == w and e == OURS
    ]
    span = lambda v: f"{min(v):.2f}-{max(v):.2f}x" if v else "-"
    field, grad = NBODY.name, NBODY_FORCES.name
    return (
        f" The N-body workloads run on the pairwise tiles (their `fun` closes over the targets, "
        "whose rows pair with the sources'): the unrolled per-pair code compiles longer "
        f"(the original's compile time over ours: {span(ratio(field, 'compile_min_s'))} for "
        f"the field, {span(ratio(grad, 'compile_min_s'))} for its gradient) and runs "
        f"{span(ratio(field, 'time_min_s'))} and {span(ratio(grad, 'time_min_s'))} faster."
    )


def finish_run(data: dict, tree: dict, start: float) -> None:
    """Record the end of a measuring run in ``data``: the load, the seconds it took
    since ``start``, and the tree marked dirty if it changed during the run (``tree``:
    :func:`tree_state` at the start)."""
    data["machine"]["load_average_end"] = os.getloadavg()
    data["seconds"] = time.perf_counter() - start
    if tree_state() != tree:  # the tree changed while measuring
        data["machine"]["uncommitted"] = [*tree["changes"], "(the tree changed during the run)"]
        data["machine"]["commit"] = tree["commit"] + "-dirty"


def save(out: Path, name: str, data: dict, text: str, default: Any = None) -> None:
    """A run's records as ``out/<name>.json`` (``default``: ``json.dumps``' for what
    it cannot write) and their markdown ``text`` as ``out/<name>.md``, printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=default) + "\n")
    (out / f"{name}.md").write_text(text.rstrip("\n") + "\n")
    print(text)


def log_log_plot(path: Path, xs: list, series: dict, *, title: str, **labels) -> None:
    """One line per series over ``xs`` (log-log, ``xs`` as ticks); ``plain`` dashed."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in series.items():
        style = {"linestyle": "--"} if name == "plain" else {"marker": "o"}
        ax.plot(xs, ys, label=name, **style)
    ax.set(xscale="log", yscale="log", title=title, **labels)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plots(data: dict, out: Path) -> None:
    tb, gm = data["time_vs_batch"], data["grad_memory_vs_n"]
    log_log_plot(
        out / "time_vs_batch.png",
        tb["batch_sizes"],
        {e: [t * 1e3 for t in ts] for e, ts in tb["min_s"].items()},
        title=f"{tb['workload']}, n={tb['n']}",
        xlabel="batch_size",
        ylabel=f"time (ms, min of {tb['rounds']})",
    )
    log_log_plot(
        out / "grad_memory_vs_n.png",
        gm["ns"],
        {e: [b / 2**20 for b in bs] for e, bs in gm["temp_bytes"].items()},
        title=f"{gm['workload']}, batch_size={gm['batch_size']}",
        xlabel="n (sources)",
        ylabel="compiled temp memory (MiB)",
    )


def arguments(doc: str) -> argparse.Namespace:
    """The options both reports take: --quick, --allow-dirty, --out."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: small n, few repeats")
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="rewrite the README section even with uncommitted changes (marked provisional)",
    )
    parser.add_argument("--out", type=Path, help="results folder (default: bench/results)")
    args = parser.parse_args()
    if args.out is None:  # a quick run's results are no results
        args.out = HERE / ".cache" / "quick" if args.quick else HERE / "results"
    return args


def main() -> None:
    args = arguments(__doc__)
    s = QUICK if args.quick else FULL

    jax.config.update("jax_enable_compilation_cache", False)
    start = time.perf_counter()
    tree = tree_state()
    data = {
        "machine": machine(tree),
        "quick": s.quick,
        "compile_repeats": s.compile_repeats,
        "records": [],
    }
    for case in s.cases():
        print(f"{case} ...", file=sys.stderr, flush=True)
        data["records"] += measure(case, s)
    data["ratios"] = ratios(data["records"])
    print("time vs batch_size, grad memory vs n ...", file=sys.stderr, flush=True)
    data["time_vs_batch"] = time_vs_batch(s)
    data["grad_memory_vs_n"] = grad_memory_vs_n(s)
    data["goals"] = goals(data["ratios"], data["grad_memory_vs_n"], data["records"])
    finish_run(data, tree, start)
    save(args.out, "results", data, markdown(data))
    section = readme_section(data)
    (args.out / "README_section.md").write_text(section)
    plots(data, args.out)
    publish("bench", section, data, quick=s.quick, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
