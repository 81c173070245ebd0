"""The pairwise roofline model's tables, per target: a MODEL, no device measured them.

    .venv/bin/python bench/accel/pairwise_roofline.py [--out bench/results/pairwise_roofline.md]

For each target of ``compile_targets.py`` (h100 h200 a100 v5e v6e v5p v4),
``pairs.roofline.pairwise_cost`` of the pairwise tile kernel at the tiles the planner
gives it (``pairs.tiles.kernel``: GPU (64, 64), TPU (512, 256), halved on v4) on:

* KeOps' benchmark, the Gaussian kernel sum ``sum_j exp(-|x_i - y_j|^2 / s) b_j``, D = 3,
  f32, N = M = 1e6, forward and ``value_and_grad`` (w.r.t. x and y), beside KeOps'
  published 1.38 s on an RTX 2080 Ti scaled by the ratio of f32 peaks (GPUs only);
* attention for one head: softmax-weighted sums of the values by ``q . k / sqrt(D)``,
  N = M = 8192 and 32768, D = 64 and 128, forward;
* cross-entropy's logsumexp over the vocabulary: tokens x vocabulary rows of a dot
  product, T = 8192, V = 32768 and 128256, D = 4096, forward.

Prints the Markdown; ``--out`` also writes it (``bench/results/pairwise_roofline.md``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the model traces jaxprs only

import argparse
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from kinds import KINDS

import adv_jax_math as ajm
from adv_jax_math.pairs.roofline import SPECIAL_FLOPS, PairwiseCost, pairwise_cost
from adv_jax_math.plan.roofline import DEVICES

KEOPS_SECONDS, KEOPS_PEAK = 1.38, 13.4e12  # RTX 2080 Ti: KeOps' figure, its f32 peak
S, F32 = jax.ShapeDtypeStruct, jnp.float32


def gauss(s: float = 0.5) -> Callable:
    """KeOps' ``Exp(-p * SqNorm2(x - y)) * b`` with ``p = 1 / s``; y rows carry b."""
    p = 1.0 / s
    return lambda xi, yj: jnp.exp(-p * jnp.sum((xi - yj[0]) ** 2)) * yj[1]


def attention(d: int) -> Callable:
    scale = 1.0 / d**0.5
    return lambda q, kv: (jnp.dot(q, kv[0]) * scale, kv[1])


def cases() -> list[tuple[str, str, Callable, Any, Any, Any, bool]]:
    """(workload, sizes, f, x, y, reduction, grad)."""
    n = 10**6
    keops = (gauss(), S((n, 3), F32), (S((n, 3), F32), S((n,), F32)), ajm.ADD)
    out = [
        ("Gaussian sum (KeOps)", "1e6 x 1e6, D=3", *keops, False),
        ("Gaussian sum (KeOps)", "1e6 x 1e6, D=3", *keops, True),
    ]
    for t in (8192, 32768):
        for d in (64, 128):
            kv = (S((t, d), F32), S((t, d), F32))
            sizes = f"{t} x {t}, D={d}"
            out.append(("attention, 1 head", sizes, attention(d), S((t, d), F32), kv,
                        ajm.SOFTMAX_WEIGHTED, False))  # fmt: skip
    for v in (32768, 128256):
        out.append(("cross-entropy logsumexp", f"8192 x {v}, D=4096", jnp.dot,
                    S((8192, 4096), F32), S((v, 4096), F32), ajm.LOGSUMEXP, False))  # fmt: skip
    return out


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
`src/adv_jax_math/_roofline_pairwise.py` (`pairwise_cost`) computes for the pairwise tile
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
    text = "\n".join(parts + reading(costs)) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
