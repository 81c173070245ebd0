"""``explain_pairwise`` says how the gradient runs and what reverse mode holds.

Each engine route's ``gradient`` line is checked against the program that runs: the
scan engine's ``(bi, bj, D)`` tile of per-pair values in the gradient's jaxpr, the CPU
tiles' ``(bj, bi)`` tiles and no such 3-D tile, the matmul tiles' matmuls, the GPU
and TPU kernels' two reverse passes (three kernels in the lowered gradient, no array
larger than the rows). The ``grad memory`` estimate is checked against XLA's
``memory_analysis().temp_size_in_bytes`` of the compiled gradient on the CPU engines:
within FACTOR either way (measured 0.4-1.8x for the elementwise ``f`` below and
others, ``pairs.backward_plan``).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import needs_abstract_devices, normal, on_abstract_device

import adv_jax_math as ajm
from adv_jax_math.pairs import backward_plan
from adv_jax_math.pairs.kernel import recognized
from adv_jax_math.pairs.matmul import pair_width
from adv_jax_math.plan.measure import fmt_bytes

N = M = 2048  # "auto" tiles: 128 x 2048
FACTOR = 3


def negsq(a, b):
    return -jnp.sum((a - b) ** 2)


def gauss(a, b):
    return jnp.exp(-jnp.sum((a - b) ** 2))


def paired(a, b):  # values of its softmax-weighted sum per pair: the tiles decline it
    return a @ b, a * b


def dot(a, b):
    return a @ b


def _points(d, n=N, m=M):
    return 0.3 * normal(0, (n, d)), 0.3 * normal(1, (m, d))


def _loss(f, reduction, tiles="auto"):
    def loss(x, y):
        out = jax.tree.leaves(ajm.pairwise(f, x, y, reduction, tiles=tiles))
        return sum(jnp.sum(v) for v in out if v.dtype.kind == "f")

    return loss


def _estimated(plan):
    """The bytes the plan's ``grad memory`` line gives ("about X")."""
    return re.match(r"about ([0-9.]+ \w+) \(estimated\)", plan.memory).group(1)


def _check_memory(plan, f, x, y, reduction, width=None, tiles="auto"):
    """The plan's estimate is :func:`backward_plan.estimate`'s, and within FACTOR of
    what XLA reports for the compiled gradient."""
    red = recognized(f, x, y, reduction, plan.tiles[1])
    tile, rows, _, _ = backward_plan.estimate(f, x, y, red, plan.tiles, N, width=width)
    assert _estimated(plan) == fmt_bytes(tile + rows), plan.memory
    grad = jax.jit(jax.grad(_loss(f, reduction, tiles), (0, 1)))
    measured = grad.lower(x, y).compile().memory_analysis().temp_size_in_bytes
    ratio = measured / (tile + rows)
    assert 1 / FACTOR <= ratio <= FACTOR, (ratio, fmt_bytes(measured), plan.memory)


def _jaxpr(f, reduction, x, y, tiles="auto"):
    return str(jax.make_jaxpr(jax.grad(_loss(f, reduction, tiles), (0, 1)))(x, y))


def test_cpu_tiles():
    x, y = _points(3)
    plan = ajm.explain_pairwise(negsq, x, y, ajm.LOGSUMEXP)
    assert plan.engine == "pairwise tiles (xla)" and plan.tiles == (128, 2048), str(plan)
    assert plan.backward == (
        "reverse mode: pairwise sums on the same engine (XLA's loops), recomputing f and "
        "its VJP per tile (nothing N x M stored): dx (and the closed-over values') over the "
        "x tiles at 128 x 2048, dy over the y tiles at 2048 x 128; forward mode: the scan "
        "engine's tangent at 128 x 2048"
    )
    assert "(128, 2048, 3), f's widest value per pair, and 2 more" in plan.memory
    text = str(plan)
    assert f"gradient   : {plan.backward}\ngrad memory: {plan.memory}\nrejected" in text, text
    # what runs: the tile kernel's loops, every value a (bj, bi) tile, features unrolled
    jaxpr = _jaxpr(negsq, ajm.LOGSUMEXP, x, y)
    assert "f32[2048,128]" in jaxpr and "f32[128,2048,3]" not in jaxpr
    assert "f32[128,2048]" in jaxpr  # (the pass over the y tiles: x and y swapped)
    _check_memory(plan, negsq, x, y, ajm.LOGSUMEXP)


@pytest.mark.parametrize(
    ("f", "reduction", "backend"),
    [(gauss, ajm.ADD, "scan"), (paired, ajm.SOFTMAX_WEIGHTED, "auto")],
    ids=["requested", "declined"],
)
def test_scan(f, reduction, backend):
    x, y = _points(16)
    with ajm.config(backend=backend):
        plan = ajm.explain_pairwise(f, x, y, reduction)
        assert plan.engine == "pairwise scan" and plan.tiles == (128, 2048), str(plan)
        assert plan.backward == (
            "reverse mode: JAX's transpose of the scan's loops, each tile of 128 x 2048 pairs "
            "recomputed (jax.checkpoint) and f's VJP taken on its pairs at once; forward "
            "mode: jax.jvp of the same loops"
        )
        assert "O(bi * bj * W): (128, 2048, 16), f's widest value" in plan.memory
        # what runs: f's VJP on a tile's pairs at once, its (bi, bj, D) values in memory
        assert "f32[128,2048,16]" in _jaxpr(f, reduction, x, y)
        _check_memory(plan, f, x, y, reduction)


def test_matmul_tiles():
    x, y = _points(64)
    plan = ajm.explain_pairwise(dot, x, y, ajm.LOGSUMEXP)
    assert plan.engine == "pairwise tiles (matmul)" and plan.tiles == (128, 2048), str(plan)
    assert plan.backward.startswith("reverse mode: per tile of 128 x 2048 pairs, each term's ")
    assert "XLA's loops, over the x tiles, each over the y tiles" in plan.backward
    assert "(128, 2048, 1), f's widest value per pair" in plan.memory  # a matmul's scores
    jaxpr = _jaxpr(dot, ajm.LOGSUMEXP, x, y)
    assert "dot_general" in jaxpr and "f32[2048,128]" in jaxpr
    assert "f32[128,2048,64]" not in jaxpr and "f32[2048,128,64]" not in jaxpr
    width = pair_width(dot, x, y, recognized(dot, x, y, ajm.LOGSUMEXP, 2048))
    _check_memory(plan, dot, x, y, ajm.LOGSUMEXP, width=width)


def test_smaller_tiles_hold_less():
    x, y = _points(3)
    tiles = (32, 512)
    plan = ajm.explain_pairwise(negsq, x, y, ajm.LOGSUMEXP, tiles=tiles)
    assert "dx (and the closed-over values') over the x tiles at 32 x 512" in plan.backward
    assert "dy over the y tiles at 512 x 32" in plan.backward
    _check_memory(plan, negsq, x, y, ajm.LOGSUMEXP, tiles=tiles)


def _lowered(platform, f, reduction, x, y):
    with on_abstract_device(platform):
        plan = ajm.explain_pairwise(f, x, y, reduction)
        grad = jax.jit(jax.grad(_loss(f, reduction), (0, 1)))
        text = grad.trace(x, y).lower(lowering_platforms=(platform,)).as_text()
    return plan, text


@needs_abstract_devices
@pytest.mark.parametrize(
    ("platform", "kernels", "across"),
    [("cuda", "Mosaic GPU kernels", ((8, 64), (8, 64))), ("tpu", "Mosaic TPU kernels", None)],
)
def test_gpu_and_tpu_tile_kernels(platform, kernels, across):
    # planned and lowered for an H100 / a TPU v5e from this CPU
    x = jax.ShapeDtypeStruct((1000, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((1200, 3), jnp.float32)
    plan, text = _lowered(platform, negsq, ajm.LOGSUMEXP, x, y)
    assert plan.engine.startswith("pairwise kernel ("), str(plan)
    (bi, bj) = plan.tiles
    (ax, ay) = across or ((bi, bj), (bj, bi))  # Mosaic GPU's reverse kernels: (8, 64)
    assert f"pairwise sums on the same engine ({kernels}), recomputing f" in plan.backward
    assert f"over the x tiles at {ax[0]} x {ax[1]}, dy over the y tiles at {ay[0]} x {ay[1]}" in (
        plan.backward
    )
    assert f"forward mode: the scan engine's tangent at {bi} x {bj}" in plan.backward
    assert "O(N + M)" in plan.memory and "never in device memory" in plan.memory, plan.memory
    # what runs: three kernels (forward, dx over the x tiles, dy over the y tiles), and
    # nothing outside them larger than the rows (padded to whole tiles)
    assert len(re.findall(r"custom_call @(mosaic_gpu\w*|tpu_custom_call)", text)) == 3
    shapes = re.findall(r"tensor<((?:\d+x)+)f32>", text)
    largest = max(math.prod(int(d) for d in s.split("x") if d) for s in shapes)
    assert largest <= (1200 + max(bi, bj)) * 3 < bi * bj, largest


@needs_abstract_devices
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_gpu_and_tpu_matmul_tile_kernels(platform):
    x = jax.ShapeDtypeStruct((1000, 64), jnp.float32)
    y = jax.ShapeDtypeStruct((1200, 64), jnp.float32)
    with on_abstract_device(platform):
        plan = ajm.explain_pairwise(dot, x, y, ajm.LOGSUMEXP)
    kind = "gpu" if platform == "cuda" else "tpu"
    assert plan.engine == f"pairwise kernel (matmul, {kind})", str(plan)
    if kind == "gpu":
        assert "two kernels (dx over the x tiles, dy over the y tiles)" in plan.backward
        assert "registers or shared memory" in plan.memory and "where XLA's loops" in plan.memory
    else:  # the TPU's reverse pass: one kernel, its tiles in VMEM
        assert "one kernel (over the tiles of the side with the more cotangents" in plan.backward
        assert "a tile's per-pair values stay in VMEM, never in device memory" in plan.memory


def test_column_pass_and_empty_rows():
    x, y = _points(3, 300, 200)
    plan = ajm.explain_pairwise(negsq, x, y, ajm.ADD, tiles=(8, 16), columns=ajm.ADD)
    assert "over the x tiles at 8 x 16, dy over the y tiles at 16 x 8" in plan.backward
    assert "over the x tiles at 16 x 8, dy over the y tiles at 8 x 16" in plan.columns.backward
    assert f"    gradient   : {plan.columns.backward}" in str(plan)
    empty = ajm.explain_pairwise(negsq, x[:0], y, ajm.ADD)
    assert empty.backward.startswith("no pairs") and empty.memory == "none", str(empty)
