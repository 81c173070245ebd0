"""Issue 41's matrix-unit cases compiled for GPUs and TPUs on a CPU-only host
(DESIGN.md §6): ``pairwise_targets.py --matmul`` (``make accel-pairwise-matmul``)::

    JAX_PLATFORMS=cpu PYTHONPATH=src .venv-accel-gpu/bin/python \
        bench/accel/pairwise_targets.py --matmul --target h100 --json OUT.json [--quick]
    .venv/bin/python bench/accel/pairwise_targets.py --matmul --table DIR [--out FILE.md]

The grid is ``cases.pairwise.matmul_grid`` (attention at d = 16, 64, 128 in float32 and
bfloat16, k-NN top-8 at D = 128, Sinkhorn at D = 64; 8191 x 16411 and 30011 x 100003
rows; ``--quick``: the small size, attention at d = 64), each forward and
``jax.value_and_grad`` (of the float results' sum, w.r.t. x and y: q, k and v for
attention). Per compile: the engine ``explain_pairwise`` plans; what
``compile_targets.compile_fn`` records (compiled or the compiler's first lines, the
kernel's custom call in the compiled program, its HLO while loops, temp bytes, TPU
VMEM where the compiler reports it); the Pallas kernels' names in the HLO; on GPU the
PTX of the whole program (``ptx.py``: a ``ptxas`` wrapper), with per kernel ptxas'
registers, spills and shared memory and its tensor-core instructions (``mma.sync``,
``wgmma``), and apart from the kernels XLA's own matmuls (Triton ``gemm_fusion``
entries with tensor-core instructions, cuBLAS custom calls); on TPU the XLA dots and
convolutions in the compiled HLO (XLA:TPU runs them on the MXU). Nothing in here
names the kernel to expect: a compile whose program holds a Pallas custom call and no
while loop shows as ``K``, whatever engine planned it.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
import tempfile

import ptx

_PTX: dict = {}  # "dump": the folder the wrapper writes to, or "why": why there is none


def setup(target: str | None) -> None:
    """Before jax loads: on a GPU target, compile PTX through ``ptx.py``'s wrapper."""
    if not target or target.startswith("v"):
        return
    found = ptx.install(pathlib.Path(tempfile.mkdtemp(prefix="ajm-ptx-")))
    if isinstance(found, str):
        _PTX["why"] = found
        return
    flags, _PTX["dump"] = found
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


_CUBLAS = re.compile(r'custom_call_target="__cublas\$(?:lt\$)?[\w$]*"')
_DOTS = re.compile(r"\b(?:dot|convolution)\(")
_MARKERS = ("__gpu$xla.gpu.triton", "triton_kernel_call", "tpu_custom_call", "mosaic_gpu")


class _Keep:
    """``jax.jit(f)`` for ``compile_fn``, keeping the compiled program's HLO text."""

    def __init__(self, jitted):
        self.jitted, self.text = jitted, ""

    def lower(self, *args):
        lowered, keep = self.jitted.lower(*args), self

        class Lowered:
            as_text = staticmethod(lowered.as_text)

            @staticmethod
            def compile():
                compiled = lowered.compile()
                keep.text = compiled.as_text() or ""
                return compiled

        return Lowered()


def compile_case(platform, mesh, point, mode: str) -> dict:
    """``ajm.pairwise`` of ``point`` (a ``cases.pairwise.MatmulCase``), ``mode`` "forward"
    or "value_and_grad", compiled on ``mesh``."""
    import jax
    import jax.numpy as jnp
    from compile_targets import compile_fn

    import adv_jax_math as ajm

    case, n, m, d = point.case, point.n, point.m, point.d
    x, y = case.inputs(n, m, d)
    run = forward = lambda x, y: ajm.pairwise(case.f, x, y, case.reduction)
    if mode == "value_and_grad":
        floats = lambda t: [v for v in jax.tree.leaves(t) if jnp.issubdtype(v.dtype, jnp.floating)]
        loss = lambda x, y: sum(jnp.sum(v.astype(jnp.float32)) for v in floats(forward(x, y)))
        run = jax.value_and_grad(loss, argnums=(0, 1))
    rec = {"case": case.name, "mode": mode, "dtype": point.dtype, "n": n, "m": m, "d": d}
    with jax.set_mesh(mesh):
        plan = ajm.explain_pairwise(case.f, x, y, case.reduction)
        rec.update(engine=plan.engine, tiles=list(plan.tiles), reason=plan.reason)
        rec["rejected"] = [list(r) for r in plan.rejected]
        if "dump" in _PTX:
            ptx.collect(_PTX["dump"])  # drop what the planner's probes compiled
        keep = _Keep(jax.jit(run))
        rec.update(compile_fn(None, (x, y), platform, jitted=keep))
    rec["kernel"] = any(marker in keep.text for marker in _MARKERS)
    rec["kernels"] = ptx.kernel_names(keep.text)
    if platform == "gpu":
        rec["cublas_calls"] = len(_CUBLAS.findall(keep.text))
        rec.update(_gpu_code(rec["kernels"]))
    else:
        rec["xla_dots"] = len(_DOTS.findall(keep.text))
    return rec


def _gpu_code(kernels: list[str]) -> dict:
    """The PTX's tensor-core instructions and ptxas' figures, the kernels' apart."""
    if "dump" not in _PTX:
        return {"ptx": None, "ptx_why": _PTX.get("why", "PTX capture not set up")}
    text, log = ptx.collect(_PTX["dump"])
    if not text:
        return {"ptx": None, "ptx_why": "the compile handed ptxas no PTX (cached?)"}
    mma, report = ptx.mma_counts(text), ptx.ptxas_report(log)
    mine = lambda name: any(name == k or name.startswith(k) for k in kernels)
    return {
        "ptx": {"entries": len(mma)},
        "kernel_mma": {k: v for k, v in mma.items() if mine(k)},
        "kernel_ptxas": {k: v for k, v in report.items() if mine(k)},
        "xla_mma": {k: v for k, v in mma.items() if not mine(k) and v},
    }


def run(target: str, quick: bool, only: list[str] | None = None) -> list[dict]:
    """Every compile of the grid on ``target`` (``only``: of these cases), printed as it
    goes."""
    import json

    from cases import pairwise
    from compile_targets import make_mesh

    platform, mesh = make_mesh(target)
    records = []
    for point in pairwise.matmul_grid(quick):
        if only and point.case.name not in only:
            continue
        for mode in ("forward", "value_and_grad")[: 1 + point.case.differentiable]:
            rec = compile_case(platform, mesh, point, mode)
            print(target, json.dumps(rec), flush=True)
            records.append(rec)
    return records


# -- the table ------------------------------------------------------------------------


def status(rec: dict) -> str:
    if rec.get("unfinished"):  # a record the run left: the compile was stopped, not failed
        return f"not finished: {rec['unfinished']}"
    if not rec.get("compiled"):
        return "**FAIL**: " + (rec.get("error") or "").splitlines()[0][:80].replace("|", "/")
    loops = rec.get("while_loops") or 0
    if rec.get("kernel"):
        return "K" if not loops else f"K + {loops} loops"
    return f"XLA loops ({loops})" if loops else "XLA, no loop"


_SHAPE = re.compile(r"\.(m\d+n\d+k\d+)\b")
_TYPES = re.compile(r"\.(f64|f32|tf32|bf16|f16|e4m3|e5m2|s8|u8|s4|u4|b1)(?=\.|$)")


def short(inst: str) -> str:
    """``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`` -> ``mma.sync m16n8k8 tf32``
    (the shape and the inputs' type: the second type, the first being the result's)."""
    name = "wgmma" if inst.startswith("wgmma") else ".".join(inst.split(".")[:2])
    shape, types = _SHAPE.search(inst), _TYPES.findall(inst)
    return " ".join([name, shape.group(1) if shape else "", types[1] if len(types) > 1 else ""])


def _mma(counts: dict[str, dict[str, int]]) -> str:
    total: dict[str, int] = {}
    for found in counts.values():
        for inst, k in found.items():
            total[short(inst)] = total.get(short(inst), 0) + k
    return ", ".join(f"{k} {inst}" for inst, k in sorted(total.items())) or "none"


def gpu_cells(rec: dict) -> list[str]:
    if not rec.get("compiled"):
        return ["", "", ""]
    if rec.get("ptx") is None:
        code = f"PTX not captured: {rec.get('ptx_why', '?')}"
        return [code, code, f"{rec.get('cublas_calls', 0)} cuBLAS"]
    if rec.get("kernels"):
        figures = rec.get("kernel_ptxas") or {}
        regs = "; ".join(
            f"{f.get('registers')}r/{f.get('spill_stores', 0) + f.get('spill_loads', 0)}B spill/"
            f"{f.get('smem', 0)}B smem"
            for f in figures.values()
        )
        kernel = [regs or "no ptxas report", _mma(rec.get("kernel_mma") or {})]
    else:
        kernel = ["- (no kernel)", "- (no kernel)"]
    xla = rec.get("xla_mma") or {}
    own = f"{len(xla)} Triton gemm entries: {_mma(xla)}" if xla else "no mma in XLA's PTX"
    return [*kernel, own + f"; {rec.get('cublas_calls', 0)} cuBLAS calls"]


def tpu_cells(rec: dict) -> list[str]:
    vm = rec.get("vmem")
    vmem = f"{vm['used']} of {vm['limit']}" if vm else ("-" if not rec.get("kernel") else "n/r")
    return [vmem, f"{rec.get('xla_dots', 0)}"]


def table(directory: pathlib.Path) -> str:
    """One Markdown table per target of ``directory/*.json``."""
    import json

    from kinds import KINDS
    from publish import commit, markdown_table

    records = {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}
    parts = [CAPTION.format(commit=commit())]
    for target in [t for t in KINDS if t in records]:
        gpu = not target.startswith("v")
        extra = (
            ["kernel ptxas regs/spill/smem", "kernel mma", "XLA's own matmuls (PTX, cuBLAS)"]
            if gpu
            else ["kernel VMEM", "XLA dots (MXU)"]
        )
        head = ["case", "pass", "dtype", "N x M, d", "engine planned", "status", "loops"]
        rows = [[*head, *extra, "temp MiB", "s"]]
        for r in records[target]:
            temp = r.get("temp_bytes")
            rows.append(
                [
                    r["case"],
                    r["mode"],
                    r["dtype"],
                    f"{r['n']:,} x {r['m']:,}, d={r['d']}",
                    r.get("engine", "?"),
                    status(r),
                    str(r.get("while_loops", "")),
                    *(gpu_cells(r) if gpu else tpu_cells(r)),
                    "" if temp is None else f"{temp / 2**20:,.1f}",
                    f"{r['seconds']:.0f}" if "seconds" in r else "",
                ]
            )
        parts += [f"\n## {target}: {KINDS[target]}\n", markdown_table(rows), ""]
        plans = {(r["case"], r.get("engine"), r.get("reason", "")) for r in records[target]}
        parts += [f"- {c}: **{e}**: {why[:300]}" for c, e, why in sorted(plans) if why]
    return "\n".join(parts) + "\n"


CAPTION = """\
# Pairwise on the matrix units: deviceless compiles (issue 41)

Generated by `bench/accel/pairwise_targets.py --matmul` (`make accel-pairwise-matmul`)
at commit {commit}: compiled on a CPU-only host for each target (DESIGN.md §6); no
device ran them. **status**: `K` = the compiled program holds a Pallas kernel's custom
call and no HLO while loop; `K + n loops` = a kernel and loops; `XLA loops (n)` = no
kernel, the engine's loops as XLA while loops. **loops**: HLO while loops in the
compiled program. **GPU**: the program's PTX, captured through a `ptxas` wrapper
(`bench/accel/ptx.py`; the nvidia-cuda-nvcc package's ptxas where installed, else the
system's; not nvJitLink): per Pallas kernel, ptxas' registers per thread, spill bytes
and shared memory and its tensor-core instructions (`mma.sync`: Ampere-style warp
MMA; `wgmma.mma_async`: Hopper's warpgroup MMA), and apart from the kernels XLA's own
matmuls: Triton `gemm_fusion` entries (their tensor-core instructions, summed) and
cuBLAS custom calls (tensor cores too, but their code is a library's: not in the PTX).
**TPU**: the kernel's VMEM where the compiler reports it (`n/r`: not reported), and
XLA's dots and convolutions in the compiled HLO (XLA:TPU runs them on the MXU).
"""


def main_args(args) -> int:
    """``pairwise_targets.py --matmul``: compile (``--target``) or tabulate (``--table``)."""
    import json

    if args.table:
        text = table(pathlib.Path(args.table))
        print(text)
        if args.out:
            pathlib.Path(args.out).write_text(text)
        return 0
    records = run(args.target, args.quick, args.case)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(records, indent=1))
    return 0 if all(r.get("compiled") for r in records) else 1


if __name__ == "__main__":
    sys.exit("run it as bench/accel/pairwise_targets.py --matmul")
