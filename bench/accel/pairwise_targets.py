"""Compile the pairwise tile kernel (``kernels/pairwise_device.py``) for real GPUs and
TPUs on a CPU-only host (DESIGN.md §6), at KeOps-like sizes.

Run by ``make accel-pairwise`` inside the compile-only venvs (``setup_venvs.sh``)::

    JAX_PLATFORMS=cpu PYTHONPATH=src .venv-accel-gpu/bin/python \
        bench/accel/pairwise_targets.py --target h100 --json OUT.json [--quick]

Per case (``COMPILED`` of the reductions of ``bench/cases/pairwise.py`` and its k-NN,
N x M rows of D features, f32): ``ajm.pairwise`` as users call it, forward and
``jax.value_and_grad`` w.r.t. ``x`` and ``y``, compiled with
``jax.jit(...).lower(avals).compile()`` under ``jax.set_mesh`` of a one-device mesh of
a compile-only device of the target, the default device too (``on_target``: Mosaic GPU
compiles for the default device's architecture; the planner's own compile probe runs in
that trace); records the engine ``explain_pairwise`` plans and what
``compile_targets.compile_fn`` records: whether it compiled (else the compiler's first
lines), whether the program holds the kernel, its HLO while loops, the compiled temp
bytes, the compile time and on GPUs the tile kernel's ptxas figures (Mosaic GPU's; the
table marks its kernels ``mgpu`` and their spills). ``--table DIR`` prints the Markdown
table of every ``DIR/*.json`` (``--readme README.md`` rewrites its section).

``--matmul``: issue 41's matrix-unit grid instead (attention, k-NN top-8, Sinkhorn;
``matmul_targets.py``), its own records and table (``--table DIR --out FILE.md``);
on a GPU target it first routes XLA's PTX through a ptxas wrapper (``ptx.py``), so it
is set up here, before jax loads.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_VMODULE", "")  # not compile_targets' ptxas log: no kernel reads it

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
if "--matmul" in sys.argv and "--target" in sys.argv[:-1]:
    import matmul_targets

    matmul_targets.setup(sys.argv[sys.argv.index("--target") + 1])
from compile_targets import (  # first: it sets the TPU environment up
    capture_logs,
    compile_fn,
    make_mesh,
    on_target,
    parse_ptxas,
)
from kinds import KINDS
from publish import markdown_table, write_section

# isort: split
from cases import pairwise

SIZES = [(2000, 1500, 3), (200_003, 199_999, 3), (200_003, 199_999, 16)]
QUICK_SIZES = [(2000, 1500, 3)]
# bench/cases/pairwise.py: these reductions (rows of points) and the 10 nearest (k-NN)
COMPILED = ("add", "logsumexp", "argmin", "min_argmin", "weighted_logsumexp", "softmax_weighted")


def cases() -> list[pairwise.Pairwise]:
    return [c for c in pairwise.REDUCTIONS if c.name in COMPILED] + [pairwise.KNN]


def compile_case(platform, mesh, case: pairwise.Pairwise, n, m, d, mode) -> dict:
    """``ajm.pairwise(case.f, x, y, case.reduction)`` (``mode`` "forward") or
    ``jax.value_and_grad`` of the sum of its float results w.r.t. ``x`` and ``y``,
    compiled on ``mesh`` (``compile_targets.compile_fn``)."""
    import jax
    import jax.numpy as jnp

    import adv_jax_math as ajm
    from adv_jax_math.kernels.pairwise_device import DEVICE_KERNEL_NAME

    x, y = case.inputs(n, m, d)
    run = forward = lambda x, y: ajm.pairwise(case.f, x, y, case.reduction)
    if mode == "value_and_grad":
        loss = lambda x, y: sum(
            jnp.sum(v) for v in jax.tree.leaves(forward(x, y)) if v.dtype == jnp.float32
        )
        run = jax.value_and_grad(loss, argnums=(0, 1))
    rec = {"case": case.name, "mode": mode, "n": n, "m": m, "d": d}
    with on_target(mesh, platform):
        with capture_logs() as probe:  # the tile kernel compiled alone, once per case
            plan = ajm.explain_pairwise(case.f, x, y, case.reduction)
        rec.update(engine=plan.engine, tiles=list(plan.tiles))
        rec.update(compile_fn(run, (x, y), platform, kernel=DEVICE_KERNEL_NAME))
    if platform == "gpu":
        rec["ptxas"] = parse_ptxas(probe["text"], DEVICE_KERNEL_NAME) + rec.get("ptxas", [])
    return rec


def table(directory: pathlib.Path) -> str:
    records = {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}
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
                kernel = rec.get("kernel_in_compiled", rec.get("kernels"))  # (or older records')
                fused = kernel and not rec["while_loops"]
                cell = (
                    "K" if fused else f"K + {rec['while_loops']} loops"
                ) + f" {rec['seconds']:.0f} s"
                if "mosaic_gpu" in rec["engine"]:
                    spills = sum(p.get("spill_stores", 0) for p in rec.get("ptxas") or [])
                    cell += " mgpu" + (f" **{spills} B spilled**" if spills else "")
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
    ap.add_argument("--matmul", action="store_true", help="issue 41's matrix-unit grid")
    ap.add_argument("--out", help="--matmul --table: also write the Markdown here")
    ap.add_argument("--case", action="append", help="--matmul: only this case (repeatable)")
    args = ap.parse_args()
    if args.matmul:
        import matmul_targets

        sys.exit(matmul_targets.main_args(args))
    if args.table:
        text = table(pathlib.Path(args.table))
        print(text)
        if args.readme:
            write_section("pairwise-accel", text, pathlib.Path(args.readme))
        return
    platform, mesh = make_mesh(args.target)
    records = []
    for n, m, d in QUICK_SIZES if args.quick else SIZES:
        for case in cases():
            for mode in ("forward", "value_and_grad")[: 1 + case.differentiable]:
                rec = compile_case(platform, mesh, case, n, m, d, mode)
                print(args.target, json.dumps(rec), flush=True)
                records.append(rec)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(records, indent=1))
    sys.exit(0 if all(r["compiled"] for r in records) else 1)


if __name__ == "__main__":
    main()
