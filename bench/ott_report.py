"""OTT-JAX's Sinkhorn through ``adv_jax_math.ott.PointCloud`` against OTT's own geometries.

Run with ``.venv/bin/python bench/ott_report.py`` (about 10 minutes on 2 cores;
``--quick``: 2000 x 1500 only, writes to ``bench/.cache/quick``). Writes
``bench/results/ott.{json,md}`` and the table of ``docs/guides/ott.md`` between
``<!-- ott-bench:begin -->`` and ``<!-- ott-bench:end -->`` (from a clean git tree, or
with ``--allow-dirty``, marked provisional; never from ``--quick``).

At 2000 x 1500 and 20000 x 15000 points, d = 16, float32, in one process, per
workload and geometry (ours, OTT's dense ``PointCloud``, OTT's online one with
``batch_size=``):

* compile: ``jax.jit(f).lower(*args).compile()``, its temp memory
  (``memory_analysis().temp_size_in_bytes``);
* time: the first call (the warm-up, its result checked against dense), then the min
  of a few calls, the geometries interleaved round by round;
* agreement: the largest absolute difference to dense, and relative to the largest
  absolute value of dense's result.

Workloads: one lse kernel application (a Sinkhorn half-step), the signed weighted one
of implicit differentiation (``vec`` with negative entries), a Sinkhorn solve of a fixed
number of iterations (``reg_ot_cost``) and its gradient with respect to the x points
by implicit differentiation. A geometry that fails to compile or run is reported with
its error (OTT 0.6.0's online mode on jax >= 0.9.2: ``jax.interpreters.batching`` lost
``is_vmappable``).
"""

from __future__ import annotations

import importlib.metadata
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _timing import compile_fn, interleaved
from ott.geometry import pointcloud as ott_pointcloud
from ott.problems.linear import linear_problem
from ott.solvers.linear import implicit_differentiation, sinkhorn
from publish import markdown_table as table
from publish import provisional, tree_state
from report import arguments, finish_run, machine, save

from adv_jax_math.ott import PointCloud

HERE = Path(__file__).resolve().parent
PAGE = HERE.parent / "docs" / "guides" / "ott.md"
BEGIN, END = "<!-- ott-bench:begin -->", "<!-- ott-bench:end -->"
D, EPS, ITERATIONS = 16, 1.0, 10
SIZES, QUICK_SIZES = [(2000, 1500), (20000, 15000)], [(2000, 1500)]
ROUNDS = {2000: 5, 20000: 2}  # timed calls after the checking one
ONLINE_BATCH = 1024

GEOMETRIES: dict[str, Callable[..., Any]] = {
    "adv_jax_math.ott": lambda x, y: PointCloud(x, y, epsilon=EPS),
    "OTT dense": lambda x, y: ott_pointcloud.PointCloud(x, y, epsilon=EPS),
    "OTT online": lambda x, y: ott_pointcloud.PointCloud(
        x, y, epsilon=EPS, batch_size=ONLINE_BATCH
    ),
}


def inputs(n: int, m: int) -> tuple[jax.Array, ...]:
    kx, ky, kf, kv = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (n, D))
    y = 0.8 * jax.random.normal(ky, (m, D)) + 0.3
    f = jax.random.normal(kf, (n,))
    vec = jax.random.normal(kv, (n,))  # signed, as implicit differentiation's
    return x, y, f, vec


def solver(implicit: bool) -> sinkhorn.Sinkhorn:
    diff = implicit_differentiation.ImplicitDiff() if implicit else None
    return sinkhorn.Sinkhorn(
        threshold=1e-30,  # never met: exactly ITERATIONS iterations
        min_iterations=ITERATIONS,
        max_iterations=ITERATIONS,
        inner_iterations=ITERATIONS,
        implicit_diff=diff,
    )


def workloads(make: Callable) -> dict[str, Callable]:
    """Each workload as a function of (x, y, f, vec) for the geometry ``make`` builds."""
    b_weights = lambda m: jnp.full((m,), 1.0 / m)

    def lse(x, y, f, vec):
        return make(x, y).apply_lse_kernel(f, jnp.zeros(y.shape[0]), EPS, axis=0)[0]

    def weighted(x, y, f, vec):
        return make(x, y).apply_lse_kernel(f, jnp.zeros(y.shape[0]), EPS, vec=vec, axis=0)

    def solve(x, y, f, vec):
        problem = linear_problem.LinearProblem(make(x, y), b=b_weights(y.shape[0]))
        return solver(implicit=False)(problem).reg_ot_cost

    def grad(x, y, f, vec):
        def cost(x):
            problem = linear_problem.LinearProblem(make(x, y), b=b_weights(y.shape[0]))
            return solver(implicit=True)(problem).reg_ot_cost

        return jax.grad(cost)(x)

    return {
        "lse kernel (half-step)": lse,
        "weighted lse kernel (signed vec)": weighted,
        f"Sinkhorn, {ITERATIONS} iterations": solve,
        "gradient (implicit diff)": grad,
    }


def error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text[:160]


def agreement(out: Any, ref: Any) -> dict:
    pairs = list(zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True))
    diff = max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in pairs)
    scale = max(float(np.max(np.abs(np.asarray(v)))) for _, v in pairs)
    return {"max_abs_diff": diff, "max_rel_diff": diff / scale if scale else diff}


def measure(n: int, m: int) -> list[dict]:
    args = inputs(n, m)
    per_geometry = {name: workloads(make) for name, make in GEOMETRIES.items()}
    records = []
    for work in per_geometry["OTT dense"]:
        print(f"{n} x {m}: {work} ...", file=sys.stderr, flush=True)
        runs, outs, recs = {}, {}, {}
        for name in GEOMETRIES:
            rec = {"n": n, "m": m, "d": D, "workload": work, "geometry": name}
            try:
                compiled = compile_fn(per_geometry[name][work], args)
                rec["compile_s"] = compiled.seconds
                rec["temp_bytes"] = compiled.temp_bytes
                t0 = time.perf_counter()
                outs[name] = jax.tree.map(np.asarray, compiled.executable(*args))
                rec["first_call_s"] = time.perf_counter() - t0
                runs[name] = compiled.executable
            except Exception as e:  # a geometry that does not compile or run
                rec["error"] = error_text(e)
            recs[name] = rec
        times = interleaved(runs, args, rounds=ROUNDS[n], warmup=0, shuffle=1)
        for name, rec in recs.items():
            if name in times:
                rec["time_min_s"] = min(times[name].min, rec["first_call_s"])
                rec["runs"] = len(times[name]) + 1
            if name in outs and "OTT dense" in outs:
                rec.update(agreement(outs[name], outs["OTT dense"]))
            records.append(rec)
        del runs, outs
    return records


def cell_time(r: dict) -> str:
    return "not run" if "time_min_s" not in r else f"{r['time_min_s']:.3g}"


def cell_mem(r: dict) -> str:
    return "" if "temp_bytes" not in r else f"{r['temp_bytes'] / 2**20:,.1f}"


def markdown(data: dict) -> str:
    m = data["machine"]
    rows = [["N x M", "workload", "geometry", "time (s)", "temp (MiB)", "vs dense: max abs / rel"]]
    errors = {}
    for r in data["records"]:
        agree = ""
        if "max_abs_diff" in r and r["geometry"] != "OTT dense":
            agree = f"{r['max_abs_diff']:.1e} / {r['max_rel_diff']:.1e}"
        if "error" in r:
            errors.setdefault(r["error"], []).append(f"{r['n']} x {r['m']}, {r['workload']}")
            agree = "failed (below)"
        size = f"{r['n']} x {r['m']}"
        rows.append([size, r["workload"], r["geometry"], cell_time(r), cell_mem(r), agree])
    ratios = []
    for r in data["records"]:
        if r["geometry"] != "adv_jax_math.ott" or "time_min_s" not in r:
            continue
        dense = next(
            o
            for o in data["records"]
            if o["geometry"] == "OTT dense" and (o["n"], o["workload"]) == (r["n"], r["workload"])
        )
        if "time_min_s" in dense:
            speed = dense["time_min_s"] / r["time_min_s"]
            memory = dense["temp_bytes"] / max(r["temp_bytes"], 1)
            ratios.append(
                f"{r['n']} x {r['m']}, {r['workload']}: {speed:.2f}x the speed, "
                f"{memory:,.0f}x less temp"
            )
    lines = [
        f"Measured by `bench/ott_report.py` on {m['nproc']} CPU cores ({m['cpu']}), "
        f"{m['platform']}, jax {m['jax']}, ott-jax {data['ott']}, d = {D}, float32, "
        f"epsilon = {EPS}; commit {m['commit']}. Time: min of {ROUNDS[2000] + 1} calls at "
        f"2000 x 1500, {ROUNDS[20000] + 1} at 20000 x 15000; temp: the compiled program's "
        "temporary memory.",
        *provisional(m),
        "",
        table(rows, "lllrrl"),
        "",
        "Against OTT dense: " + ("; ".join(ratios) or "no run") + ".",
    ]
    for err, where in errors.items():
        lines += ["", f"Not run (`{err}`): {', '.join(where)}."]
    return "\n".join(lines) + "\n"


def write_page(text: str, page: Path = PAGE) -> None:
    page_text = page.read_text()
    if [page_text.count(BEGIN), page_text.count(END)] != [1, 1]:
        raise SystemExit(f"{page}: needs exactly one {BEGIN} and one {END}; put them back")
    head, rest = page_text.split(BEGIN)
    page.write_text(head + BEGIN + "\n" + text + END + rest.split(END)[1])
    print(f"\n{page.relative_to(HERE.parent)} rewritten", file=sys.stderr)


def main() -> None:
    args = arguments(__doc__)
    jax.config.update("jax_enable_compilation_cache", False)
    start, tree = time.perf_counter(), tree_state()
    data: dict[str, Any] = {
        "machine": machine(tree),
        "ott": importlib.metadata.version("ott-jax"),
        "quick": args.quick,
        "records": [],
    }
    for n, m in QUICK_SIZES if args.quick else SIZES:
        data["records"] += measure(n, m)
    finish_run(data, tree, start)
    text = markdown(data)
    save(args.out, "ott", data, text)
    if args.quick:
        print("\nquick run: docs/guides/ott.md not touched", file=sys.stderr)
    elif data["machine"]["uncommitted"] and not args.allow_dirty:
        print("\ndocs not updated: uncommitted changes (commit, or --allow-dirty)", file=sys.stderr)
        sys.exit(1)
    else:
        write_page(text)


if __name__ == "__main__":
    main()
