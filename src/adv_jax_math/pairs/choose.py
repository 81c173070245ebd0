"""Which kernel a pairwise reduction takes on a GPU or TPU (or interpreted): the tile
kernel (``kernels/pairwise_device.py``, ``f``'s features unrolled) where it takes
``f`` and ``f`` has no wide dot product or squared distance, else the matmul tile
kernel (``kernels/matmul_tiles.py``); each compiled (or lowered) for the target at its
tiles before it is chosen."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from ..core.targets import pallas_triton, tpu_vmem_limit
from ..core.targets import target as device_target
from ..kernels.pairwise_device import Layout
from ..monoids.reduction import MonoidReduction
from . import tiles as _tiles
from .kernel import layout_problem
from .matmul import blocks, distances, kernel_layout, pair_width

__all__ = ["MATMUL_DISTANCES", "device_kernel", "kernel_for"]

# Squared distances over this many features or more take the matmul tile kernel, not
# the tile kernel: on a TPU v5e, k-NN top-8 at D = 128 (1e5 x 1e4) took 25.7 ms there
# and 179 ms unrolled. Below (KeOps' D = 3 and 16 measured and tuned unrolled) they
# stay unrolled, with the direct form's rounding; 16-63: not measured on a device.
MATMUL_DISTANCES = 64


def device_kernel(
    f: Callable, x: Any, y: Any, red: MonoidReduction, tiles: Any, platform: str
) -> tuple[Layout | None, str]:
    """The layout of a kernel for ``platform`` compiled (or lowered) at its tiles: the
    tile kernel's (features unrolled), else the matmul tiles' (None: neither; and why
    not, the reasons joined)."""
    kind = "tpu" if platform == "tpu" else "gpu"
    target = device_target(platform)
    vmem = tpu_vmem_limit(target.device_kind)
    rows = (jax.tree.leaves(x)[0].shape[0], jax.tree.leaves(y)[0].shape[0])
    chosen = _tiles.device(kind, tiles, vmem, rows=rows)
    if isinstance(chosen, str):
        return None, chosen
    if kind == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        params: Any = pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=vmem,
        )
    else:
        params = pallas_triton().CompilerParams(num_warps=4)
    matmul = _tiles.device(kind, tiles, vmem, matmul=True, rows=rows)
    assert not isinstance(matmul, str)  # (the same checks as the tile kernel's)
    if tiles == "auto":
        matmul = _within(*matmul, pair_width(f, x, y, red), 128 if kind == "tpu" else 16)
    return kernel_for(f, x, y, red, Layout(kind, chosen, params=params), target, matmul)


def kernel_for(
    f: Callable,
    x: Any,
    y: Any,
    red: MonoidReduction,
    layout: Layout,
    target: Any,
    matmul_tiles: tuple[int, int] | None = None,
) -> tuple[Layout | None, str]:
    """The tile kernel at ``layout`` where it takes ``f``, else the matmul tile kernel
    at ``matmul_tiles`` (default: the same; None: neither), each compiled (or lowered)
    for ``target`` (None: traced only); and why the tile kernel (and the matmul one)
    did not."""
    problem = layout_problem(f, x, y, red, layout, target)
    if problem is None and isinstance(blocks(f, x, y, red), tuple):
        wide = sorted({n for n, _ in distances(f, x, y, red) if n >= MATMUL_DISTANCES})
        if wide:
            problem = f"f's squared distances over {wide[-1]} features: a matmul, not unrolled"
    if problem is None:
        return layout, ""
    bi, bj = matmul_tiles or layout.tiles
    least = 128 if layout.kind == "tpu" else 16
    # its tiles, else halves of them (TPU v4's 16 MiB of VMEM: a top-k at 256 x 512)
    tried = [(bi, bj), (bi, bj // 2), (bi // 2, bj // 2)]
    for tiles in dict.fromkeys(t for t in tried if target is None or min(t) >= least):
        on = dataclasses.replace(layout, kind="matmul", tiles=tiles, on=layout.kind)
        matmul = kernel_layout(f, x, y, red, on, target)
        if isinstance(matmul, Layout):
            return matmul, f"the tile kernel: {problem}"
        if target is None:  # (traced only: not a matter of size)
            break
    return None, f"the tile kernel: {problem}; the matmul tile kernel: {matmul}"


def _within(bi: int, bj: int, width: int, least: int) -> tuple[int, int]:
    """The "auto" matmul kernel tiles halved (the larger side first, down to
    ``least``) until a value of ``width`` elements per pair holds no more elements
    than a score of the tiles given (TPU v5e, 4096 x 4096 pairs with an L1 distance
    over 64 features beside a squared one: probing 512 x 1024, then its halves, took
    341 s; at 128 x 128, 10 s)."""
    pairs = bi * bj
    while bi * bj * width > pairs and max(bi, bj) > least:
        bi, bj = (bi, max(least, bj // 2)) if bj >= bi else (max(least, bi // 2), bj)
    return bi, bj
