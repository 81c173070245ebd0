"""Measure the cases of ``bench_monoids`` (top-k and ARGMIN k-NN, softmax-weighted sums,
VAR) against plain JAX; write ``bench/results/monoids.{json,md}`` and the README section.

Run with ``.venv/bin/python bench/monoids_report.py`` or ``make bench-monoids`` (about
5 minutes on 2 cores; one call of ``approx_min_k`` takes about two); ``--quick`` is a smoke
test (2^16 rows, 2^20 values, few repeats; writes to ``bench/.cache/quick``, never to
the README). The README section between ``<!-- monoids:begin -->`` and ``<!--
monoids:end -->`` is rewritten only when the git tree is clean (as ``report.py``: its
own outputs excepted); ``--allow-dirty`` writes it anyway, marked as measured at
uncommitted changes.

Per case, all engines in one process, one after another, then interleaved round by
round in a shuffled order:

* compile: ``jax.jit(f).lower(*args).compile()`` once (tracing included);
* temp memory: ``memory_analysis().temp_size_in_bytes`` of that executable;
* check: the first call's result against the case's oracle (``bench_monoids``:
  indices exactly, values to rtol 1e-5, ``approx_min_k`` by recall); this call is
  the warm-up;
* run time: min and median of the timed rounds (``_timing.interleaved``); the slow
  ``approx_min_k`` of the top-16 (``rounds=0``: a sort of 1 GiB) is timed once, by
  its checking call;
* VAR: the relative error against ``np.var`` of the data in float64, for several
  data seeds (each engine in float32 on the device).

Ratios are the other engine's time (memory) over ours: > 1 means ours is faster
(smaller).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import bench_monoids as bm
import jax
import numpy as np
from _timing import compile_fn, first_call, staged
from publish import generated_note, provisional, publish, tree_state
from publish import markdown_table as table
from report import arguments, finish_run, machine, mib, range_text, run_warnings, save

HERE = Path(__file__).resolve().parent
ROUNDS = {"topk": 5, "argmin": 7, "close": 10, "var": 15}  # timed rounds per case kind
QUICK_ROUNDS = dict.fromkeys(ROUNDS, 2)
SEEDS, QUICK_SEEDS = range(5), range(2)
SHUFFLE_SEED = 1


def hlo(compiled) -> dict:
    """What the optimized HLO does: the operand shapes of its ``sort`` instructions, its
    custom-call targets, and the opcodes of the instructions that came from
    ``approx_top_k`` (``approx_min_k``)."""
    text = compiled.as_text() or ""
    approx = {
        m.group(1)
        for line in text.splitlines()
        if 'op_name="' in line and "approx_top_k" in line
        for m in [re.search(r"= \(?[^=]*?\)? ([a-z][\w-]*)\(", line)]
        if m
    }
    return {
        "hlo_sorts": re.findall(r"= \(?(\w+\[[\d,]*\])[^=\n]*? sort\(", text),
        "hlo_custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))),
        "hlo_approx_ops": sorted(approx),
    }


def measure(case: bm.Case, rounds: int) -> list[dict]:
    args = case.args()
    compiled = {e.name: compile_fn(e.fn, args) for e in case.engines}
    fs = {name: c.executable for name, c in compiled.items()}
    outs, first = {}, {}
    for name, f in fs.items():  # the warm-up, and the result checked
        out, first[name] = first_call(f, args)
        outs[name] = jax.tree.map(np.asarray, out)
    ref = outs[case.oracle] if case.oracle in outs else case.reference()
    checks = {e.name: case.check(e, outs[e.name], ref) for e in case.engines}
    del outs
    n_rounds = {e.name: rounds if e.rounds is None else e.rounds for e in case.engines}
    times = staged(fs, args, n_rounds, SHUFFLE_SEED, first)
    return [
        {
            "case": case.name,
            "description": case.description,
            "engine": e.name,
            "ours": e.ours,
            "context": e.context,
            "approximate": e.approximate,
            "oracle": e.name == case.oracle,
            "batch_size": e.batch_size,
            "time_min_s": times[e.name].min,
            "time_median_s": times[e.name].median,
            "runs": len(times[e.name]),
            "timed_first_call": not n_rounds[e.name],
            "first_call_s": first[e.name],
            "compile_s": compiled[e.name].seconds,
            "temp_bytes": compiled[e.name].temp_bytes,
            **hlo(compiled[e.name].executable),
            **checks[e.name],
        }
        for e in case.engines
    ]


def ratios(records: list[dict]) -> list[dict]:
    """Every other engine of a case over each of ours: > 1 means ours is faster."""
    out = []
    for mine in (r for r in records if r["ours"]):
        for other in records:
            if other["case"] != mine["case"] or other["ours"]:
                continue
            out.append(
                {
                    "case": mine["case"],
                    "ours": mine["engine"],
                    "other": other["engine"],
                    "context": other["context"],
                    "time_min": other["time_min_s"] / mine["time_min_s"],
                    "time_median": other["time_median_s"] / mine["time_median_s"],
                    "memory": other["temp_bytes"] / max(mine["temp_bytes"], 1),
                }
            )
    return out


def ms_range(r: dict) -> str:
    lo, hi = r["time_min_s"] * 1e3, r["time_median_s"] * 1e3
    digits = 0 if lo >= 100 else 1
    a, b = f"{lo:.{digits}f}", f"{hi:.{digits}f}"
    return a if a == b else f"{a}-{b}"


def check_text(r: dict) -> str:
    if "indices_equal" in r:
        text = "indices equal" if r["indices_equal"] else f"recall {r['recall']:.3f}"
        if "rel_error" in r and r["indices_equal"]:
            text += f", values {r['rel_error']:.0e}"
        return text + (" (oracle)" if r["oracle"] else "")
    return f"rel. err {r['rel_error']:.1e}"


def ratio_rows(data: dict) -> list[list[str]]:
    by = {(r["case"], r["engine"]): r for r in data["records"]}
    rows = []
    for q in data["ratios"]:
        mine, other = by[q["case"], q["ours"]], by[q["case"], q["other"]]
        rows.append(
            [
                q["case"],
                q["ours"],
                q["other"] + (" (context)" if q["context"] else ""),
                ms_range(mine),
                ms_range(other),
                f"**{range_text(q['time_min'], q['time_median'])}**",
                f"{mib(mine['temp_bytes'])} / {mib(other['temp_bytes'])}",
            ]
        )
    return rows


RATIO_HEAD = [
    "case",
    "ours",
    "against",
    "ours ms",
    "theirs ms",
    "speed, theirs/ours",
    "temp MiB, ours / theirs",
]


def var_summary(data: dict) -> list[list[str]]:
    errs = data["var_errors"]
    return [[name, f"{min(v):.1e}-{max(v):.1e}", f"{np.median(v):.1e}"] for name, v in errs.items()]


def machine_text(data: dict) -> str:
    m = data["machine"]
    return (
        f"{m['nproc']} CPU cores ({m['cpu']}), {m['platform']}, Python {m['python']}, "
        f"jax {m['jax']}, jaxlib {m['jaxlib']}; load average "
        f"{m['load_average_start'][0]:.1f} at start, {m['load_average_end'][0]:.1f} at the end"
    )


def notes(data: dict) -> list[str]:
    """What the numbers say, each sentence from the records."""
    recs = data["records"]
    out = []
    for r in (r for r in recs if r["approximate"]):
        how = (
            f"a full `sort` of the stacked distances ({', '.join(r['hlo_sorts'])}, with "
            "their indices), then a slice"
            if r["hlo_sorts"]
            else "no sort: "
            + (
                "one `reduce` of values and indices over the stacked distances (an exact "
                "arg-extremum)"
                if "reduce" in r["hlo_approx_ops"]
                else f"`{'`, `'.join(r['hlo_approx_ops'])}`"
            )
        )
        found = (
            "exactly the exact result (recall 1.000)"
            if r["indices_equal"]
            else f"recall {r['recall']:.3f}"
        )
        out.append(
            f"`{r['engine'].removesuffix(', stacked')}` ({r['case']}) compiles on XLA:CPU to "
            f"{how}, and returned {found}; {r['time_min_s'] * 1e3:.0f} ms "
            + (
                "(one call, the checking one: too slow to repeat)"
                if r["timed_first_call"]
                else f"(min of {r['runs']})"
            )
            + ". Its docs: only optimized on TPU."
        )
    knn = [r for r in recs if r["case"].startswith("k-NN top")]
    topk = [r for r in knn if r["ours"]]
    plain = next((r for r in knn if r["oracle"]), None)
    hand = next((r for r in knn if r["context"]), None)
    if topk and plain:
        took = " and ".join(f"{r['time_min_s'] * 1e3:.0f} ms at B={r['batch_size']}" for r in topk)
        less = " and ".join(f"{plain['temp_bytes'] / r['temp_bytes']:.0f}x" for r in topk)
        text = (
            f"`top_k({bm.K}, smallest=True)` took {took} (min), against "
            f"{plain['time_min_s'] * 1e3:.0f} ms for `lax.top_k` on the stacked matrix "
            f"(XLA:CPU: custom call `{', '.join(plain['hlo_custom_calls']) or '-'}`), with "
            f"{less} less temp memory. On the scan engine the monoid folds each chunk with "
            "one `lax.top_k` (XLA's TopK) and merges the chunks' sorted states; inside a "
            f"Pallas kernel it makes {bm.K} passes of max-and-remove instead (operations "
            "every kernel target lowers)"
        )
        if hand:
            text += (
                f"; `lax.top_k` on each chunk in a hand-written `lax.scan` took "
                f"{hand['time_min_s'] * 1e3:.0f} ms at B={hand['batch_size']}"
            )
        out.append(text + ".")
    for case in ("k-NN ARGMIN", "softmax-weighted sum"):
        mine = [r for r in recs if r["case"] == case and r["ours"]]
        other = [r for r in recs if r["case"] == case and r["oracle"]]
        if mine and other and mine[0]["time_min_s"] * 1.1 < other[0]["time_min_s"]:
            out.append(
                f"{case}: ours is faster than the stacked computation "
                f"({other[0]['time_min_s'] / mine[0]['time_min_s']:.1f}x by min time), "
                "presumably because it never writes the stacked matrix to memory and reads it "
                f"back ({mib(other[0]['temp_bytes'])} MiB of temporaries there, "
                f"{mib(mine[0]['temp_bytes'])} MiB here)."
            )
    if "var_errors" in data:
        errs = data["var_errors"]
        half_ulp = float(np.finfo(np.float32).eps) / 2
        ours = next(k for k in errs if k.startswith("ours"))
        one_pass = next(k for k in errs if "one pass" in k)
        out.append(
            f"VAR: ours (one pass over the data, in chunks) and `jnp.var` (two passes) are "
            f"both within about one rounding of the float32 result (half an ulp of 1.0 is "
            f"{half_ulp:.1e}; ours at most {max(errs[ours]):.1e}, `jnp.var` at most "
            f"{max(errs['jnp.var']):.1e}); the one-pass E[x^2] - E[x]^2, shown for context, "
            f"is off by {min(errs[one_pass]):.0e}-{max(errs[one_pass]):.0e}."
        )
    return out


def markdown(data: dict) -> str:
    m = data["machine"]
    head = [
        "case",
        "engine",
        "B",
        "time min / median (ms)",
        "runs",
        "compile s",
        "temp MiB",
        "check",
        "HLO: sorts, custom calls",
    ]
    rows = [
        [
            r["case"],
            r["engine"],
            str(r["batch_size"] or "-"),
            f"{r['time_min_s'] * 1e3:.1f} / {r['time_median_s'] * 1e3:.1f}",
            str(r["runs"]),
            f"{r['compile_s']:.2f}",
            mib(r["temp_bytes"]),
            check_text(r),
            ", ".join(
                [f"sort {x}" for x in r["hlo_sorts"]]
                + [f"custom-call {x}" for x in r["hlo_custom_calls"]]
            )
            or "-",
        ]
        for r in data["records"]
    ]
    errs = data["var_errors"]
    per_seed = [[name, *(f"{e:.2e}" for e in v)] for name, v in errs.items()]
    cases = {r["case"]: r["description"] for r in data["records"]}
    return "\n\n".join(
        [
            "# Benchmarks: top-k, ARGMIN, softmax-weighted and VAR monoids vs plain JAX",
            *run_warnings(data),
            f"Machine: {machine_text(data)} (other processes share the cores). adv_jax_math "
            f"at commit {m['commit']}. Generated by `.venv/bin/python bench/monoids_report.py` "
            f"in {data['seconds']:.0f} s.",
            "Cases (`bench/bench_monoids.py`): "
            + "; ".join(f"**{k}**: {v}" for k, v in cases.items())
            + ". `stacked`: the plain-JAX computation on all rows at once.",
            "Per case all engines are compiled once (`jax.jit(f).lower(*args).compile()`, "
            "tracing included), called once and checked against the oracle (indices exactly, "
            "values to rtol 1e-5, `approx_min_k` by recall; VAR against float64 NumPy), then "
            "timed in interleaved rounds in a shuffled order; `approx_min_k` of the top-16 "
            "(a 1 GiB sort, minutes a call) is timed once, by its checking call. Times: "
            "min / median. Temp MiB: "
            "`memory_analysis().temp_size_in_bytes`. HLO: the operands of the `sort` "
            "instructions and the custom-call targets in the compiled program.",
            "## Ratios (> 1: ours faster)",
            "Times are min-median in ms; the speed ratio is the range between the min-based "
            "and the median-based ratio.",
            table([RATIO_HEAD, *ratio_rows(data)]),
            "## All measurements",
            table([head, *rows]),
            f"## VAR: relative error against float64 (seeds {', '.join(map(str, data['seeds']))})",
            table([["engine", *(f"seed {s}" for s in data["seeds"])], *per_seed]),
            "## Notes",
            "\n".join(f"- {n}" for n in notes(data)),
        ]
    )


def readme_section(data: dict) -> str:
    m = data["machine"]
    commit = m["commit"].removesuffix("-dirty")
    lines = [
        generated_note("bench/monoids_report.py", "bench/results/monoids.json", "the script"),
        "",
        f"Measured by `bench/monoids_report.py` at commit `{commit}` on "
        f"{machine_text(data)}, in {data['seconds']:.0f} s; `bench/results/monoids.md` has "
        "every number.",
    ]
    lines += provisional(m)
    lines += [
        "",
        f"Against plain JAX on the stacked rows (k-NN: {bm.QUERIES} queries, d = {bm.DIM}, "
        f"squared distances; softmax: {bm.SOFTMAX_QUERIES} queries, {bm.VALUE_DIM}-float "
        "values), in one process with interleaved runs, after checking every result "
        "against the oracle (indices exactly, values to rtol 1e-5). Times are min-median "
        "ms; the speed ratio is theirs over ours (> 1: ours faster), from min and from "
        "median times; B is our `batch_size`.",
        "",
        table([RATIO_HEAD, *ratio_rows(data)]),
        "",
        f"VAR of {data['var_n']} float32 values 1000 + N(0, 1), relative error against "
        f"float64 NumPy over seeds {data['seeds'][0]}-{data['seeds'][-1]} (float32 on the "
        "device):",
        "",
        table([["engine", "rel. error, min-max", "median"], *var_summary(data)]),
        "",
        *(f"- {n}" for n in notes(data)),
        "",
        "Reproduce with `make bench-monoids` (or `.venv/bin/python bench/monoids_report.py`); "
        "`make bench` runs `bench/bench_monoids.py` with pytest-benchmark.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = arguments(__doc__)
    cases = bm.QUICK_CASES if args.quick else bm.CASES
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    seeds = QUICK_SEEDS if args.quick else SEEDS

    jax.config.update("jax_enable_compilation_cache", False)
    start = time.perf_counter()
    tree = tree_state()
    data: dict = {"machine": machine(tree), "quick": args.quick, "records": []}
    for case in cases:
        print(f"{case} ...", file=sys.stderr, flush=True)
        data["records"] += measure(case, rounds[case.kind])
    var = next(c for c in cases if c.kind == "var")
    print("VAR errors ...", file=sys.stderr, flush=True)
    data["seeds"] = list(seeds)
    data["var_n"] = int(var.args()[1].shape[0])
    data["var_errors"] = bm.var_errors(var, seeds)
    data["ratios"] = ratios(data["records"])
    finish_run(data, tree, start)
    save(args.out, "monoids", data, markdown(data))
    publish("monoids", readme_section(data), data, quick=args.quick, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
