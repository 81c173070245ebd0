"""The README's roofline table, from the JSON records of ``compile_targets.py``.

    python bench/accel/roofline_table.py RESULTS_DIR [--readme README.md]

For the ``roofline_*`` cases on every target: the roofline model's time for the
forward pass and for the backward pass of the fused kernels against the scan
engine (``explain().roofline``; ``_roofline`` says how it is made), and what the
scan engine's compiled programs hold, counted from their HLO (``hlo.py``: loop
trips x launches per trip). A model, labelled so: no hardware ran these. Writes
``RESULTS_DIR/roofline.md`` (the accelerators guide includes it), and rewrites the
README between ``<!-- roofline:begin -->`` and ``<!-- roofline:end -->`` when
``--readme`` is given.
"""

from __future__ import annotations

import argparse
import json
import pathlib

TARGETS = ("h100", "h200", "a100", "v5e", "v6e", "v5p", "v4")
BEGIN, END = "<!-- roofline:begin -->", "<!-- roofline:end -->"


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


def table(records: dict[str, list[dict]]) -> str:
    targets = [t for t in TARGETS if t in records]
    by = {(t, r["case"]): r for t in targets for r in records[t]}
    cases = list(
        dict.fromkeys(
            r["case"] for t in targets for r in records[t] if r["case"].startswith("roofline_")
        )
    )
    lines = [
        "| case | target | fwd kernel | fwd scan | scan HLO launches | bwd kernel | bwd scan "
        "| scan HLO launches (value_and_grad) | cost_analysis |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    notes = []
    for case in cases:
        recs = {t: by[t, case] for t in targets if (t, case) in by}
        for t, rec in recs.items():
            models = {m["name"]: m for m in rec.get("explain", {}).get("roofline", [])}
            f, b = models.get("forward"), models.get("backward")
            lines.append(
                f"| {case} | {t} | {fmt(f and f['kernel'])} | {fmt(f and f['scan'])} | "
                f"{hlo(rec, 'forward')} | {fmt(b and b['kernel'])} | {fmt(b and b['scan'])} | "
                f"{hlo(rec, 'value_and_grad')} | {analysis(rec)} |"
            )
        notes.append(where_time_goes(case, recs))
    legend = (
        "Modelled microseconds (a roofline model: `src/adv_jax_math/_roofline.py`; no GPU or "
        "TPU ran these), forward and backward pass of the fused kernels against the scan "
        "engine; the scan engine's compiled programs counted from their HLO (launches in "
        "total, and trips x launches of the main loop)."
    )
    return "\n".join([legend, "", *lines, "", *notes])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", type=pathlib.Path)
    ap.add_argument("--readme", type=pathlib.Path)
    args = ap.parse_args()
    records = {
        p.stem: json.loads(p.read_text())
        for p in sorted(args.results.glob("*.json"))
        if p.stem in TARGETS
    }
    text = table(records)
    (args.results / "roofline.md").write_text(text + "\n")  # the docs include it
    print(text)
    if args.readme:
        readme = args.readme.read_text()
        if readme.count(BEGIN) != 1 or readme.count(END) != 1:
            raise SystemExit(f"{args.readme} needs exactly one {BEGIN} and one {END}")
        head, rest = readme.split(BEGIN)
        args.readme.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END)[1])


if __name__ == "__main__":
    main()
