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
import jax.numpy as jnp

from ..core.targets import pallas_triton, tpu_vmem_limit
from ..core.targets import target as device_target
from ..kernels.pairwise_device import Layout
from ..monoids.reduction import MonoidReduction
from . import tiles as _tiles
from .dots import pair_jaxpr
from .grad import Pairs, fused
from .kernel import Probe, first_row, layout_problem, struct
from .matmul import blocks, distances, kernel_layout

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
    chosen = _tiles.device(kind, tiles, vmem)
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
    matmul = _tiles.device(kind, tiles, vmem, matmul=True)
    assert not isinstance(matmul, str)  # (the same checks as the tile kernel's)
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
    tiles = matmul_tiles or layout.tiles
    on = dataclasses.replace(layout, kind="matmul", tiles=tiles, on=layout.kind)
    matmul = kernel_layout(f, x, y, red, on, target)
    if isinstance(matmul, Layout):
        # On TPU the reverse pass stays in XLA's loops: on a v5e (attention, N = M =
        # 16384, d = 64) its kernels took 14.0 ms in bfloat16 and 10.0 in float32 (at
        # 512 x 1024), the loops 8.4 and 8.5 (d = 128 at 32768: 53.0 against 44.7)
        device = target is not None and matmul.on == "gpu"
        back = _reverse_tiles(f, x, y, red, matmul, target) if device else None
        back = tiles if target is None else back
        return dataclasses.replace(matmul, back=back), f"the tile kernel: {problem}"
    return None, f"the tile kernel: {problem}; the matmul tile kernel: {matmul}"


def _reverse_tiles(
    f: Callable, x: Any, y: Any, red: MonoidReduction, layout: Layout, target: Any
) -> tuple[int, int] | None:
    """The largest tiles, from the forward kernel's down to halves of them (on GPU at
    least 16 rows, on TPU multiples of 128), at which the matmul tiles' reverse pass
    compiles (or lowers) for ``target`` as ``jax.grad`` runs it; None: at none (it
    runs in XLA's loops)."""
    conv, consts = jax.closure_convert(f, first_row(x), first_row(y))
    xdef, ydef = jax.tree.structure(x), jax.tree.structure(y)
    nx = len(jax.tree.leaves(x))
    bi, bj = layout.tiles
    least = 128 if layout.on == "tpu" else 16
    pair = pair_jaxpr(lambda c, xi, yj: red.prologue(conv(xi, yj, *c)), consts, x, y)
    tried = [(bi, bj), (bi, bj // 2), (bi // 2, bj // 2), (bi // 2, bj // 4)]
    for back in dict.fromkeys(t for t in tried if min(t) >= least and t[1] % least == 0):
        lay = dataclasses.replace(layout, back=back)
        pairs = Pairs(conv, red, lay.tiles, _no_scan, lay)

        def run(c: list, xs: list, ys: list, pairs: Pairs = pairs) -> list:
            leaves = [*xs, *ys]
            floats = [k for k, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.inexact)]

            def loss(vals: list) -> Any:
                args = list(leaves)
                for k, v in zip(floats, vals, strict=True):
                    args[k] = v
                xt, yt = jax.tree.unflatten(xdef, args[:nx]), jax.tree.unflatten(ydef, args[nx:])
                out = jax.tree.leaves(fused(pairs, c, xt, yt))
                inexact = [o for o in out if jnp.issubdtype(o.dtype, jnp.inexact)]
                return sum(jnp.sum(o.astype(jnp.float32)) for o in inexact)

            return jax.grad(loss)([leaves[k] for k in floats])

        args = ([struct(a) for a in consts], _structs(x), _structs(y))
        text = f"{pair} {[leaf.monoid.name for leaf in red.leaves]} reverse at {back}"
        if Probe(target, lay, run, args, text).problem() is None:
            return back
    return None


def _structs(tree: Any) -> list:
    return [struct(a) for a in jax.tree.leaves(tree)]


def _no_scan(*args: Any) -> Any:
    raise NotImplementedError("the compile probe of the reverse pass runs no forward mode")
