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

from .targets import Target

__all__ = ["choose_block", "choose_steps", "is_pow2", "row_stats"]


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


def choose_steps(target: Target, n: int, rows: int) -> int:
    """Blocks each kernel program reduces in a loop: few enough programs (and partials)."""
    blocks = pl.cdiv(n, rows)
    if target.programs is None or blocks <= target.programs:
        return 1
    steps = pl.cdiv(blocks, target.programs)
    return 1 << (steps - 1).bit_length() if target.triton else steps  # Triton: powers of two
