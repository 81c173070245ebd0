"""Measure the cases of ``bench_pairwise`` (a Gaussian kernel sum, k-NN, Sinkhorn): ours
against pykeops, OTT-JAX, dense XLA and the nested ``batch_map`` form, on this CPU; write
``bench/results/pairwise.{json,md}``.

Run with ``.venv/bin/python bench/pairwise_report.py`` or ``make bench-pairwise``
(about 15 minutes on 2 cores: the 1e5 cases are 1e10 pairs each); ``--quick`` is a
smoke run at small sizes (about a minute; writes to ``bench/.cache/quick`` unless
``--out`` says otherwise). pykeops 2.3 and ott-jax 0.6 come from the ``bench-pairwise``
extra; where they are not installed their rows say so and the rest runs.

Per case, all contenders in one process:

* prepare: a JAX contender is compiled once (``_timing.compile_fn``, tracing included);
  pykeops is called once on 8 rows, which compiles its formula (C++, cached in
  ``bench/.cache/keops``) at the first run;
* check: the first full call's result against the case's reference (``bench_pairwise``:
  float64 NumPy on 1024 sampled x rows, or the float64 dense Sinkhorn loop), to
  ``1e-4`` of the reference's largest magnitude; this call is the warm-up, and a
  contender that fails it is not timed;
* run time: min and median of rounds interleaved in a shuffled order
  (``_timing.interleaved``), so that the load of other processes hits all alike; a
  slow contender may take part in fewer rounds (with 0 its checking call is its one
  sample).

Throughput is pairs (``f`` evaluations: ``N * M`` per call, twice per Sinkhorn
iteration) over the min time; GFlop/s counts the same flops per pair for every
contender (``bench_pairwise.pair_flops`` of ours' ``f`` plus the reduction's), so a
contender that does more or less arithmetic per pair (a matmul expansion, a sort) is
credited the formula's. The peak is a stated assumption (:func:`f32_peak`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import time
import traceback
from pathlib import Path

import bench_pairwise as bp
import jax
import numpy as np
from _timing import first_call, staged
from publish import markdown_table as table
from publish import publish, tree_state
from report import arguments, finish_run, machine, save

HERE = Path(__file__).resolve().parent
SHUFFLE_SEED = 1
FMA_UNITS = 2  # 512-bit FMA units per core: an assumption (1 on some Xeon SKUs)


def cases(quick: bool) -> tuple[bp.Case, ...]:
    """The issue's sizes; ``quick``: small ones, few rounds."""
    if quick:
        return (
            bp.gaussian(2000, rounds=3),
            bp.gaussian(10_000, rounds=2, slow_rounds=1),
            bp.knn(10_000, rounds=2),
            bp.sinkhorn(2000, 20, rounds=2),
            bp.attention(2048, rounds=2),
            bp.attention(2048, grad=True, rounds=2),
        )
    return (
        bp.gaussian(10_000, rounds=5),
        # 1e10 pairs: ours about 10 s a call, pykeops and the nested form a minute or more
        bp.gaussian(100_000, rounds=3, slow_rounds=1),
        bp.knn(100_000, rounds=2),
        bp.sinkhorn(10_000, 50, rounds=3),
        *(bp.attention(n, grad) for n in (4096, 16384) for grad in (False, True)),
    )


def f32_peak() -> dict:
    """This machine's float32 peak, assumed: cores x the nominal clock (``cpu MHz`` of
    /proc/cpuinfo; turbo unknown under a hypervisor) x SIMD lanes (16 with AVX-512, 8
    with AVX2) x 2 flops per FMA x ``FMA_UNITS`` FMA units per core."""
    info = Path("/proc/cpuinfo").read_text().splitlines()
    field = lambda name: next(
        (ln.split(":", 1)[1].strip() for ln in info if ln.startswith(name)), ""
    )
    flags = set(field("flags").split())
    mhz = float(field("cpu MHz") or 0.0)
    cores = len(os.sched_getaffinity(0))
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    fma = FMA_UNITS if "fma" in flags or "avx512f" in flags else 1
    gflops = cores * mhz / 1e3 * lanes * 2 * fma
    return {
        "gflops": gflops,
        "cores": cores,
        "ghz": mhz / 1e3,
        "lanes": lanes,
        "fma_units": fma,
        "assumption": f"{cores} cores x {mhz / 1e3:.2f} GHz x {lanes} float32 lanes "
        f"({'AVX-512' if lanes == 16 else 'AVX2' if lanes == 8 else 'SSE'}) x 2 flops per "
        f"FMA x {fma} FMA units per core (assumed) = {gflops:.0f} GFlop/s",
    }


def versions() -> dict:
    out = {}
    for dist in ("jax", "jaxlib", "pykeops", "keopscore", "ott-jax", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def available(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def measure(case: bp.Case, peak: float) -> tuple[list[dict], list[dict]]:
    """The case's records (one per contender run) and its skipped contenders."""
    args = case.args()
    fpp = case.flops_per_pair()
    base = {
        "case": case.name,
        "size": case.size,
        "description": case.description,
        "n": case.n,
        "m": case.m,
        "dim": case.dim,
        "pairs": case.pairs,
        "flops_per_pair": fpp,
        "roofline_flops_f": bp.roofline_flops(case.pair_fn, *case.pair_args),
    }
    skipped = [{**base, "contender": name, "why": why} for name, why in case.skipped]
    recs: dict[str, dict] = {}
    calls: dict[str, object] = {}
    first: dict[str, float] = {}
    for c in case.contenders:
        if c.needs and not available(c.needs):
            dist = {"ott": "ott-jax"}.get(c.needs, c.needs)
            why = f"{dist} not installed (pip install -e '.[bench-pairwise]')"
            skipped.append({**base, "contender": c.name, "why": why})
            continue
        rec = {**base, "contender": c.name, "ours": c.ours, "context": c.context}
        rec["host"] = c.host
        if c.plan is not None:
            plan = c.plan(*args)
            rec.update(engine=plan.engine, tiles=list(plan.tiles), plan=str(plan))
        else:
            rec["engine"] = c.engine
        print(f"  {c.name}: prepare, check ...", file=sys.stderr, flush=True)
        try:
            call, rec["prepare_s"] = c.build(args)
            out, first[c.name] = first_call(call)
            rec["check"] = case.verify(c, out)
            del out
        except Exception as e:  # a contender that fails is reported, not timed
            rec["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            traceback.print_exc()
            recs[c.name] = rec
            continue
        rec["first_call_s"] = first[c.name]
        calls[c.name] = call
        recs[c.name] = rec
    rounds = {
        c.name: case.rounds if c.rounds is None else c.rounds
        for c in case.contenders
        if c.name in calls
    }
    print(f"  timing {rounds} ...", file=sys.stderr, flush=True)
    times = staged(calls, (), rounds, SHUFFLE_SEED, first)
    ours = next((c.name for c in case.contenders if c.ours and not c.context), None)
    for name, t in times.items():
        recs[name].update(
            samples=list(t.samples),
            runs=len(t),
            time_min_s=t.min,
            time_median_s=t.median,
            gpairs_s=case.pairs / t.min / 1e9,
            gflops=case.pairs * fpp / t.min / 1e9,
            pct_peak=100 * case.pairs * fpp / t.min / 1e9 / peak,
        )
    if ours in times:
        for name, t in times.items():
            recs[name]["vs_ours_min"] = t.min / times[ours].min
            recs[name]["vs_ours_median"] = t.median / times[ours].median
    calls.clear()
    return list(recs.values()), skipped


# -- the markdown -----------------------------------------------------------------------------


def _s(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _err(rec: dict) -> str:
    if "error" in rec:
        return f"**failed**: {rec['error']}"
    chk = rec["check"]
    text = f"{chk['rel_error']:.1e}"
    if "rows_same_indices" in chk:
        text += f" ({100 * chk['rows_same_indices']:.1f}% rows same indices)"
    return text


def markdown(data: dict) -> str:
    m, peak = data["machine"], data["peak"]
    v = data["versions"]
    rows = [
        [
            "case",
            "size",
            "contender",
            "engine",
            "min s",
            "median s",
            "runs",
            "Gpairs/s",
            "GFlop/s",
            "% f32 peak",
            "time / ours (min)",
            "max rel. error",
        ]
    ]
    skipped: dict[tuple, list[dict]] = {}
    for sk in data["skipped"]:
        skipped.setdefault((sk["case"], sk["size"]), []).append(sk)
    for i, r in enumerate(data["records"]):
        name = r["contender"] + (" (context)" if r.get("context") else "")
        if "time_min_s" not in r:
            rows.append([r["case"], r["size"], name, r["engine"], *["-"] * 7, _err(r)])
        else:
            rows.append(
                [
                    r["case"],
                    r["size"],
                    f"**{name}**" if r["ours"] and not r.get("context") else name,
                    r["engine"],
                    _s(r["time_min_s"]),
                    _s(r["time_median_s"]),
                    str(r["runs"]),
                    f"{r['gpairs_s']:.3g}",
                    f"{r['gflops']:.3g}",
                    f"{r['pct_peak']:.1f}",
                    f"{r['vs_ours_min']:.2f}x" if "vs_ours_min" in r else "-",
                    _err(r),
                ]
            )
        key, after = (r["case"], r["size"]), data["records"][i + 1 : i + 2]
        if not after or (after[0]["case"], after[0]["size"]) != key:  # the case's last row
            for sk in skipped.pop(key, []):
                why = f"not run: {sk['why']}"
                rows.append([sk["case"], sk["size"], sk["contender"], why, *["-"] * 8])
    for sks in skipped.values():  # cases none of whose contenders ran
        for sk in sks:
            why = f"not run: {sk['why']}"
            rows.append([sk["case"], sk["size"], sk["contender"], why, *["-"] * 8])
    fpp = {}
    for r in data["records"]:
        fpp.setdefault(r["case"], r["flops_per_pair"])
    lines = [
        "# ajm.pairwise on this CPU: against pykeops, OTT-JAX, dense XLA, nested batch_map",
        "",
        f"{m['cpu']}, {m['nproc']} cores, {m['platform']}; jax {v['jax']}, pykeops "
        f"{v['pykeops']}, ott-jax {v['ott-jax']}; commit {m['commit']}"
        + (" (quick run)" if data["quick"] else "")
        + f"; load average {m['load_average_start'][0]:.1f} at the start, "
        f"{m['load_average_end'][0]:.1f} at the end; {data['seconds'] / 60:.1f} min in all.",
        "",
        table(rows),
        "",
        "Times are seconds per call: min and median of rounds interleaved in a shuffled "
        "order, in one process (another process's load hits all alike; with 2 cores shared, "
        "the min is the better estimate). Gpairs/s: pair evaluations (N x M per call; twice "
        "per Sinkhorn iteration) per second at the min time. **GFlop/s counts the same "
        "flops per pair for every contender**: the elementwise arithmetic of ours' per-pair "
        "jaxpr, each operation one flop per element (exp and x**2 included, a sum of n "
        "elements n - 1), plus the reduction's (ADD: 1; LOGSUMEXP: 3, the shift, the exp, "
        "the add; SOFTMAX_WEIGHTED: 3; top_k: 0; a dot product of d features 2d): "
        + ", ".join(f"{case} {n}" for case, n in fpp.items())
        + f". % f32 peak against {peak['assumption']}. time / ours > 1: ours is faster. "
        "Errors: max |out - ref| / max |ref| against float64 (NumPy on 1024 sampled x rows; "
        "the float64 dense loop for Sinkhorn); k-NN compares the exact distances of the "
        "returned indices, so ties may pick other rows.",
        "",
        *(f"- {d}" for d in data["descriptions"]),
        "",
        "Reproduce with `make bench-pairwise` (or `.venv/bin/python bench/pairwise_report.py`; "
        "`--quick` for a smoke run); `make bench` runs `bench/bench_pairwise.py` with "
        "pytest-benchmark at small sizes.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = arguments(__doc__)

    jax.config.update("jax_enable_compilation_cache", False)
    start = time.perf_counter()
    tree = tree_state()
    peak = f32_peak()
    data: dict = {
        "machine": machine(tree),
        "peak": peak,
        "versions": versions(),
        "quick": args.quick,
        "keops_cache": os.path.relpath(os.environ["KEOPS_CACHE_FOLDER"], HERE.parent),
        "records": [],
        "skipped": [],
        "descriptions": [],
    }
    for case in cases(args.quick):
        print(f"{case} ({case.pairs:.1e} pairs) ...", file=sys.stderr, flush=True)
        recs, skipped = measure(case, peak["gflops"])
        data["records"] += recs
        data["skipped"] += skipped
        text = f"{case.name}: {case.description}"
        if text not in data["descriptions"]:
            data["descriptions"].append(text)
    finish_run(data, tree, start)
    text = markdown(data)
    save(args.out, "pairwise", data, text, default=_json)
    body = text.split("\n", 2)[2]  # without its title
    publish("pairwise-bench", body, data, quick=args.quick, allow_dirty=args.allow_dirty)
    failed = [
        f"{r['case']} {r['size']}: {r['contender']}"
        for r in data["records"]
        if "error" in r and not r["context"]
    ]
    if failed:
        sys.exit(f"checks failed: {failed}")


def _json(o: object) -> object:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o))


if __name__ == "__main__":
    main()
