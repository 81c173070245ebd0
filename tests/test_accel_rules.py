"""What the deviceless compiles of the stateful monoids taught (bench/accel/FINDINGS.md
§6), checked on CPU: the static TPU rules (a 16-bit matmul result declined before
compiling; the arrays a fold holds whole across its reductions, counted in the VMEM
model) and the reformulated folds and merges (top-k's bitonic merge, softmax-weighted
sums of one score or value per row, 0-d states of 16-bit rows) against plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adv_jax_math as ajm
from adv_jax_math.core.targets import TARGETS
from adv_jax_math.kernels.fused_reduce.blocks import tpu_block
from adv_jax_math.kernels.fused_reduce.build import fold_jaxpr as _fold_jaxpr
from adv_jax_math.kernels.fused_reduce.kernel import Term
from adv_jax_math.kernels.fused_reduce.rules import (
    held_across_reductions,
    live_at_peak,
    mosaic_problem,
)
from adv_jax_math.monoids.reduction import LeafReduction

S = jax.ShapeDtypeStruct
F32_ROW = S((8, 16), jnp.float32)


def _held(monoid, item=F32_ROW, rows=64):
    term = Term(
        LeafReduction(tuple(range(monoid.arity)), monoid, 0, None), (item,) * monoid.arity, None
    )
    return held_across_reductions(_fold_jaxpr(term, rows), rows)


@pytest.mark.parametrize(
    "monoid, count",
    [(ajm.ADD, 0), (ajm.MAX, 0), (ajm.ARGMIN, 2), (ajm.top_k(4), 3), (ajm.MEAN_VAR, 2)],
    ids=["ADD", "MAX", "ARGMIN", "top_k(4)", "MEAN_VAR"],
)
def test_arrays_a_fold_holds_across_its_reductions(monoid, count):
    # single-pass folds stream their block; the others keep it (and its rows) whole
    held = _held(monoid)
    assert len(held) == count
    assert all(shape == (64, 8, 16) for shape, _ in held)


@pytest.mark.parametrize("monoid", [ajm.ARGMIN, ajm.top_k(4)], ids=["ARGMIN", "top_k(4)"])
def test_held_arrays_when_a_row_has_as_many_elements_as_the_block_rows(monoid):
    """A state per element of 64 elements has the shape of a block of 64 rows: the
    reductions are found by their axes, not by shape (the fold's one broadcast of its
    state hid them: blocks of 1024 rows on v4 then ran out of VMEM)."""
    held = _held(monoid, S((64,), jnp.float32), rows=64)
    assert sum(shape == (64, 64) for shape, _ in held) == len(_held(monoid)), held


def test_held_arrays_shrink_the_tpu_block():
    args = dict(
        inputs=[S((10007, 8, 16), jnp.int32)],
        consts=[],
        partials=[((1, 8, 16), jnp.int32)] * 2,
        body=[((64, 8, 16), np.dtype(np.int32))],
        traced_rows=64,
        elementwise=True,
        limit=16 << 20,
        f32_math=True,
        v4=True,
    )
    alone, _ = tpu_block(10007, 1024, **args)
    held, vmem = tpu_block(10007, 1024, **args, held=_held(ajm.ARGMAX, S((8, 16), jnp.int32)))
    # measured on v4: 1024 rows need 16.02M of 16M (8M of register allocator spill slots)
    assert alone == 1024 and held < 1024 and vmem <= 0.7 * (16 << 20)


def test_mosaic_declines_a_16_bit_matmul_result():
    tpu = TARGETS["tpu"]
    q = jnp.ones((64, 32), jnp.bfloat16)
    k = S((8, 64), jnp.bfloat16)
    bf16 = jax.make_jaxpr(lambda x: x @ q)(k).jaxpr
    f32 = jax.make_jaxpr(lambda x: jnp.matmul(x, q, preferred_element_type=jnp.float32))(k).jaxpr
    reason = mosaic_problem(tpu, bf16, 8, "fun")
    assert reason and "accumulate in 32 bits" in reason and "bfloat16[Bk, 32]" in reason
    assert mosaic_problem(tpu, f32, 8, "fun") is None


# k = 16 compiles for about 10 s here: by default for the largest only, smallest=True
# slow (make test-slow); k = 1 and 3 both ways
@pytest.mark.parametrize(
    "smallest, k",
    [
        pytest.param(smallest, k, marks=pytest.mark.slow if smallest and k == 16 else ())
        for smallest in (False, True)
        for k in (1, 3, 16)
    ],
)
def test_top_k_merge_of_sorted_states(k, smallest):
    # the bitonic merge of two blocks' states (either order) is the fold of both
    monoid = ajm.top_k(k, smallest)
    rng = np.random.default_rng(k)
    y = rng.integers(-3, 3, size=(70, 5)).astype(np.float32)  # many ties
    y[[3, 40]] = np.nan
    y[[7, 50]] = -np.inf
    idx = np.arange(70, dtype=np.int32)
    w = (rng.random(70) > 0.2).astype(np.float32)
    fold = lambda a, b: monoid.fold(
        [jnp.asarray(y[a:b])], jnp.asarray(idx[a:b]), jnp.asarray(w[a:b])
    )
    whole = monoid.finalize(fold(0, 70), [S((5,), jnp.float32)])
    for a, b in ((fold(0, 30), fold(30, 70)), (fold(30, 70), fold(0, 30))):
        merged = monoid.finalize(jax.jit(monoid.merge)(a, b), [S((5,), jnp.float32)])
        for got, want in zip(merged, whole, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("backend", ["scan", "interpret"])
@pytest.mark.parametrize("s_shape, v_shape", [((), ()), ((), (8,)), ((4,), ()), ((4,), (8,))])
def test_softmax_weighted_of_one_score_or_value_per_row(backend, s_shape, v_shape):
    n = 1001
    s = jnp.sin(jnp.arange(n * int(np.prod(s_shape))) * 0.37).reshape(n, *s_shape)
    v = jnp.cos(jnp.arange(n * int(np.prod(v_shape))) * 0.11).reshape(n, *v_shape)
    want = jnp.tensordot(jax.nn.softmax(s, 0), v, ([0], [0]))
    with ajm.config(backend=backend):
        got = ajm.batch_map(
            lambda d: (d["s"], d["v"]), {"s": s, "v": v}, 128, reduction=ajm.SOFTMAX_WEIGHTED
        )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["scan", "interpret"])
@pytest.mark.parametrize(
    "monoid", [ajm.MIN_ARGMIN, ajm.MAX_ARGMAX, ajm.MIN], ids=["MIN_ARGMIN", "MAX_ARGMAX", "MIN"]
)
def test_16_bit_rows_to_a_0d_state(backend, monoid):
    y = jnp.sin(jnp.arange(1001.0) * 0.37).astype(jnp.bfloat16)
    with ajm.config(backend=backend):
        got = ajm.batch_map(lambda r: r, y, 128, reduction=monoid)
    if monoid is ajm.MIN:
        want = jnp.min(y)
    elif monoid is ajm.MIN_ARGMIN:
        want = (jnp.min(y), jnp.argmin(y))
    else:
        want = (jnp.max(y), jnp.argmax(y))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_values_live_at_the_peak_of_a_jaxpr():
    # x, a and b are live together when a * b is made; later values only after a
    # and b died; the trailing 1 of a keepdims sum is implicit, as in Mosaic's layouts
    def f(x):
        a, b = jnp.sin(x), jnp.cos(x)
        c = a * b + x
        return jnp.sum(c * c, axis=-1, keepdims=True) * 2.0

    closed = jax.make_jaxpr(f)(S((64, 8, 256), jnp.float32))
    live = live_at_peak(closed, 64)
    assert [shape for shape, _ in live] == [(64, 8, 256)] * 4  # x, a, b, a * b
    keepdims = jax.make_jaxpr(lambda x: jnp.sum(x, -1, keepdims=True))
    keep = live_at_peak(keepdims(S((64, 8, 1), jnp.float32)), 64)
    assert sorted(shape for shape, _ in keep) == [(64, 8), (64, 8)]
