"""Compile the pairwise tile kernel (``kernels/pairwise_device.py``) for real GPUs and
TPUs on a CPU-only host (DESIGN.md §6), at KeOps-like sizes.

Run by ``make accel-pairwise`` inside the compile-only venvs (``setup_venvs.sh``)::

    JAX_PLATFORMS=cpu PYTHONPATH=src .venv-accel-gpu/bin/python \
        bench/accel/pairwise_targets.py --target h100 --json OUT.json [--quick]

Per case (a monoid, ``f``, N x M rows of D features, f32): the kernel's forward pass,
``jax.jit(...).lower(avals).compile()`` on a one-device mesh of a compile-only device
of the target; records whether it compiled (else the compiler's first lines), whether
the kernel's custom call is in the program and any HLO while loop outside it, the
compiled temp bytes and the compile time. ``--table DIR`` prints the Markdown table
of every ``DIR/*.json`` (``--readme README.md`` rewrites its section). The kernel is
not dispatched by ``pairwise()`` yet: this is the compile evidence for doing so.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

SIZES = [(2000, 1500, 3), (200_003, 199_999, 3), (200_003, 199_999, 16)]
QUICK_SIZES = [(2000, 1500, 3)]
TILES = {"gpu": (64, 64), "tpu": (512, 256)}  # (bi, bj)
BEGIN, END = "<!-- pairwise-accel:begin -->", "<!-- pairwise-accel:end -->"


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
        "softmax-weighted": (ajm.SOFTMAX_WEIGHTED, lambda a, b: (-sq(a, b), b[0])),
        "top_k(10)": (ajm.top_k(10, smallest=True), sq),
    }


def compile_case(platform, mesh, name, monoid, f, n, m, d) -> dict:
    import jax
    import jax.numpy as jnp

    from adv_jax_math._pairwise_kernel import recognized
    from adv_jax_math.kernels.fused_reduce.targets import pallas_triton
    from adv_jax_math.kernels.pairwise_device import Layout, device_states

    rec = {"case": name, "n": n, "m": m, "d": d}
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
        layout = Layout("tpu", TILES["tpu"], params=params)
    else:
        layout = Layout("gpu", TILES["gpu"], params=pallas_triton().CompilerParams(num_warps=4))
    rec["tiles"] = list(layout.tiles)
    x, y = (jax.ShapeDtypeStruct((r, d), jnp.float32) for r in (n, m))
    row = jax.ShapeDtypeStruct((d,), jnp.float32)
    start = time.perf_counter()
    try:
        red = recognized(f, x, y, monoid, 16)
        pair = lambda xi, yj: [
            s[0] for s in red.prologue(jax.tree.map(lambda v: v[None], f(xi, yj)))
        ]
        closed = jax.make_jaxpr(pair)(row, row)
        run = lambda x, y: device_states(closed.jaxpr, red, closed.consts, [x], [y], layout)
        with jax.set_mesh(mesh):
            compiled = jax.jit(run).lower(x, y).compile()
        text = compiled.as_text() or ""
        memory = compiled.memory_analysis()
        marker = "tpu_custom_call" if platform == "tpu" else "triton"
        rec.update(
            compiled=True,
            kernel=marker in text,
            while_loops=text.count(" while("),
            temp_bytes=getattr(memory, "temp_size_in_bytes", None),
        )
    except Exception as e:  # the record says what failed; the table shows it
        rec.update(compiled=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    rec["seconds"] = round(time.perf_counter() - start, 2)
    return rec


def table(directory: pathlib.Path) -> str:
    records = {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}
    targets = [t for t in ("h100", "h200", "a100", "v5e", "v6e", "v5p", "v4") if t in records]
    rows = {}
    for target in targets:
        for rec in records[target]:
            key = (rec["case"], f"{rec['n']:,} x {rec['m']:,}, D={rec['d']}")
            if rec.get("compiled"):
                ok = "ok" if rec["kernel"] and not rec["while_loops"] else "ok, no kernel?"
                cell = f"{ok} {rec['seconds']:.1f} s"
            else:
                cell = "**no**: " + rec["error"].split(":")[0]
            rows.setdefault(key, {})[target] = cell
    lines = [
        "| case | N x M, D | " + " | ".join(targets) + " |",
        "|---|---|" + "---|" * len(targets),
    ]
    for (case, size), cells in rows.items():
        lines.append(f"| {case} | {size} | " + " | ".join(cells.get(t, "") for t in targets) + " |")
    return "\n".join(lines)


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
            path = pathlib.Path(args.readme)
            readme = path.read_text()
            head, rest = readme.split(BEGIN)
            _, tail = rest.split(END)
            path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
        return
    from compile_targets import make_mesh

    platform, mesh = make_mesh(args.target)
    records = []
    for n, m, d in QUICK_SIZES if args.quick else SIZES:
        for name, (monoid, f) in cases().items():
            rec = compile_case(platform, mesh, name, monoid, f, n, m, d)
            print(args.target, json.dumps(rec), flush=True)
            records.append(rec)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(records, indent=1))
    # softmax-weighted sums are not tiled yet (NotUnrolled): recorded, not a failure
    expected = lambda r: r["compiled"] or r["error"].startswith("NotUnrolled")
    sys.exit(0 if all(map(expected, records)) else 1)


if __name__ == "__main__":
    main()
