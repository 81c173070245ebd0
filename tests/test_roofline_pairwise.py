"""The pairwise roofline model (``bench/accel/pairwise_model.py``): its bytes and flops against
hand arithmetic (how they scale with N and M, y resident in L2 or not, the Gaussian's
flops per pair), the reverse passes, the default tiles, and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from accel.pairwise_model import pairwise_cost

import adv_jax_math as ajm

S, F32 = jax.ShapeDtypeStruct, jnp.float32
H100, A100, V5E = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "TPU v5 lite"
MIB = 1 << 20


def dot4(a, b):
    return jnp.sum(a * b)  # 4 multiplies + 3 adds = 7 flops per pair, no transcendental


def cost(n: int, m: int, **kw):
    """``dot4`` on n x m rows of 4 float32 (16 bytes a row), the fold's flops given by
    hand as 1 per pair (so no merge cost), 64 x 64 tiles unless told."""
    kw = {"tiles": (64, 64), "device": H100, **kw}
    return pairwise_cost(dot4, S((n, 4), F32), S((m, 4), F32), 1.0, **kw)


def test_flops_are_the_pairs_times_the_flops_per_pair():
    c = cost(64 * 100, 64 * 30)
    (fwd,) = c.passes
    assert c.pair_flops == 8 and c.pair_special == 0  # 7 for dot4, 1 for the fold
    assert fwd.flops == 6400 * 1920 * 8
    assert cost(64 * 100, 64 * 60).flops == 2 * fwd.flops  # doubling M
    assert cost(64 * 200, 64 * 30).flops == 2 * fwd.flops  # doubling N
    # rows not a multiple of the tiles: the kernel computes whole (padded) tiles
    assert cost(64 * 100 - 5, 64 * 30 - 7).flops == fwd.flops


def test_y_traffic_doubles_with_m_and_with_the_x_tiles_when_y_is_not_resident():
    n, m = 64 * 100, 2 * MIB  # y: 2 Mi rows of 16 bytes = 32 MiB > 25 MiB (half the L2)
    (fwd,) = cost(n, m).passes
    assert not fwd.resident
    assert fwd.streamed == 100 * m * 16  # once per x tile, from HBM
    # the kernel's bytes: x once (16 B a row), y per x tile, one 4-byte state per x row
    assert fwd.kernel == n * 16 + 100 * m * 16 + n * 4
    assert cost(n, 2 * m).passes[0].streamed == 2 * fwd.streamed  # doubling M
    assert cost(2 * n, m).passes[0].streamed == 2 * fwd.streamed  # doubling the x tiles


def test_y_in_l2_is_read_from_hbm_once():
    n = 64 * 100
    fits, spills = 24 * MIB // 16, 26 * MIB // 16  # y of 24 MiB and 26 MiB
    (small,), (big,) = cost(n, fits).passes, cost(n, spills).passes
    assert small.resident and not big.resident
    assert small.streamed == 24 * MIB  # once
    assert big.streamed == 100 * 26 * MIB  # per x tile
    assert big.bytes - small.bytes > 99 * 24 * MIB
    # the same 24 MiB does not fit in half an A100's 40 MB L2
    assert not cost(n, fits, device=A100).passes[0].resident
    # on a TPU the kernel streams y from HBM for every x tile, whatever its size
    (tpu,) = cost(512 * 10, 256 * 4, device=V5E, tiles=(512, 256)).passes
    assert not tpu.resident and tpu.streamed == 10 * 1024 * 16


def test_tpu_grid_steps_cost_time_and_fill_both_cores_of_a_megacore():
    (v5e,) = cost(512 * 10, 256 * 4, device=V5E, tiles=(512, 256)).passes
    assert v5e.launch == pytest.approx(4 * 2e-6 + 10 * 4 * 0.35e-6)  # 40 grid steps
    (v5p,) = cost(512 * 3, 256 * 4, device="TPU v5", tiles=(512, 256)).passes
    assert v5p.parallel == pytest.approx(3 / 4)  # 3 programs on 2 cores: 2 waves


def test_grad_adds_a_dx_and_a_dy_pass_and_costs_more():
    fwd, grad = cost(64 * 100, 64 * 30), cost(64 * 100, 64 * 30, grad=True)
    assert [p.name for p in grad.passes] == ["forward", "dx", "dy"]
    assert grad.passes[0] == fwd.passes[0]
    assert grad.flops > 2 * fwd.flops and grad.seconds > 2 * fwd.seconds
    assert grad.bytes > fwd.bytes
    dx, dy = grad.passes[1:]
    assert (dx.programs, dy.programs) == (100, 30)  # over x tiles, over y tiles
    # dx per pair: the VJP w.r.t. x of sum(x * y) is 4 multiplies y * ct (the forward
    # product is dead code there, as XLA would drop it), the 4 cotangents summed over a
    # 64-row tile (63/64 adds each); per x row and further y tile a merge of 4
    # compensated sums (at most 12 flops each)
    pairs = 6400 * 1920 * (4 + 4 * 63 / 64)
    assert pairs <= dx.flops <= pairs + 6400 * 29 * 4 * 12
    assert dy.flops == pytest.approx(pairs, rel=0.1)  # the same, the roles swapped
    # max tallies its ties first: one more forward pass
    tallied = pairwise_cost(dot4, S((640, 4), F32), S((640, 4), F32), ajm.MAX, grad=True)
    assert [p.name for p in tallied.passes] == ["forward", "tally", "dx", "dy"]


def test_gaussian_d3_flops_per_pair():
    # KeOps' benchmark: exp(-p |x - y|^2) b. By hand, per pair: 3 subtractions, 3
    # squares, 2 adds, the scale by -p, the exp, the weight b: 11 operations in f (the
    # exp one of them), about 1 add for the ADD fold ((bj - 1) / bj), and the exp's 4
    # ALU flops of range reduction (the model's stated count): 16 - 1/64 on 64 x 64
    # tiles; one transcendental.
    gauss = lambda xi, yj: jnp.exp(-2.0 * jnp.sum((xi - yj[0]) ** 2)) * yj[1]
    n = 64 * 50
    x, y = S((n, 3), F32), (S((n, 3), F32), S((n,), F32))
    c = pairwise_cost(gauss, x, y, ajm.ADD, device=H100)
    assert c.tiles == (64, 64)
    assert 15.5 <= c.pair_flops <= 16.5 and c.pair_special == 1
    # the whole pass: the pairs' flops plus a merge of two compensated sums per x row
    # per further y tile (a handful of flops, under 20)
    pairs = n * n * c.pair_flops
    assert pairs <= c.flops <= pairs + n * 49 * 20


def test_transcendentals_and_reductions_jax_leaves_at_zero_are_counted():
    # tanh: 1 flop and 1 transcendental; jnp.max over 4: 4 comparisons (n, as the model
    # counts a max/min reduction of n)
    c = pairwise_cost(lambda a, b: jnp.tanh(jnp.max(a * b)), S((64, 4), F32),
                      S((64, 4), F32), 0.0, tiles=(64, 64))  # fmt: skip
    assert c.pair_special == 1
    assert c.pair_flops == 4 + 4 + 1 + 4  # muls, max, tanh, tanh's 4 extra ALU flops


def test_default_tiles_follow_the_planner():
    x = S((4096, 4), F32)
    tiles = lambda kind: pairwise_cost(dot4, x, x, "add", device=kind).tiles
    assert tiles(H100) == (64, 64)
    assert tiles(V5E) == (512, 256)
    assert tiles("TPU v4") == (256, 128)  # halved: 16 MiB of VMEM


def test_str_says_it_is_a_model():
    text = str(cost(6400, 1920, grad=True))
    assert "MODEL" in text and "not measured" in text
    assert "dx" in text and "dy" in text


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"device": "NVIDIA L4"}, "'NVIDIA L4'"),
        ({"tiles": (0, 64)}, "tiles=(0, 64)"),
        ({"tiles": (64,)}, "tiles=(64,)"),
        ({"tiles": (64.0, 64)}, "tiles=(64.0, 64)"),
    ],
)
def test_bad_input_names_what_was_given(kw, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        cost(640, 640, **kw)


def test_bad_reduction_and_rows_name_what_was_given():
    x = S((64, 4), F32)
    with pytest.raises(ValueError, match="reduction='sum'"):
        pairwise_cost(dot4, x, x, "sum")
    with pytest.raises(ValueError, match="reduction=-1"):
        pairwise_cost(dot4, x, x, -1)
    with pytest.raises(ValueError, match="every leaf of y needs a leading row axis"):
        pairwise_cost(dot4, x, S((), F32), "add")
