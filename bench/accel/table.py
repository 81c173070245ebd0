"""The README's compile and roofline tables, from the JSON records of ``compile_targets.py``.

    python bench/accel/table.py RESULTS_DIR [--readme README.md]

Compile table (:func:`table`, ``RESULTS_DIR/accel.md``, the ``accel`` section):

Per case × target: the engine ``explain()`` chose (``K`` fused kernel with its block
rows, ``K mgpu`` where it is the Pallas Mosaic GPU kernel, not Triton's, or ``scan``;
the same for the backward kernel after ``bwd``),
whether the compile succeeded, the compiled temp memory, and for GPUs the ptxas
registers and spill bytes of the kernel, for TPUs the modelled VMEM of one block; for
``value_and_grad`` cases the backward kernel's block (``bwd K n``), or ``bwd scan``
where reverse mode loops over the scan engine's chunks.

Roofline table (:func:`roofline_table`, ``RESULTS_DIR/roofline.md``, which the
accelerators guide includes; the ``roofline`` section): for the ``roofline_*`` cases
on every target, the roofline model's time for the forward and the backward pass of
the fused kernels against the scan engine (``explain().roofline``), and what the scan
engine's compiled programs hold, counted from their HLO (``hlo.py``: loop trips x
launches per trip). A model, labelled so: no hardware ran these.

``--readme`` rewrites both README sections.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from kinds import KINDS
from publish import commit, markdown_table, write_section

# The device table's order; a GPU's backend variants (compile_targets.VARIANTS) after it:
# ``h100.triton`` a column of the table, ``.no-triton`` summed up under it.
TARGETS = tuple(
    t
    for kind in KINDS
    for t in (kind, *(() if kind.startswith("v") else (f"{kind}.triton", f"{kind}.no-triton")))
)
COLUMNS = tuple(t for t in TARGETS if not t.endswith(".no-triton"))


def cell(rec: dict) -> str:
    if not rec.get("compiled"):
        return "**FAIL** " + (rec.get("error") or "").splitlines()[-1][:60].replace("|", "/")
    ex = rec.get("explain", {})
    engine = ex.get("backend", "?")
    temp = rec.get("temp_bytes")
    mem = "" if temp is None else f", {temp / 2**20:.1f} MiB"
    if engine != "pallas":
        return f"scan{mem}"
    mgpu = "(Pallas Mosaic GPU" in ex.get("reason", "")
    text = f"{'K mgpu' if mgpu else 'K'} {ex.get('block_rows')}{mem}"
    ptx = rec.get("ptxas") or []
    if ptx:
        regs = max(p.get("registers", 0) for p in ptx)
        spill = max(p.get("spill_stores", 0) + p.get("spill_loads", 0) for p in ptx)
        text += f", {regs}r" + (f" **{spill} B spill**" if spill else "")
    vmem = re.search(r"VMEM model: ([\d.]+) MiB", ex.get("reason", ""))
    if vmem:
        text += f", VMEM {vmem.group(1)} MiB"
    if rec.get("grad"):  # value_and_grad: the backward kernel's block, or the scan's loop
        bwd = re.match(r"backward kernel, blocks of (\d+) rows", ex.get("backward", ""))
        fused = bwd and rec.get("backward_kernel") and not rec.get("while_loops")
        bwd_mgpu = "per program (Pallas Mosaic GPU" in ex.get("backward", "")
        kernel = "K mgpu" if bwd_mgpu else "K"
        text += f"; bwd {kernel} {bwd.group(1)}" if fused else "; bwd scan"
    return text


def without_triton(records: dict[str, list[dict]]) -> list[str]:
    """One line per ``.no-triton`` run: what kept a kernel, what fell back and why."""
    lines = []
    for t in TARGETS:
        if not t.endswith(".no-triton") or t not in records:
            continue
        recs = records[t]
        plans = [r.get("explain", {}) for r in recs]
        kept = sum(e.get("backend") == "pallas" for e in plans)
        mosaic = sum("(Pallas Mosaic GPU" in e.get("reason", "") for e in plans)
        missing = sum("Pallas Triton is missing" in e.get("reason", "") for e in plans)
        failed = [r["case"] for r in recs if not r.get("compiled")]
        lines.append(
            f"- {t.split('.')[0]}: {kept} of {len(recs)} cases kept a kernel "
            f"({mosaic} Pallas Mosaic GPU's), {missing} fell back to scan saying "
            f"Pallas Triton is missing"
            + (f"; did not compile: {', '.join(failed)}" if failed else "")
        )
    if lines:
        lines = [
            "",
            "With `jax.experimental.pallas.triton` unimportable (`TARGET.no-triton`, as a jax "
            "without Pallas Triton would have it):",
            *lines,
        ]
    return lines


def table(records: dict[str, list[dict]]) -> str:
    targets = [t for t in COLUMNS if t in records]
    cases = list(dict.fromkeys(r["case"] for t in targets for r in records[t]))
    by = {(t, r["case"]): r for t in targets for r in records[t]}
    rows = [
        [case, *(cell(by[t, case]) if (t, case) in by else "" for t in targets)] for case in cases
    ]
    lines = [markdown_table([["case", *targets], *rows])]
    fallbacks = sorted(
        {
            f"- {case} on {t}: {by[t, case]['explain'].get('reason', '')[:240]}"
            for t in targets
            for case in cases
            if (t, case) in by
            and by[t, case].get("compiled")
            and by[t, case].get("explain", {}).get("backend") != "pallas"
            and "compile" in by[t, case].get("explain", {}).get("reason", "")
        }
    )
    if fallbacks:
        lines += ["", "Fell back to scan because the kernel did not compile:", *fallbacks]
    return "\n".join(lines + without_triton(records))


def load(results: pathlib.Path) -> dict[str, list[dict]]:
    """The records of ``compile_targets.py --json`` in ``results``, per target."""
    return {
        p.stem: json.loads(p.read_text())
        for p in sorted(results.glob("*.json"))
        if p.stem in TARGETS
    }


def us(cost: dict) -> float:
    return cost["seconds"] * 1e6


def fmt(cost: dict | None) -> str:
    return "-" if cost is None else f"{us(cost):,.0f}"


def hlo(rec: dict, program: str) -> str:
    info = (rec.get("scan_hlo") or {}).get(program)
    if not info or info.get("launches") is None:
        return "-"
    loops = info.get("loops") or []
    if not loops:
        return f"{info['launches']}"
    main = max(loops, key=lambda lp: lp["trips"] * lp["launches"])
    return f"{info['launches']} ({main['trips']}x{main['launches']})"


def analysis(rec: dict) -> str:
    """XLA's own cost_analysis() of the scan programs, where the compiler gives one."""
    found = {k: v for k, v in (rec.get("scan_cost_analysis") or {}).items() if v}
    if not found:
        return "none"
    return "; ".join(
        f"{k}: {v.get('flops', 0) / 1e9:.2f} GFLOP, {v.get('bytes accessed', 0) / 1e6:.0f} MB"
        for k, v in found.items()
    )


def where_time_goes(case: str, recs: dict[str, dict]) -> str:
    """One sentence per case, from the H100 (else the first target) figures."""
    target = "h100" if "h100" in recs else next(iter(recs))
    models = {m["name"]: m for m in recs[target].get("explain", {}).get("roofline", [])}
    if not models:
        return f"- **{case}**: no model on {target} (the kernel was not planned)."
    parts = []
    for name in ("forward", "backward"):
        m = models.get(name)
        if m is None:
            continue
        k, s = m["kernel"], m["scan"]
        launch_share = s["launches"] * s["launch"] / s["seconds"] if s["seconds"] else 0
        parts.append(
            f"{name}: the scan engine's {s['launches']} launches are {launch_share:.0%} of its "
            f"modelled {us(s):,.0f} us, the kernels move {k['bytes'] / 1e6:,.1f} MB in "
            f"{k['launches']} launches ({us(k):,.0f} us, "
            f"{'memory' if k['bytes'] / k['bandwidth'] >= k['flops'] / k['peak'] else 'compute'}"
            f"-bound at {k['parallel']:.0%} of the device)"
        )
    return f"- **{case}** on {target}: " + "; ".join(parts) + "."


def roofline_table(records: dict[str, list[dict]]) -> str:
    """The ``roofline_*`` cases: modelled times and the scan programs' launches."""
    targets = [t for t in KINDS if t in records]
    by = {(t, r["case"]): r for t in targets for r in records[t]}
    cases = list(
        dict.fromkeys(
            r["case"] for t in targets for r in records[t] if r["case"].startswith("roofline_")
        )
    )
    head = ["case", "target", "fwd kernel", "fwd scan", "scan HLO launches", "bwd kernel"]
    rows = [[*head, "bwd scan", "scan HLO launches (value_and_grad)", "cost_analysis"]]
    notes = []
    for case in cases:
        recs = {t: by[t, case] for t in targets if (t, case) in by}
        for t, rec in recs.items():
            models = {m["name"]: m for m in rec.get("explain", {}).get("roofline", [])}
            f, b = models.get("forward"), models.get("backward")
            fwd = [fmt(f and f["kernel"]), fmt(f and f["scan"]), hlo(rec, "forward")]
            bwd = [fmt(b and b["kernel"]), fmt(b and b["scan"]), hlo(rec, "value_and_grad")]
            rows.append([case, t, *fwd, *bwd, analysis(rec)])
        notes.append(where_time_goes(case, recs))
    legend = (
        "Modelled microseconds (a roofline model: `src/adv_jax_math/plan/roofline.py`; no GPU or "
        "TPU ran these), forward and backward pass of the fused kernels against the scan "
        "engine; the scan engine's compiled programs counted from their HLO (launches in "
        "total, and trips x launches of the main loop)."
    )
    return "\n".join([legend, "", markdown_table(rows, align="llrrrrrrl"), "", *notes])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", type=pathlib.Path)
    ap.add_argument("--readme", type=pathlib.Path)
    args = ap.parse_args()
    records = load(args.results)
    shared = [t for t, recs in records.items() if any(r.get("same_process") for r in recs)]
    how = (
        f"; {', '.join(shared)}: all cases in one process (`--same-process`), the rest each "
        "case in a fresh one"
        if shared
        else ""
    )
    texts = {
        "accel": f"Generated by `make test-accel` at commit {commit()} (deviceless compiles on a "
        "CPU-only host; `K n` = fused kernel with blocks of n rows (`K mgpu n`: Pallas "
        "Mosaic GPU's, else Triton's on GPUs), then compiled temp "
        "memory, ptxas registers per thread (GPU) or the planner's VMEM model (TPU); "
        "for value_and_grad, `bwd K n` = the backward kernel's block (`bwd K mgpu n`: Pallas "
        "Mosaic GPU's), `bwd scan` = the scan engine's loop; registers are the most any "
        "kernel of the program uses; `h100.triton`: Pallas Triton forced by "
        '`config(gpu_backend="triton")`' + how + ").\n\n" + table(records),
        "roofline": f"Generated by `make test-accel` at commit {commit()}. "
        + roofline_table(records),
    }
    for name, text in texts.items():
        (args.results / f"{name}.md").write_text(text + "\n")
        print(text)
        if args.readme:
            write_section(name, text, args.readme)


if __name__ == "__main__":
    main()
