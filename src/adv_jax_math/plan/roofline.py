"""A roofline model of one call's passes: the fused kernels against the scan engine.

A model, and labelled so wherever it shows (``explain()``, ``make test-accel``'s
table); nothing here is measured. A pass costs

    time = max(bytes / HBM bandwidth, flops / peak) / parallel + launches * launch

* **bytes**: what the pass must move through HBM. A kernel reads its inputs once,
  its constants once and writes (and XLA then reads) one partial per program; the
  backward kernel also writes the inputs' cotangents. A scan engine chunk copies
  its rows out of the inputs (a dynamic slice: read, written, read again) and
  writes and reads back every intermediate XLA cannot fuse away (the outputs of
  dots, reductions, sorts, gathers: :func:`fusions`), plus its carry.
* **flops**: ``jax.experimental.roofline`` on ``fun``'s jaxpr (every operation,
  ``unfused_flops``), against the device's dense matmul peak at the precision XLA
  uses for float32 (TF32 on GPU, bfloat16 passes on TPU): optimistic for the
  elementwise part, the same for both engines.
* **launches**: the kernels (and XLA's merge of their partials), or the scan
  engine's loop trips times the fusions in its body (fun's, the chunk's slice and
  the loop counter), at a stated cost per launch
  (:attr:`Device.launch`: an assumption, until ``bench/device_check.sh`` runs on
  the hardware).
* **parallel**: the share of the device a pass keeps busy. A kernel has one
  program per block of rows: a grid of ``g`` programs fills ``min(1, g / cores)``
  of a GPU's SMs or a TPU's TensorCores. A scan chunk's fusions fill
  ``min(1, elements / (cores * 1024))`` of a GPU (1024 elements per SM: 256
  threads of 4), all of a TPU.

The devices' figures are the device table's (``core.devices``: :class:`Device`,
:data:`DEVICES`, :func:`device`), re-exported here. The planner uses the model
(``FusedEngine``): where it says a kernel is slower than the scan engine, the
kernel is not picked, and ``explain()`` says why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ..core.devices import DEVICES, Device, device
from ..core.trace import sub_jaxprs

__all__ = [
    "DEVICES",
    "Cost",
    "Device",
    "device",
    "flops",
    "fusions",
    "kernel_pass",
    "nbytes",
    "scan_pass",
]


@dataclasses.dataclass(frozen=True)
class Cost:
    """One pass (or several, added) as the model sees it."""

    bytes: float
    flops: float
    launches: int
    parallel: float = 1.0

    def seconds(self, d: Device) -> float:
        work = max(self.bytes / d.bandwidth, self.flops / d.peak)
        return work / max(self.parallel, 1e-9) + self.launches * d.launch

    def __add__(self, other: Cost) -> Cost:
        """Two passes one after the other (parallel: weighted by their work)."""
        work = self.bytes + other.bytes or 1.0
        share = (self.bytes * self.parallel + other.bytes * other.parallel) / work
        return Cost(
            self.bytes + other.bytes,
            self.flops + other.flops,
            self.launches + other.launches,
            share if self.bytes + other.bytes else min(self.parallel, other.parallel),
        )

    def brief(self, d: Device) -> str:
        return (
            f"{self.seconds(d) * 1e6:,.0f} us ({self.bytes / 1e6:,.1f} MB, "
            f"{self.flops / 1e9:,.2f} GFLOP, {self.launches} launches"
            + (f", {self.parallel:.0%} of the device" if self.parallel < 1 else "")
            + ")"
        )


def nbytes(avals: Sequence[Any]) -> int:
    return sum(math.prod(a.shape) * jax.numpy.dtype(a.dtype).itemsize for a in avals)


def flops(fun: Callable, *avals: Any) -> float:
    """Every floating-point operation of ``fun`` on ``avals`` (0 where
    ``jax.experimental.roofline`` does not import: it needs ``absl``, which jax does not
    require; a TPU machine's jax 0.10.2 lacked it, and every planned call failed)."""
    try:  # on first use: 9 ms of import
        from jax.experimental import roofline
    except ImportError:
        return 0.0

    _, result = roofline.roofline(fun)(*avals)
    return float(result.unfused_flops)


# What XLA writes to HBM inside a fused program: the outputs of these (elementwise
# producers and consumers fuse into them).
_ROOTS = {
    "dot_general",
    "conv_general_dilated",
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
    "sort",
    "top_k",
    "gather",
    "scatter",
    "scatter-add",
    "scatter_add",
    "transpose",
}


def fusions(jaxpr: Any) -> tuple[int, int]:
    """``(fusions, bytes)`` the model gives a program of ``jaxpr``'s operations in
    XLA: one fusion per operation whose output is materialized (``_ROOTS``, and
    loops) plus one, and those outputs' bytes written and read back."""
    roots, moved = _roots(jaxpr)
    return roots + 1, moved


def _roots(jaxpr: Any) -> tuple[int, int]:
    roots, moved = 0, 0
    for eqn in jaxpr.eqns:
        subs = list(sub_jaxprs(eqn.params))
        if eqn.primitive.name in _ROOTS or (subs and eqn.primitive.name in ("scan", "while")):
            roots += 1
            moved += 2 * nbytes([v.aval for v in eqn.outvars])
        for sub in subs if eqn.primitive.name not in ("scan", "while") else ():
            r, m = _roots(sub)  # a call: its body is inlined
            roots, moved = roots + r, moved + m
    return roots, moved


def kernel_pass(
    d: Device,
    *,
    inputs: Sequence[Any],
    consts: Sequence[Any],
    partials: Sequence[Any],
    grid: int,
    flops: float,
    outputs: Sequence[Any] = (),
) -> Cost:
    """One kernel over every row, then XLA's merge of its programs' partials."""
    moved = nbytes(inputs) + nbytes(consts) + nbytes(outputs) + 2 * grid * nbytes(partials)
    return Cost(moved, flops, 2, min(1.0, grid / d.cores))


def scan_pass(
    d: Device,
    *,
    chunks: int,
    inputs: Sequence[Any],
    jaxpr: Any,
    carry: Sequence[Any],
    flops: float,
    outputs: Sequence[Any] = (),
) -> Cost:
    """The scan engine's loop of ``chunks`` trips over a chunk's program ``jaxpr``
    (``inputs``: one chunk's rows; ``outputs``: one chunk's written rows)."""
    count, moved = fusions(jaxpr)
    per_chunk = nbytes(inputs) + moved + 2 * nbytes(carry) + nbytes(outputs)
    if chunks > 1:  # a loop: each trip's dynamic slice copies the chunk out (read,
        # written, read by fun) and the counter is incremented: two more launches
        per_chunk, count = per_chunk + 2 * nbytes(inputs), count + 2
    elems = max(
        [math.prod(a.shape) for a in inputs]
        + [
            math.prod(v.aval.shape)
            for e in jaxpr.eqns
            for v in e.outvars
            if hasattr(v.aval, "shape")
        ]
    )
    gpu = d.platform == "cuda"
    parallel = min(1.0, elems / (d.cores * 1024)) if gpu else 1.0
    return Cost(chunks * per_chunk, chunks * flops, chunks * count, parallel)
