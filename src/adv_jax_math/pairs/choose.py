"""Which kernel a pairwise reduction takes on a GPU or TPU (or interpreted): the tile
kernel (``kernels/pairwise_device.py``, ``f``'s features unrolled) where it takes
``f`` and ``f`` has no wide dot product or squared distance, else the matmul tile
kernel (``kernels/matmul_tiles.py``); each compiled (or lowered) for the target at its
tiles before it is chosen."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from ..core import config as _config
from ..core.targets import pallas_triton, silence_triton_deprecation, tpu_vmem_limit
from ..core.targets import target as device_target
from ..kernels.fused_reduce.fused import kernel_targets
from ..kernels.pairwise_device import Layout
from ..monoids.reduction import MonoidReduction
from . import tiles as _tiles
from .kernel import layout_problem, rows_of, state_width
from .matmul import blocks, distances, kernel_layout, pair_width

__all__ = ["MATMUL_DISTANCES", "device_kernel", "interpreted", "kernel_for"]

# Squared distances over this many features or more take the matmul tile kernel, not
# the tile kernel: on a TPU v5e, k-NN top-8 at D = 128 (1e5 x 1e4) took 25.7 ms there
# and 179 ms unrolled. Below (KeOps' D = 3 and 16 measured and tuned unrolled) they
# stay unrolled, with the direct form's rounding; 16-63: not measured on a device.
MATMUL_DISTANCES = 64
# On a TPU, matmul tiles that make several values per pair (a score per head) run in
# XLA's loops: on a TPU v5e (jax 0.10.2) the matmul tile kernel took 46-56 ms for
# multi-head attention (T = 8192, 8 heads of 64, bf16, forward) at tiles from
# 128 x 128 to 512 x 1024, XLA's loops 4.1 ms (bench/device_check.py --heads).
TPU_WIDE_PAIRS = (
    "f makes {} values per pair (a score per head, say): on a TPU v5e the matmul tile "
    "kernel took 46-56 ms for multi-head attention where XLA's loops took 4.1 ms"
)


def device_kernel(
    f: Callable, x: Any, y: Any, red: MonoidReduction, tiles: Any, platform: str
) -> tuple[Layout | None, str]:
    """The layout of a kernel for ``platform`` compiled (or lowered) at its tiles: the
    tile kernel's (features unrolled), else the matmul tiles' (None: neither; and why
    not, the reasons joined). On CUDA GPUs each Pallas backend in turn
    (``fused_reduce.fused.kernel_targets``: Mosaic GPU, then Triton); the reasons of
    those declined come first."""
    declined: list[str] = []
    chain = kernel_targets(platform) if platform != "tpu" else [(device_target("tpu"), None)]
    far = _wide_distances(f, x, y, red)  # (traced once for every backend)
    for target, why in chain:
        kind = "tpu" if platform == "tpu" else "mosaic_gpu" if target.mosaic_gpu else "gpu"
        found, why = (None, why) if why else _device_kernel(f, x, y, red, tiles, kind, target, far)
        if found is not None or len(chain) == 1:
            return found, "; ".join([*declined, why] if why else declined)
        declined.append(f"{target.label} not used: {why}")
    return None, "; ".join(declined)


def _device_kernel(
    f: Callable,
    x: Any,
    y: Any,
    red: MonoidReduction,
    tiles: Any,
    kind: str,
    target: Any,
    far: str | None,
) -> tuple[Layout | None, str]:
    """:func:`device_kernel` on one backend (``kind``: ``"gpu"``, Pallas Triton;
    ``"mosaic_gpu"``; ``"tpu"``); ``far``: :func:`_wide_distances`' reason."""
    if kind == "mosaic_gpu":
        return _mosaic_gpu(f, x, y, red, tiles, target, far)
    vmem = tpu_vmem_limit(target.device_kind)
    rows = (rows_of(x, "x"), rows_of(y, "y"))
    chosen = _tiles.device(kind, tiles, vmem, rows=rows)
    if isinstance(chosen, str):
        return None, chosen
    if kind == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        params: Any = pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=vmem,
        )
    else:  # (explain() says Triton, deprecated: its warning at every lowering is not shown)
        params = pallas_triton().CompilerParams(num_warps=4)
        silence_triton_deprecation()
    matmul = _tiles.device(kind, tiles, vmem, matmul=True, rows=rows)
    assert not isinstance(matmul, str)  # (the same checks as the tile kernel's)
    width = pair_width(f, x, y, red) if tiles == "auto" or kind == "tpu" else 1
    wide = TPU_WIDE_PAIRS.format(width) if kind == "tpu" and width > 1 else None
    if tiles == "auto" and kind == "gpu":
        matmul = _tiles.triton_matmul(matmul, red, width, far is not None)
    layout = Layout(kind, chosen, params=params)
    return kernel_for(f, x, y, red, layout, target, far, matmul, wide)


def interpreted(
    f: Callable,
    x: Any,
    y: Any,
    red: MonoidReduction,
    tiles: Any,
    rows_tiles: tuple[int, int],
    kind: str,
) -> tuple[Layout | None, str, str]:
    """``backend="interpret"``'s tile kernel: ``kind``'s (``"gpu"``, ``"tpu"``) at the
    tiles ``rows_tiles``, or with ``config(gpu_backend="mosaic_gpu")`` Mosaic GPU's in
    its interpreter at its own tiles; the layout (None: neither tile kernel), why not,
    and which kind was tried."""
    far = _wide_distances(f, x, y, red)
    if _config.current().gpu_backend != "mosaic_gpu":
        return (*kernel_for(f, x, y, red, Layout(kind, rows_tiles, True), None, far), kind)
    return (*_mosaic_gpu(f, x, y, red, tiles, None, far), "mosaic_gpu")


def _mosaic_gpu(
    f: Callable, x: Any, y: Any, red: MonoidReduction, tiles: Any, target: Any, far: str | None
) -> tuple[Layout | None, str]:
    """The Mosaic GPU tile kernel at its tiles, compiled (or lowered) for ``target``
    (None: interpreted, traced only), or why not (the matmul tiles are Triton's and
    Mosaic TPU's)."""
    rows = (rows_of(x, "x"), rows_of(y, "y"))
    chosen = _tiles.device("mosaic_gpu", tiles, 0, rows=rows, held=_held(f, x, y, red))
    if isinstance(chosen, str):
        return None, f"the tile kernel: {chosen}"
    layout = Layout("mosaic_gpu", chosen, target is None)
    if far:
        return None, f"{far}, and the matmul tiles are Triton's"
    problem = layout_problem(f, x, y, red, layout, target)
    return (None, f"the tile kernel: {problem}") if problem else (layout, "")


def _wide_distances(f: Callable, x: Any, y: Any, red: MonoidReduction) -> str | None:
    """Why ``f``'s squared distances are a matmul, not unrolled (over
    :data:`MATMUL_DISTANCES` features or more), or None."""
    if not isinstance(blocks(f, x, y, red), tuple):
        return None
    wide = [n for n, _ in distances(f, x, y, red) if n >= MATMUL_DISTANCES]
    if not wide:
        return None
    return f"f's squared distances over {max(wide)} features: a matmul, not unrolled"


def kernel_for(
    f: Callable,
    x: Any,
    y: Any,
    red: MonoidReduction,
    layout: Layout,
    target: Any,
    far: str | None,
    matmul_tiles: tuple[int, int] | None = None,
    no_matmul: str | None = None,
) -> tuple[Layout | None, str]:
    """The tile kernel at ``layout`` where it takes ``f``, else the matmul tile kernel
    at ``matmul_tiles`` (default: the same), each compiled (or lowered) for ``target``
    (None: traced only); and why the tile kernel (and the matmul one) did not.
    ``far``: :func:`_wide_distances`' reason; ``no_matmul``: why the matmul tile
    kernel is not tried."""
    # (the structural check first: it spares compiling the unrolled probe)
    problem = far or layout_problem(f, x, y, red, layout, target)
    if problem is None:
        return layout, ""
    if no_matmul:
        return None, f"the tile kernel: {problem}; the matmul tile kernel: {no_matmul}"
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


def _held(f: Callable, x: Any, y: Any, red: MonoidReduction) -> int:
    """The values per x row the tile kernel holds across its loop over y tiles: x's
    features (every leaf's, flat) and the states (``kernel.state_width``)."""
    return sum(math.prod(a.shape[1:]) for a in jax.tree.leaves(x)) + state_width(f, x, y, red)
