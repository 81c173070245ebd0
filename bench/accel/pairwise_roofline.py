"""The pairwise roofline model's tables, per target: a MODEL, no device measured them.

    .venv/bin/python bench/accel/pairwise_roofline.py [--out bench/results/pairwise_roofline.md]

For each target of ``compile_targets.py`` (h100 h200 a100 v5e v6e v5p v4),
``pairwise_model.pairwise_cost`` of the pairwise tile kernel at the tiles the planner
gives it (``pairs.tiles.kernel``: GPU (64, 64), TPU (512, 256), halved on v4) on:

* KeOps' benchmark, the Gaussian kernel sum ``sum_j exp(-|x_i - y_j|^2 / s) b_j``, D = 3,
  f32, N = M = 1e6, forward and ``value_and_grad`` (w.r.t. x and y), beside KeOps'
  published 1.38 s on an RTX 2080 Ti scaled by the ratio of f32 peaks (GPUs only);
* attention for one head: softmax-weighted sums of the values by ``q . k / sqrt(D)``,
  N = M = 8192 and 32768, D = 64 and 128, forward;
* cross-entropy's logsumexp over the vocabulary: tokens x vocabulary rows of a dot
  product, T = 8192, V = 32768 and 128256, D = 4096, forward;
* issue 41: attention as a flash-attention-style kernel on the matrix units would run it
  (``pairwise_model.attention_cost``: the matmul tiles' flops at the bf16 tensor-core
  peak), forward and backward, bf16, H100 and A100, d = 64 and 128, N = M = 8k-32k,
  beside FlashAttention-2's and -3's published figures (``attention_section``).

Prints the Markdown; ``--out`` also writes it (``bench/results/pairwise_roofline.md``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the model traces jaxprs only

import argparse
import pathlib
import sys
from collections.abc import Callable
from typing import Any

from kinds import KINDS
from pairwise_model import (
    ALU_PER_SCORE,
    BF16_PEAK,
    BWD_FLOPS,
    SPECIAL_FLOPS,
    PairwiseCost,
    attention_cost,
    pairwise_cost,
)

from adv_jax_math.plan.roofline import DEVICES

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from cases import pairwise

KEOPS_SECONDS, KEOPS_PEAK = 1.38, 13.4e12  # RTX 2080 Ti: KeOps' figure, its f32 peak


def cases() -> list[tuple[str, str, Callable, Any, Any, Any, bool]]:
    """(workload, sizes, f, x, y, reduction, grad): the cases of ``bench/cases/pairwise.py``."""
    n, ce = 10**6, pairwise.CROSS_ENTROPY
    keops = pairwise.gaussian(p=2.0)  # KeOps' Exp(-p * SqNorm2(x - y)), p = 1 / s, s = 0.5
    out = [("Gaussian sum (KeOps)", "1e6 x 1e6, D=3", keops, (n, n, 3), g) for g in (False, True)]
    out += [
        ("attention, 1 head", f"{t} x {t}, D={d}", pairwise.attention(d), (t, t, d), False)
        for t in (8192, 32768)
        for d in (64, 128)
    ]
    out += [
        ("cross-entropy logsumexp", f"8192 x {v}, D=4096", ce, (8192, v, 4096), False)
        for v in (32768, 128256)
    ]
    return [(w, s, c.f, *c.inputs(*size), c.reduction, g) for w, s, c, size, g in out]


def fmt_seconds(s: float) -> str:
    return f"{s:,.3f} s" if s >= 1 else f"{s * 1e3:,.3g} ms" if s >= 1e-3 else f"{s * 1e6:,.3g} us"


def row(name: str, sizes: str, grad: bool, c: PairwiseCost) -> str:
    d = c.device
    programs = ", ".join(dict.fromkeys(f"{p.programs} at {p.parallel:.0%}" for p in c.passes))
    if d.step:  # TPU: the grid steps, from the passes' step overhead
        steps = sum(round((p.launch - 4 * d.launch) / d.step) for p in c.passes)
        programs += f"; {steps:,} grid steps"
    limits = "/".join(dict.fromkeys(p.limit for p in c.passes))
    keops = "-"
    if name.startswith("Gaussian") and not grad and d.platform == "cuda":
        keops = fmt_seconds(KEOPS_SECONDS * KEOPS_PEAK / d.vector)
    elif name.startswith("Gaussian") and not grad:
        keops = "no KeOps figure (TPU)"
    matmul = "-" if name.startswith("Gaussian") else fmt_seconds(c.flops / d.peak)
    mode = "value_and_grad" if grad else "forward"
    return (
        f"| {name} | {mode} | {sizes} | {c.tiles[0]} x {c.tiles[1]} | {programs} | "
        f"**{fmt_seconds(c.seconds)}** | {c.bound} ({limits}) | {c.intensity:,.0f} | "
        f"{c.flops / (c.n * c.m):,.0f} | {c.bytes / 1e9:,.2f} | {keops} | {matmul} |"
    )


HEADER = (
    "| workload | mode | N x M, D | tiles | programs (occupancy) | model time | bound "
    "(kernel limit) | flop/byte | ALU flops/pair, all passes | HBM GB | KeOps x 13.4 / f32 peak | "
    "same flops at matmul peak |\n|---|---|---|---|---|---:|---|---:|---:|---:|---:|---:|"
)

CAPTION = f"""\
# Pairwise reductions: the roofline MODEL on GPUs and TPUs

**A model, not a measurement: no GPU or TPU ran any of this.** Every time below is what
`bench/accel/pairwise_model.py` (`pairwise_cost`) computes for the pairwise tile
kernel (`kernels/pairwise_device.py`) at the tiles the planner gives it; generated on a
CPU-only host by `.venv/bin/python bench/accel/pairwise_roofline.py --out
bench/results/pairwise_roofline.md`.

How the model counts (the module's note has the rest):

- **bytes**: x read once; y once per x tile, through L2 on a GPU (from HBM once when y fits
  in half the L2, else every time: no reuse between programs assumed, an upper bound),
  from HBM every time on a TPU (the y BlockSpec streams each y tile for each x tile); the
  states written once; XLA's layout copies and the final result around the kernel.
- **flops**: per pair from `f`'s jaxpr (`jax.experimental.roofline`'s unfused flops of
  the live equations, plus the max/min reductions, tanh and pow it leaves at 0) and the
  monoid's fold and merges, on the padded tiles.
  Each transcendental (exp) counts {SPECIAL_FLOPS} ALU flops more (range reduction) and
  runs on the SFUs (GPU, 16 per clock per SM) or the EUP (TPU, one vreg per clock:
  assumed) beside the ALUs. The kernel unrolls the features: no dot reaches tensor cores
  or the MXU, so the **elementwise** f32 peak bounds it (H100/H200 67, A100 19.5 TFLOP/s,
  an FMA two flops, so unpaired adds/muls run at half of it: optimistic up to 2x; TPU VPU
  8 x 128 lanes x 2 (v4) or 4 (v5+) ALUs at the clock the bf16 peak implies: v4 4.3,
  v5e 6.1, v6e 7.2, v5p 14.3 TFLOP/s).
- **overheads**: four launches a pass at `_roofline.Device.launch` (4 us GPU, 2 us TPU,
  assumed) and on TPU 0.35 us per grid step (assumed, unpublished): with 512 x 256 tiles
  at N = M = 1e6 that is 7.6 million steps, 2.7 s, so the TPU Gaussian rows rest on that
  number (they are compute-bound at about the ALU time without it).
- **value_and_grad** (w.r.t. x and y): the forward pass, a dx pass over x tiles streaming
  y, a dy pass over y tiles streaming x, each recomputing `f` and its VJP per pair.
- **KeOps column**: KeOps' published 1.38 s (Gaussian sum, D = 3, N = M = 1e6, f32, RTX
  2080 Ti) x 13.4 TFLOP/s (the 2080 Ti's f32 peak) / the device's non-tensor-core f32
  peak: a scaling of their figure, not a run of KeOps. No published KeOps figure exists
  for TPUs (KeOps runs on CUDA only) nor, in our sources, for its gradient at this size.
- **attention rows**: the tile kernel takes softmax-weighted sums of a vector per pair
  (one fold per value element), but the planner keeps the scan engine's matmul for a
  dot over 16 or more features: these rows model the tile kernel as if it took the
  dot over D features unrolled. **cross-entropy rows**: the logsumexp of the
  vocabulary's logits only (the label's logit is a gather), D = 4096 features unrolled
  per pair (the same rule keeps the scan engine there).
- **same flops at matmul peak**: the model's flops at `Device.peak` (TF32 / bf16 matmul
  units), for scale: what a dot-based kernel (flash attention, a fused cross-entropy)
  is bounded by; the tile kernel cannot reach it.
"""


def reading(costs: dict[tuple[str, str, str, bool], PairwiseCost]) -> list[str]:
    """What the tables say, from their numbers (the model's, like them)."""
    gauss = {t: costs[t, "Gaussian sum (KeOps)", "1e6 x 1e6, D=3", False] for t in KINDS}
    h100 = gauss["h100"]
    keops = KEOPS_SECONDS * KEOPS_PEAK / h100.device.vector
    dots = [c.seconds / (c.flops / c.device.peak) for (_, w, _, _), c in costs.items()
            if not w.startswith("Gaussian")]  # fmt: skip
    steps = [t for t, c in gauss.items() if c.bound == "launch"]
    return [
        "\n## Reading it (the model's numbers, not measurements)\n",
        f"- KeOps' benchmark on H100: {fmt_seconds(h100.seconds)} modelled against KeOps' "
        f"figure scaled to {fmt_seconds(keops)}; the model counts an FMA as two flops, so "
        "where adds and multiplies do not pair up it is optimistic (up to 2x).",
        f"- On {', '.join(steps)} the Gaussian rows are bound by the assumed 0.35 us per grid "
        "step: one tile's VPU work (16 flops a pair) takes about as long (0.2-0.35 us), so "
        "for small D larger y tiles (bj) would pay, if a measurement confirms the step cost.",
        f"- Attention and cross-entropy: {min(dots):,.0f}x to {max(dots):,.0f}x the time the "
        "same flops take at the matmul peak: with the features unrolled the dots run on the "
        "elementwise units, so these pair functions want a kernel that feeds the dot to the "
        "tensor cores / MXU (flash attention's layout), not this tile kernel.",
    ]


# Published TFLOP/s, FP16, non-causal, H100 80GB SXM5, batch x seqlen = 16k, 2048 hidden
# (FlashAttention-3 paper, arXiv 2407.08608, its forward / backward speed figures, as
# read from the figures' bar labels): (direction, d, N) -> (FA2, FA3, cuDNN).
FA_H100 = {
    ("forward", 64, 8192): (322, 496, 412), ("forward", 64, 16384): (324, 497, 413),
    ("forward", 128, 8192): (370, 646, 600), ("forward", 128, 16384): (370, 648, 595),
    ("backward", 128, 8192): (318, 559, 518), ("backward", 128, 16384): (322, 561, 516),
}  # fmt: skip
ATTENTION_SIZES = (8192, 16384, 32768)


def heads(n: int, d: int) -> int:
    """FlashAttention's benchmark shape: batch x N = 16k tokens (batch 1 from 16k on),
    2048 hidden = heads x d; batch x heads programs' worth of heads."""
    return max(16384 // n, 1) * 2048 // d


def attention_section() -> list[str]:
    """The flash-attention model's rows on H100 and A100 beside the published figures."""
    h100, a100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
    alu = " and ".join(f"{v:g} ({k})" for k, v in ALU_PER_SCORE.items())
    out = [
        "\n## Attention on the matrix units (issue 41): MODEL beside FlashAttention-2/3\n",
        ATTENTION_NOTE.format(alu=alu, bwd=BWD_FLOPS, h100=BF16_PEAK[h100] / 1e12,
                              a100=BF16_PEAK[a100] / 1e12),
        "| GPU | d | N = M | batch x heads | pass | model time | model TFLOP/s (overlap) "
        "| no overlap | % of bf16 peak | bound | exp / MMA time | published TFLOP/s "
        "FA2 / FA3 / cuDNN (H100, FP16) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---|",
    ]  # fmt: skip
    for kind in (h100, a100):
        dev = DEVICES[kind]
        for d in (64, 128):
            for n in ATTENTION_SIZES:
                bh = heads(n, d)
                for p in attention_cost(n, n, d, kind, heads=bh, grad=True):
                    fa = FA_H100.get((p.name, d, n)) if kind == h100 else None
                    pub = " / ".join(map(str, fa)) if fa else "-"
                    out.append(
                        f"| {dev.name} | {d} | {n:,} | {bh} | {p.name} | "
                        f"{fmt_seconds(p.seconds)} | **{p.flops / p.seconds / 1e12:,.0f}** | "
                        f"{p.flops / p.serial / 1e12:,.0f} | "
                        f"{p.flops / p.seconds / BF16_PEAK[kind]:.0%} | {p.bound} | "
                        f"{p.exp / p.mma:.2f} | {pub} |"
                    )
    one = [attention_cost(n, n, 128, h100, heads=1)[0] for n in (8192, 32768)]
    serial = {k: attention_cost(16384, 16384, 128, k, heads=16)[0] for k in (h100, a100)}
    serial = {k: f"{p.flops / p.serial / 1e12:,.0f}" for k, p in serial.items()}
    out += [
        "",
        "- Published, for scale: FlashAttention-3 (FP16) reaches up to 740 TFLOP/s on H100, "
        "75% of its peak, FlashAttention-2 35% there (FA3 abstract); FlashAttention-2 reaches "
        "50-73% of A100's peak (FA2 abstract, arXiv 2307.08691): up to about 228 of 312 "
        "TFLOP/s. The per-size figures above are FA3's own charts (H100; d = 64 backward "
        "and 32k not shown there).",
        "- Reading it: with matmuls, exps and the rest overlapped the model sits at the bf16 "
        "peak (it is an upper bound); without overlap it gives "
        f"{serial[h100]} TFLOP/s on H100 at d = 128, between FA2's 370 and FA3's 648, and "
        f"{serial[a100]} on A100, at FA2's published 73%. At d = 64 the exps take about as "
        "long as the matmuls on H100 (ratio 0.9): the SFUs, not the tensor cores, set the "
        "pace unless they overlap, which is why FA3's d = 64 figures (about 500) trail "
        "its d = 128 ones.",
        f"- One head (what one `ajm.pairwise` call is): at d = 128, N = 8k the forward pass "
        f"has {one[0].programs} programs for 132 SMs ({one[0].parallel:.0%} busy), "
        f"{fmt_seconds(one[0].seconds)}; at 32k {one[1].programs} programs "
        f"({one[1].parallel:.0%}), {fmt_seconds(one[1].seconds)}: heads or batch must fill "
        "the device, or the kernel must split the key rows (flash-decoding's split-K).",
    ]
    return out


ATTENTION_NOTE = """\
`pairwise_model.attention_cost`: what a flash-attention-style kernel on the tensor cores
would take (no such kernel in the library yet: today the matmul tiles run as XLA loops on
GPUs and TPUs, `bench/results/accel-pairwise-matmul.md`). Assumptions:

- **flops** as FlashAttention counts them: 4 N M d per head forward (two matmuls), {bwd}x
  that backward (five matmuls); run at the **dense bf16 tensor-core peak** ({h100:.0f}
  TFLOP/s H100 SXM, {a100:.0f} A100), on padded 128 x 128 tiles (forward: a program per
  128 query rows per head; backward: per 128 key rows, FA2's split).
- **softmax**: one exp per score on the SFUs (16 per clock per SM: 4.2 T/s H100, 2.4 A100)
  and {alu} vector flops per score (scale, max, subtract, sum; backward
  dS) on the FP32 units. **overlap**: the model time takes the longest of matmuls, exps
  and the rest (FA3's ping-pong of two warpgroups); **no overlap** adds them (FA2).
- **bytes**: Q, K, V, O (and LSE) once from HBM; K and V streamed per program through L2
  (5120 B/clock) and from HBM once when the heads in flight fit in half the L2, else per
  program; backward: Q, dO, O read, dK, dV written, dQ accumulated in float32 through L2.
- **shape**: FlashAttention's benchmark, batch x N = 16k tokens (batch 1 from N = 16k
  on), hidden 2048 = heads x d; the programs fill the SMs in whole waves; 4 us a launch.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=pathlib.Path, help="also write the Markdown here")
    args = ap.parse_args()
    parts, costs = [CAPTION], {}
    for target, kind in KINDS.items():
        parts += [f"\n## {target}: {DEVICES[kind].name} (MODEL)\n", HEADER]
        for name, sizes, f, x, y, red, grad in cases():
            c = costs[target, name, sizes, grad] = pairwise_cost(
                f, x, y, red, device=kind, grad=grad
            )
            parts.append(row(name, sizes, grad, c))
    text = "\n".join(parts + reading(costs) + attention_section()) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
