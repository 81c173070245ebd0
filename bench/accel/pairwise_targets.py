"""Compile the pairwise tile kernel (``kernels/pairwise_device.py``) for real GPUs and
TPUs on a CPU-only host (DESIGN.md §6), at KeOps-like sizes.

Run by ``make accel-pairwise`` inside the compile-only venvs (``setup_venvs.sh``)::

    JAX_PLATFORMS=cpu PYTHONPATH=src .venv-accel-gpu/bin/python \
        bench/accel/pairwise_targets.py --target h100 --json OUT.json [--quick]

Per case (a monoid, ``f``, N x M rows of D features, f32): ``ajm.pairwise`` as users
call it, forward and ``jax.value_and_grad`` w.r.t. ``x`` and ``y``, compiled with
``jax.jit(...).lower(avals).compile()`` under ``jax.set_mesh`` of a one-device mesh of
a compile-only device of the target (the planner's own compile probe runs in that
trace); records the engine ``explain_pairwise`` plans, whether it compiled (else the
compiler's first lines), how many kernels and HLO while loops the program holds, the
compiled temp bytes and the compile time. ``--table DIR`` prints the Markdown table
of every ``DIR/*.json`` (``--readme README.md`` rewrites its section).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # compile_targets
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from publish import markdown_table, write_section

SIZES = [(2000, 1500, 3), (200_003, 199_999, 3), (200_003, 199_999, 16)]
QUICK_SIZES = [(2000, 1500, 3)]


def cases():  # name: (monoid, f)
    import jax.numpy as jnp

    import adv_jax_math as ajm

    sq = lambda a, b: jnp.sum((a - b) ** 2)
    return {
        "gauss add": (ajm.ADD, lambda a, b: jnp.exp(-sq(a, b))),
        "logsumexp": (ajm.LOGSUMEXP, lambda a, b: -sq(a, b)),
        "argmin": (ajm.ARGMIN, sq),
        "min_argmin": (ajm.MIN_ARGMIN, sq),
        "weighted logsumexp": (ajm.WEIGHTED_LOGSUMEXP, lambda a, b: (-sq(a, b), b[0] ** 2)),
        # attention's form: a score and a vector (y's D features) per pair
        "softmax-weighted": (ajm.SOFTMAX_WEIGHTED, lambda a, b: (-sq(a, b), b)),
        "top_k(10)": (ajm.top_k(10, smallest=True), sq),
    }


def compile_case(platform, mesh, name, monoid, f, n, m, d, mode) -> dict:
    """``ajm.pairwise(f, x, y, monoid)`` (``mode`` "forward") or ``jax.value_and_grad``
    of the sum of its float results w.r.t. ``x`` and ``y``, compiled on ``mesh``."""
    import jax
    import jax.numpy as jnp

    import adv_jax_math as ajm

    rec = {"case": name, "mode": mode, "n": n, "m": m, "d": d}
    x, y = (jax.ShapeDtypeStruct((r, d), jnp.float32) for r in (n, m))
    forward = lambda x, y: ajm.pairwise(f, x, y, monoid)
    run = forward
    if mode == "value_and_grad":
        loss = lambda x, y: sum(
            jnp.sum(v) for v in jax.tree.leaves(forward(x, y)) if v.dtype == jnp.float32
        )
        run = jax.value_and_grad(loss, argnums=(0, 1))
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            plan = ajm.explain_pairwise(f, x, y, monoid)
            compiled = jax.jit(run).lower(x, y).compile()
        rec.update(engine=plan.engine, tiles=list(plan.tiles))
        text = compiled.as_text() or ""
        memory = compiled.memory_analysis()
        marker = "tpu_custom_call" if platform == "tpu" else "triton"
        rec.update(
            compiled=True,
            kernels=text.count(marker) if platform == "tpu" else int(marker in text),
            while_loops=text.count(" while("),
            temp_bytes=getattr(memory, "temp_size_in_bytes", None),
        )
    except Exception as e:  # the record says what failed; the table shows it
        rec.update(compiled=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    rec["seconds"] = round(time.perf_counter() - start, 2)
    return rec


def table(directory: pathlib.Path) -> str:
    records = {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}
    from kinds import KINDS

    targets = [t for t in KINDS if t in records]
    rows = {}
    for target in targets:
        for rec in records[target]:
            size = f"{rec['n']:,} x {rec['m']:,}, D={rec['d']}"
            key = (rec["case"], rec["mode"], size)
            if not rec.get("compiled"):
                cell = "**FAIL**: " + rec["error"].split(":")[0]
            elif "kernel" not in rec["engine"]:
                cell = "scan"
            else:
                fused = rec["kernels"] and not rec["while_loops"]
                cell = (
                    "K" if fused else f"K + {rec['while_loops']} loops"
                ) + f" {rec['seconds']:.0f} s"
            rows.setdefault(key, {})[target] = cell
    return markdown_table(
        [
            ["case", "pass", "N x M, D", *targets],
            *([*key, *(cells.get(t, "") for t in targets)] for key, cells in rows.items()),
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--table")
    ap.add_argument("--readme")
    args = ap.parse_args()
    if args.table:
        text = table(pathlib.Path(args.table))
        print(text)
        if args.readme:
            write_section("pairwise-accel", text, pathlib.Path(args.readme))
        return
    from compile_targets import make_mesh

    platform, mesh = make_mesh(args.target)
    records = []
    for n, m, d in QUICK_SIZES if args.quick else SIZES:
        for name, (monoid, f) in cases().items():
            for mode in ("forward", "value_and_grad"):
                if mode == "value_and_grad" and name in ("argmin",):
                    continue  # integer results: nothing to differentiate
                rec = compile_case(platform, mesh, name, monoid, f, n, m, d, mode)
                print(args.target, json.dumps(rec), flush=True)
                records.append(rec)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(records, indent=1))
    sys.exit(0 if all(r["compiled"] for r in records) else 1)


if __name__ == "__main__":
    main()
