"""Block sizing: rows per kernel block and blocks per kernel program.

A block is ``Bk`` rows of every input leaf; ``fun`` is evaluated on one block at
a time. Triton needs power-of-two array sizes; Mosaic TPU needs 2-D blocks with
``Bk % 8 == 0`` and 1-D blocks a power of two >= 128 or a multiple of 1024 (or one
block spanning the whole array).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.experimental import pallas as pl

from ...core.targets import MOSAIC_GPU_ROWS, Target

__all__ = [
    "choose_block",
    "choose_steps",
    "gpu_block",
    "is_pow2",
    "row_stats",
    "tpu_block",
    "tpu_legal_rows",
    "tpu_padded_bytes",
]

# Mosaic stores arrays in (sublane, 128-lane) tiles: 8 sublanes for 4-byte types,
# 16 for 2-byte, 32 for 1-byte; 1-D arrays in tiles of 1024 elements.
_SUBLANES = {8: 8, 4: 8, 2: 16, 1: 32}
# The share of the VMEM limit a block may fill: the model was within ~5% of the
# compiler's reports on v5e/v5p/v6e; v4 counted ~26% more in one case (16.09 MiB at a
# modelled 12.75), so it keeps a wider margin.
_TPU_MARGIN = 0.8
_TPU_MARGIN_V4 = 0.7


def pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def is_pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def row_stats(avals: Sequence[Any]) -> tuple[int, int]:
    """Largest elements and bytes per row of row-mapped arrays (trailing sizes)."""
    elems = max((math.prod(a.shape[1:]) for a in avals), default=1)
    nbytes = max((math.prod(a.shape[1:]) * np.dtype(a.dtype).itemsize for a in avals), default=1)
    return max(1, elems), max(1, nbytes)


def choose_block(
    target: Target, n: int, max_rows: int | None, row_elems: int, row_bytes: int, one_d: bool
) -> int | str:
    """Rows per kernel block, or why no block fits."""
    limit = n if max_rows is None else min(max_rows, n)
    budget = max(1, min(target.block_elems // row_elems, target.block_bytes // row_bytes))
    if target.triton:
        # Power-of-two blocks; a block may run past n (masked), but not past max_rows.
        cap = min(budget, max_rows if max_rows is not None else 1 << (n - 1).bit_length())
        if target.max_elems is not None and row_elems > target.max_elems:
            return f"one row of fun needs {row_elems} elements, over Triton's {target.max_elems}"
        return pow2_floor(cap)
    if target.mosaic_gpu:
        # A warpgroup's 128 threads, a row each (fewer rows: layout inference searched
        # 40 s on H100 before failing at 64), or a TMA copy's 256 where the budget
        # allows (wider rows go in element groups, ``groups``); a block may run past n
        # (its rows read as zeros, masked).
        if max_rows is not None and max_rows < 128:
            return (
                f"Mosaic GPU blocks need at least 128 rows (a warpgroup's threads), but "
                f"batch_size={max_rows}"
            )
        return MOSAIC_GPU_ROWS if min(budget, max_rows or n) >= MOSAIC_GPU_ROWS else 128
    if target.mosaic:
        cap = min(budget, limit)
        if cap >= n:
            return n  # one block spanning the whole array: no alignment rule applies
        if one_d and cap >= 1024:
            return cap // 1024 * 1024
        if one_d and cap >= 128:
            return pow2_floor(cap)
        if not one_d and cap >= 8:
            return cap // 8 * 8
        need = 128 if one_d else 8
        kind = "1-D inputs need" if one_d else "inputs need"
        return (
            f"TPU blocks over {kind} at least {need} rows, but only {cap} fit "
            f"(batch_size={max_rows}, {row_bytes} bytes per row of fun)"
        )
    return max(1, min(budget, limit))


# Triton's blocks of a top-k: at most this many rows times k. Its merge network holds
# k slots of each leaf per element beside the block: 64 rows spilled 1412 bytes at
# k = 16 and 164 at k = 8 on H100 (128 distances per row), 16 and 32 rows none.
TRITON_TOPK_ROWS = 256


def gpu_block(
    tgt: Target, n: int, max_rows: int | None, analysis: Any, terms: Any, one_d: bool
) -> int | str:
    """Rows per block on a GPU target (or why none fits): ``choose_block`` of ``fun``'s
    widest row, a top-k's rows fewer on Triton."""
    slots = max(getattr(t.leaf.monoid, "k", 1) for t in terms)  # (a top-k's)
    if tgt.triton and slots > 1:
        max_rows = min(max_rows or n, max(1, TRITON_TOPK_ROWS // slots))
    return choose_block(tgt, n, max_rows, analysis.row_elems, analysis.row_bytes, one_d)


def choose_steps(target: Target, n: int, rows: int) -> int:
    """Blocks each kernel program reduces in a loop: few enough programs (and partials)."""
    blocks = pl.cdiv(n, rows)
    if target.programs is None or blocks <= target.programs:
        return 1
    steps = pl.cdiv(blocks, target.programs)
    return 1 << (steps - 1).bit_length() if target.triton else steps  # Triton: powers of two


def tpu_padded_bytes(shape: Sequence[int], itemsize: int) -> int:
    """VMEM bytes of an array of ``shape`` in Mosaic's tiled layout."""
    if not shape:
        return 4096  # one vreg
    if len(shape) == 1:  # measured: a (N,) block takes ~10x its bytes (v5e, 422 MiB at
        # 10M f32); counted as rows of 128 lanes, each padded to a full 8-sublane tile
        return -(-int(shape[0]) // 128) * 8 * 128 * itemsize
    sub = _SUBLANES.get(itemsize, 8)
    rows = -(-int(shape[-2]) // sub) * sub
    lanes = -(-int(shape[-1]) // 128) * 128
    return math.prod(int(d) for d in shape[:-2]) * rows * lanes * itemsize


def tpu_legal_rows(rows: int, inputs: Sequence[Any]) -> int:
    """The largest legal TPU block of at most ``rows`` rows over ``inputs`` (at least
    the smallest legal one): 1-D inputs need a power of two >= 128 or a multiple of
    1024, others a multiple of the sublanes of their narrowest type."""
    if any(len(x.shape) == 1 for x in inputs):
        return rows // 1024 * 1024 if rows >= 1024 else max(128, pow2_floor(rows))
    align = _sublane_align(inputs)
    return max(align, rows // align * align)


def _sublane_align(inputs: Sequence[Any]) -> int:
    """Rows a 2-D TPU block must be a multiple of: its narrowest type's sublanes."""
    return max(_SUBLANES.get(np.dtype(x.dtype).itemsize, 8) for x in inputs)


def tpu_block(
    n: int,
    max_rows: int | None,
    *,
    inputs: Sequence[Any],
    consts: Sequence[Any],
    partials: Sequence[tuple[tuple[int, ...], Any]],
    body: Sequence[tuple[tuple[int, ...], Any]],
    traced_rows: int,
    elementwise: bool,
    limit: int,
    f32_math: bool,
    v4: bool = False,
    held: Sequence[tuple[tuple[int, ...], Any]] = (),
    margin: float | None = None,
) -> tuple[int, int] | str:
    """The largest legal TPU block whose VMEM footprint fits ``limit`` and that
    footprint in bytes, or why none does.

    Footprint (measured against Mosaic's own reports, bench/accel/FINDINGS.md): input
    blocks, constants and output partials double-buffered by the pipeline, plus two
    of ``fun``'s largest intermediates live at once (none when ``fun`` is purely
    elementwise: Mosaic streams it through vector registers), all in padded tiles.
    ``body`` holds the avals of ``fun`` traced on ``traced_rows`` rows; those with a
    leading ``traced_rows`` scale with the block. Generations without a bfloat16 VPU
    (``f32_math``) hold 16-bit intermediates as float32. ``held``: arrays the monoids'
    folds hold whole across a reduction (``rules.held_across_reductions``), all live
    at once, counted when they exceed ``fun``'s two. ``margin``: the share of
    ``limit`` a block may fill (default ``_TPU_MARGIN``, v4 ``_TPU_MARGIN_V4``).
    """

    def size(dtype: Any, math_dtype: bool) -> int:
        item = np.dtype(dtype).itemsize
        return max(item, 4) if math_dtype and f32_math and np.dtype(dtype).kind == "f" else item

    def scaled(avals: Sequence[tuple[tuple[int, ...], Any]], bk: int) -> list:
        return [
            ((bk, *shape[1:]) if shape[:1] == (traced_rows,) else shape, dt) for shape, dt in avals
        ]

    def footprint(bk: int) -> int:
        io = sum(tpu_padded_bytes((bk, *x.shape[1:]), size(x.dtype, False)) for x in inputs)
        io += sum(tpu_padded_bytes(tuple(c.shape), size(c.dtype, False)) for c in consts)
        io += sum(tpu_padded_bytes(shape, size(dt, False)) for shape, dt in partials)
        live = 0
        if not elementwise or any(len(x.shape) == 1 for x in inputs):
            live = 2 * max(
                (tpu_padded_bytes(sh, size(dt, True)) for sh, dt in scaled(body, bk)), default=0
            )
        folds = sum(tpu_padded_bytes(sh, max(4, size(dt, True))) for sh, dt in scaled(held, bk))
        return 2 * io + max(live, folds)

    margin = margin or (_TPU_MARGIN_V4 if v4 else _TPU_MARGIN)
    budget = int(margin * limit)
    cap = n if max_rows is None else min(max_rows, n)
    if cap >= n and footprint(n) <= budget:
        return n, footprint(n)  # one block spanning the whole array: no alignment rule

    def largest(unit: int) -> int:  # the largest multiple of unit <= cap that fits
        lo, hi = 0, cap // unit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if footprint(unit * mid) <= budget else (lo, mid - 1)
        return unit * lo

    one_d = any(len(x.shape) == 1 for x in inputs)
    if one_d:  # a power of two >= 128, or a multiple of 1024
        legal = [r for r in (128, 256, 512) if r <= cap]
        best = largest(1024) or max((r for r in legal if footprint(r) <= budget), default=0)
    else:
        align = _sublane_align(inputs)
        legal = [align] if align <= cap else []
        best = largest(align)
    if best:
        return best, footprint(best)
    smallest = legal[0] if legal else (128 if one_d else 8)
    return (
        f"no TPU block fits: {footprint(smallest) / 2**20:.1f} MiB of VMEM at the smallest "
        f"legal block ({smallest} rows, batch_size={max_rows}) against "
        f"{budget / 2**20:.1f} MiB ({margin:.0%} of the {limit >> 20} MiB VMEM limit)"
    )
