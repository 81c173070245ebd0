"""The fused kernel on Pallas Mosaic GPU (``kernels/fused_reduce/mosaic_gpu.py``).

Numerics in Mosaic GPU's own CPU interpreter against plain-JAX oracles (ragged rows,
rows of features taken feature by feature, several blocks per program, closed-over
constants, the rewrites of what Mosaic GPU does not lower, the backward kernel); the
backend chain on CUDA GPUs (Mosaic GPU from compute capability 9.0, then Triton, each
step's reason in ``explain``), lowered for abstract H100 and A100 devices; and the GPU
path with Pallas Triton gone, as a future jax will have it.
Compiles for real targets: ``bench/accel/compile_targets.py`` (``make test-accel``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_special_values as special
from cases import plain_pair
from helpers import (
    assert_tree_close,
    enable_x64,
    needs_abstract_devices,
    needs_kernel,
    normal,
    oracle,
)
from jax import lax

import adv_jax_math as ajm
from adv_jax_math.core import targets
from adv_jax_math.core.gpu_backends import mosaic_gpu_problem
from adv_jax_math.core.targets import abstract_mesh
from adv_jax_math.kernels.fused_reduce.interpreter import PORTABLE

pytestmark = [
    needs_kernel,
    pytest.mark.skipif(mosaic_gpu_problem() is not None, reason=str(mosaic_gpu_problem())),
]

H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
PLAIN = {
    "add": (jnp.add, lambda y: jnp.sum(y, 0)),
    "max": (jnp.maximum, lambda y: jnp.max(y, 0)),
    "min": (jnp.minimum, lambda y: jnp.min(y, 0)),
    "logsumexp": (jnp.logaddexp, lambda y: jax.nn.logsumexp(y, 0)),
}


def interpreted(fun, x, monoid, batch_size=1024):
    """``batch_map`` with the fused kernel in Mosaic GPU's interpreter, and its plan."""
    reduction, chunk = PLAIN[monoid]
    call = lambda x: ajm.batch_map(fun, x, batch_size, reduction=reduction, chunk_reduction=chunk)
    with ajm.config(backend="interpret", gpu_backend="mosaic_gpu"):
        plan = ajm.explain(fun, x, batch_size, reduction=reduction, chunk_reduction=chunk)
        return jax.jit(call)(x), plan


@pytest.mark.parametrize("monoid", sorted(PLAIN))
@pytest.mark.parametrize("n", [1, 300, 5003])
def test_interpreted_kernel_matches_the_oracle(monoid, n):
    x = normal(n, (n,))
    fun = lambda x: jnp.sin(3 * x) * 2 + x
    got, plan = interpreted(fun, x, monoid)
    assert plan.engine == "interpret" and "Pallas Mosaic GPU interpreter" in plan.reason, plan
    assert_tree_close(got, oracle(monoid, 0)(fun(x)), rtol=2e-6, atol=2e-6)


def test_several_blocks_per_program_and_a_global_row_offset():
    """steps > 1: each program streams its blocks through the pipeline; the argmin's
    indices count from ``offset``."""
    from adv_jax_math.analysis.recognize import recognize
    from adv_jax_math.kernels.fused_reduce.build import traced_at
    from adv_jax_math.kernels.fused_reduce.fused import fused_states
    from adv_jax_math.monoids.base import identity
    from adv_jax_math.monoids.reduction import MonoidReduction

    n, rows, steps = 2000, 128, 4  # 4 programs, the last one's blocks partly past n
    x = normal(1, (n,))
    fun = lambda x: jnp.cos(x) * x
    rec = recognize(ajm.MIN_ARGMIN, identity, jax.eval_shape(fun, x))
    reduction = MonoidReduction(rec.leaves, rec.out_tree, rec.prologue, rec.how)
    prepared = reduction.prepare(fun)
    traced = traced_at(prepared, x, rows, {})
    states = fused_states(
        traced, x, reduction, rows=rows, steps=steps, interpret=True, backend="mosaic_gpu",
        offset=7,
    )  # fmt: skip
    (value, index), y = reduction.finish(states), fun(x)
    assert float(value) == float(jnp.min(y)) and int(index) == int(jnp.argmin(y)) + 7


W3 = jnp.array([0.5, -1.0, 2.0], jnp.float32)
M16 = jnp.linspace(-2.0, 2.0, 16, dtype=jnp.float32)


def mixture(x):
    """One value per row in and out, 16 in between (a mixture's components)."""
    return jax.nn.logsumexp(-0.5 * (x[:, None] - M16) ** 2, axis=1)


@pytest.mark.parametrize(
    ("name", "fun", "x", "monoid", "axis"),
    [
        ("rows of 3", lambda x: jnp.sin(x) * W3, (3001, 3), "add", 0),
        ("2x4 max", lambda x: jnp.cos(x) + x * x, (517, 2, 4), "max", 0),
        ("norms", lambda x: jnp.sqrt(jnp.sum(x * x, axis=-1)), (1000, 5), "logsumexp", 0),
        ("outer", lambda x: x[:, :, None] * x[:, None, :], (700, 3), "min", 0),
        ("everything", lambda x: jnp.tanh(x) - W3, (999, 3), "logsumexp", None),
        ("pytree", lambda t: (t[0] * t[1][:, None], t[1] + 1), ((1300, 3), (1300,)), "add", 0),
        ("wider inside", mixture, (2001,), "logsumexp", 0),
    ],
)
def test_rows_of_features_go_feature_by_feature(name, fun, x, monoid, axis):
    """Inputs of several values per row reach the kernel as one vector of rows per
    feature; ``fun`` runs on them with its own axes unrolled (reshapes, broadcasts,
    sums over features, closed-over vectors), each element folded on its own."""
    is_leaf = lambda s: isinstance(s, tuple) and all(isinstance(d, int) for d in s)
    xs = jax.tree.map(lambda s: normal(len(s), s), x, is_leaf=is_leaf)
    interpreted_against_the_oracle(fun, xs, monoid, axis)


def interpreted_against_the_oracle(fun, xs, monoid, axis):
    """``batch_map`` in blocks of 256 rows in Mosaic GPU's interpreter, checked against
    the plain-JAX oracle; its plan."""
    reduction, chunk = plain_pair(monoid, axis)
    call = lambda x: ajm.batch_map(fun, x, 256, reduction=reduction, chunk_reduction=chunk)
    with ajm.config(backend="interpret", gpu_backend="mosaic_gpu"):
        plan = ajm.explain(fun, xs, 256, reduction=reduction, chunk_reduction=chunk)
        got = jax.jit(call)(xs)
    assert plan.engine == "interpret" and "Pallas Mosaic GPU interpreter" in plan.reason, plan
    assert_tree_close(got, oracle(monoid, axis)(fun(xs)), rtol=3e-6, atol=3e-6)
    return plan


W16 = np.linspace(-0.5, 0.5, 16 * 8, dtype=np.float32).reshape(16, 8)


@pytest.mark.parametrize(
    ("name", "fun", "x", "monoid", "axis"),
    [
        ("outer", lambda x: x[:, :, None] * x[:, None, :], (700, 16), "max", 0),
        ("wide tanh", lambda x: jnp.tanh(x) * x, (517, 8, 16), "add", 0),
        ("wide, every element", lambda x: jnp.cos(x) - x, (300, 4, 32), "logsumexp", None),
        ("a layer", lambda x: jnp.tanh(x @ W16), (1001, 16), "add", 0),
        ("a layer's max", lambda x: jnp.sin(x @ W16[:, :3]) * 2.0, (999, 16), "max", 0),
    ],
)
def test_wide_rows_go_in_element_groups(name, fun, x, monoid, axis):
    """Where one row's values do not fit a thread's registers at once, ``fun``'s output
    elements are folded in groups, a kernel each, each reading the features its
    elements need; products by a constant matrix are unrolled into sums of products."""
    from adv_jax_math.kernels.fused_reduce.groups import REGISTERS

    plan = interpreted_against_the_oracle(fun, normal(len(x), x), monoid, axis)
    if math.prod(x[1:]) * 2 > REGISTERS:
        assert "kernels, each folding a group of fun's output elements" in plan.reason, plan


# A thread's registers lowered (``groups.REGISTERS``: 128 on Hopper) so that small
# problems split into several groups fast (the interpreter runs each group's kernel:
# 1-2 minutes a case at full size).
SMALL_BUDGET = 48


def lower_budget(monkeypatch, budget=SMALL_BUDGET):
    from adv_jax_math.kernels.fused_reduce import groups

    monkeypatch.setattr(groups, "REGISTERS", budget)


# Per size: (x, w) per fun, batch_size, and a thread's registers (None: Hopper's).
GROUP_SIZES = {
    "full": ({"layer": ((1001, 16), (16, 24)), "wide": ((700, 8, 16), (8, 16))}, 256, None),
    "small": ({"layer": ((300, 4), (4, 8)), "wide": ((300, 4, 6), (4, 6))}, 128, SMALL_BUDGET),
}


@pytest.mark.parametrize(
    ("monoid", "fun", "size"),
    [
        *((m, f, "small") for m in ("add", "max", "logsumexp") for f in ("layer", "wide")),
        pytest.param("max", "layer", "full", marks=pytest.mark.slow),
        pytest.param("logsumexp", "wide", "full", marks=pytest.mark.slow),
    ],
)
def test_element_groups_have_gradients(monoid, fun, size, monkeypatch):
    """The backward kernel goes in element groups too: a layer's outputs each read every
    feature (each group adds its share of their cotangents to the earlier groups') and
    a column of ``w`` (its cotangents summed per program and over groups); a wide
    elementwise ``fun``'s groups read features of their own. Max's tallies per group."""
    reduction, plain = GRADS[monoid]
    shapes, batch, budget = GROUP_SIZES[size]
    if budget is not None:
        lower_budget(monkeypatch, budget)
    x, w = normal(3, shapes[fun][0]), normal(4, shapes[fun][1])
    if fun == "layer":
        w = w * 0.3
        f = lambda w: lambda v: jnp.tanh(v @ w) + 0.1 * jnp.sum(v, axis=1, keepdims=True)
    else:
        f = lambda w: lambda v: jnp.tanh(v * w) * v
    loss = lambda w, x: jnp.sum(ajm.batch_map(f(w), x, batch, reduction=reduction) ** 2)
    with ajm.config(backend="interpret", gpu_backend="mosaic_gpu"):
        plan = ajm.explain(f(w), x, batch, reduction=reduction)
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, x)
    assert "kernels, each folding a group of fun's output elements" in plan.reason, plan.reason
    assert "(Pallas Mosaic GPU interpreter), in " in plan.backward, plan.backward
    want = jax.value_and_grad(lambda w, x: jnp.sum(plain(f(w)(x)) ** 2), argnums=(0, 1))(w, x)
    assert_tree_close(got, want, rtol=2e-5, atol=5e-4)  # (gradients of up to 1500)


@pytest.mark.parametrize("smallest", [False, True])
def test_top_k_gradients_in_element_groups(smallest, monkeypatch):
    """A top-k's backward kernel on Mosaic GPU: each element's k slots (its values'
    cotangents and rows) read as a list, in element groups; against lax.top_k's."""
    lower_budget(monkeypatch)
    x, w = normal(11, (300, 4)), normal(12, (4, 8)) * 0.5
    f = lambda w: lambda v: jnp.tanh(v @ w)
    sign = -1.0 if smallest else 1.0
    top = ajm.top_k(3, smallest=smallest)
    loss = lambda w, x: jnp.sum(ajm.batch_map(f(w), x, 128, reduction=top)[0] ** 2)
    with ajm.config(backend="interpret", gpu_backend="mosaic_gpu"):
        plan = ajm.explain(f(w), x, 128, reduction=top)
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, x)
    plain = lambda w, x: jnp.sum(lax.top_k(sign * f(w)(x).T, 3)[0] ** 2)
    assert "(Pallas Mosaic GPU interpreter), in " in plan.backward, plan.backward
    assert_tree_close(got, jax.value_and_grad(plain, argnums=(0, 1))(w, x), rtol=1e-5, atol=1e-6)


def test_backward_groups_skip_results_without_cotangents(monkeypatch):
    """The backward's element groups leave out an argmin's elements (integer indices: no
    cotangent, no tally): next to a mean, the backward is the mean's alone; alone, no
    backward kernel is launched."""
    lower_budget(monkeypatch)
    x, w = normal(7, (300, 4)), normal(8, (4, 8))
    f = lambda w: lambda v: {"a": jnp.tanh(v * w[:, 0]), "b": (v @ w) ** 2}
    both = {"a": ajm.MEAN, "b": ajm.ARGMIN}

    def loss(w, x):
        return jnp.sum(ajm.batch_map(f(w), x, 128, reduction=both)["a"] ** 2)

    with ajm.config(backend="interpret", gpu_backend="mosaic_gpu"):
        explained = ajm.explain(f(w), x, 128, reduction=both)
        mean = ajm.explain(lambda v: f(w)(v)["a"], x, 128, reduction=ajm.MEAN)
        argmin = ajm.explain(lambda v: f(w)(v)["b"], x, 128, reduction=ajm.ARGMIN)
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, x)
    assert "kernels, each folding a group" in explained.reason, explained.reason
    assert explained.backward == mean.backward, (explained.backward, mean.backward)
    assert argmin.backward.startswith("no backward kernel"), argmin.backward
    plain = lambda w, x: jnp.sum(jnp.mean(f(w)(x)["a"], 0) ** 2)
    assert_tree_close(got, jax.value_and_grad(plain, argnums=(0, 1))(w, x), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("monoid", ["add", "max", "logsumexp"])
def test_float64_rows_travel_as_their_bits(monoid):
    """float64 inputs (DESC computes in them): Mosaic GPU's TMA copies take no float64,
    so the features and the inputs' cotangents travel as int64 bits, bitcast in the
    kernels; value and gradients to float64 accuracy, not float32's."""
    reduction, plain = GRADS[monoid]
    with enable_x64():
        x, w = normal(9, (1000, 3), np.float64), normal(10, (3,), np.float64)
        f = lambda w: lambda v: jnp.sin(v * w) * v + 1e-9 * v**2
        loss = lambda w, x: jnp.sum(ajm.batch_map(f(w), x, 256, reduction=reduction) ** 2)
        with ajm.config(backend="interpret", gpu_backend="mosaic_gpu"):
            plan = ajm.explain(f(w), x, 256, reduction=reduction)
            got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, x)
        want = jax.value_and_grad(lambda w, x: jnp.sum(plain(f(w)(x)) ** 2), argnums=(0, 1))(w, x)
    assert "Pallas Mosaic GPU interpreter)" in plan.reason, plan.reason
    assert "(Pallas Mosaic GPU interpreter)" in plan.backward, plan.backward
    assert all(a.dtype == np.float64 for a in jax.tree.leaves(got))
    assert_tree_close(got, want, rtol=1e-12, atol=1e-12)


def test_element_groups_fit_their_budget_and_read_what_they_need():
    """``groups.grouped``: consecutive elements, each group within the budget (values
    live at once in the unrolled jaxpr's order, states included), as large as fits;
    an elementwise ``fun``'s group reads exactly its elements' features; one element
    past the budget alone is reported by its count."""
    from adv_jax_math.kernels.fused_reduce.groups import grouped

    n = 24
    trace = lambda *v: [jnp.tanh(a) * a for a in v]
    closed = jax.make_jaxpr(trace)(*[jax.ShapeDtypeStruct((128,), jnp.float32)] * n)
    reads = [(e,) for e in range(n)]
    groups = grouped(closed.jaxpr, 0, reads, [1] * n, vec=1, budget=16)
    assert [e for g in groups for e in g.elements] == list(range(n))
    for g in groups:
        assert g.peak <= 16 and g.features == g.elements and g.consts == ()
    assert len(groups) < n / 3  # (each element: its feature, tanh, product, state)
    assert grouped(closed.jaxpr, 0, reads, [1] * n, vec=2, budget=4) == 7  # 3 vectors of 2, 1


def test_values_wider_inside_fun_than_its_rows_have_gradients():
    """``fun`` may hold more values per row than it reads or returns: the
    backward kernel unrolls them too."""
    x = normal(9, (2001,))
    loss = lambda x: ajm.batch_map(mixture, x, 256, reduction=ajm.LOGSUMEXP)
    with ajm.config(backend="interpret", gpu_backend="mosaic_gpu"):
        plan = ajm.explain(mixture, x, 256, reduction=ajm.LOGSUMEXP)
        got = jax.jit(jax.value_and_grad(loss))(x)
    assert plan.backward.endswith("per program (Pallas Mosaic GPU interpreter)"), plan.backward
    want = jax.value_and_grad(lambda x: jax.nn.logsumexp(mixture(x)))(x)
    assert_tree_close(got, want, rtol=3e-6, atol=3e-6)


GRADS = {
    "add": (ajm.ADD, lambda y: jnp.sum(y, 0)),
    "logsumexp": (ajm.LOGSUMEXP, lambda y: jax.nn.logsumexp(y, 0)),
    "max": (ajm.MAX, lambda y: jnp.max(y, 0)),  # the tied rows tallied first
    "var": (ajm.VAR, lambda y: jnp.var(y, 0)),
}


@pytest.mark.parametrize("monoid", sorted(GRADS))
@pytest.mark.parametrize("shape", [(1001, 3), (600,)])
def test_backward_kernel_matches_the_oracle(monoid, shape):
    """``value_and_grad`` with respect to the rows and a closed-over vector runs the
    Mosaic GPU backward kernel (its interpreter): inputs' cotangents streamed out
    feature by feature, the vector's summed per program; ragged last block."""
    reduction, plain = GRADS[monoid]
    x, w = normal(7, shape), normal(8, shape[1:])
    fun = lambda w: lambda v: jnp.tanh(v * w) + 0.1 * v
    loss = lambda w, x: jnp.sum(ajm.batch_map(fun(w), x, 256, reduction=reduction) ** 2)
    with ajm.config(backend="interpret", gpu_backend="mosaic_gpu"):
        plan = ajm.explain(fun(w), x, 256, reduction=reduction)
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, x)
    assert plan.backward.startswith("backward kernel"), plan.backward
    assert "(Pallas Mosaic GPU interpreter)" in plan.backward, plan.backward
    want = jax.value_and_grad(lambda w, x: jnp.sum(plain(fun(w)(x)) ** 2), argnums=(0, 1))(w, x)
    assert_tree_close(got, want, rtol=2e-5, atol=1e-4)  # (gradients of up to 300)


def test_closed_over_constants_and_rewritten_operations():
    """A scalar ``fun`` closes over reaches the kernel; ``log1p``, ``expm1``,
    ``isfinite`` and ``logaddexp`` (none lowered by Mosaic GPU) run rewritten."""
    x = normal(2, (777,))
    scale = jnp.float32(0.3)
    fun = lambda x: (
        jnp.log1p(jnp.abs(x) * scale)
        + jnp.expm1(x * 1e-3)
        + jnp.where(jnp.isfinite(1 / x), 1.0, 0.0)
        + jnp.logaddexp(x, scale)
    )
    got, _ = interpreted(fun, x, "add", batch_size=256)
    assert_tree_close(got, jnp.sum(fun(x)), rtol=3e-6)


@pytest.mark.parametrize("name", sorted(PORTABLE))
def test_rewrites_agree_with_jax_at_edge_values(name):
    edges = [0.0, -0.0, 1e-30, -1e-8, 1e-7, 3e-4, -0.5, 0.9, 1.0, 20.0, 80.0, 1e30]
    x = np.array([*edges, np.inf, -np.inf, -1.0, -2.0, np.nan], np.float32)
    reference = {"is_finite": jnp.isfinite, "log1p": jnp.log1p, "expm1": jnp.expm1}
    reference.update(stop_gradient=jax.lax.stop_gradient, add_any=jnp.add)
    args = (x, x[::-1]) if name == "add_any" else (x,)
    got = np.asarray(PORTABLE[name](*map(jnp.asarray, args)))
    want = np.asarray(reference[name](*args))
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)


# -- the backend chain, lowered for abstract GPUs ---------------------------------------


def explain_on(kind, fun, x, **options):
    with ajm.config(**options), jax.sharding.use_abstract_mesh(abstract_mesh("cuda", kind)):
        return ajm.explain(fun, x, 4096, reduction=jnp.add, chunk_reduction=lambda y: y.sum(0))


def lowered_on(kind, fun, x, **options):
    call = lambda x: ajm.batch_map(
        fun, x, 4096, reduction=jnp.add, chunk_reduction=lambda y: y.sum(0)
    )
    with ajm.config(**options), jax.sharding.use_abstract_mesh(abstract_mesh("cuda", kind)):
        return jax.jit(call).trace(x).lower(lowering_platforms=("cuda",)).as_text()


X1 = jax.ShapeDtypeStruct((100003,), jnp.float32)


@pytest.mark.parametrize("y", [-3, -1, 0, 1])
def test_small_powers_agree_with_jax_at_edge_values(y):
    """``integer_pow`` below 2 (Mosaic GPU lowers only -1) from products and a division,
    as jax computes it, at zeros, infinities and NaN too; differentiated, it gives
    ``x ** 1`` itself."""
    from adv_jax_math.kernels.fused_reduce.interpreter import small_power

    x = jnp.array([0.0, -0.0, 1.5, -2.0, 1e-20, 1e30, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    np.testing.assert_array_equal(small_power(x, y), lax.integer_pow(x, y))


X2 = jax.ShapeDtypeStruct((100003, 4), jnp.float32)
SIN = lambda x: jnp.sin(x) ** 2


@needs_abstract_devices
def test_hopper_takes_mosaic_gpu_and_lowers_to_its_custom_call():
    plan = explain_on(H100, SIN, X1)
    assert plan.engine == "pallas" and "(Pallas Mosaic GPU" in plan.reason, plan
    assert plan.block_backend == "mosaic_gpu" and plan.block_rows == 256
    text = lowered_on(H100, SIN, X1)
    assert "mosaic_gpu" in text and "triton" not in text


@needs_abstract_devices
def test_hopper_takes_rows_of_features_feature_by_feature():
    """(N, 4) blocks fail Mosaic GPU's layout inference (DESIGN.md §10): the kernel
    takes the 4 features as 4 vectors of rows, split in XLA before it."""
    plan = explain_on(H100, lambda x: jnp.sin(x) * 2.0, X2)
    assert plan.block_backend == "mosaic_gpu" and "(Pallas Mosaic GPU" in plan.reason, plan
    assert "split into one vector of rows per feature in XLA first" in plan.reason
    assert "split into" not in explain_on(H100, SIN, X1).reason  # one feature: nothing to split
    text = lowered_on(H100, lambda x: jnp.sin(x) * 2.0, X2)
    assert "mosaic_gpu" in text and "triton" not in text


@needs_abstract_devices
def test_hopper_takes_values_wider_inside_fun_and_declines_past_a_threads_registers():
    """A ``fun`` may widen its rows inside (16 components of one value); where one
    element of its output needs more values of a row at once than a thread may hold
    (256 constants' elements and the products made of them, all before their sum),
    Mosaic GPU declines with the count (Triton takes it)."""
    assert explain_on(H100, mixture, X1).block_backend == "mosaic_gpu"
    scales = np.linspace(0.0, 1.0, 256, dtype=np.float32)
    wide = lambda x: jnp.sum(jnp.sin(x[:, None] * scales), axis=1)
    plan = explain_on(H100, wide, X1)
    assert plan.block_backend == "triton", plan
    why = "Mosaic GPU holds one row per thread: one element of fun's output needs "
    assert why in plan.reason and "over the 128 a thread may hold" in plan.reason, plan.reason


@needs_abstract_devices
def test_rows_of_three_fuse_on_hopper_not_on_ampere():
    """Triton needs power-of-two arrays; Mosaic GPU's features are vectors of rows."""
    x3 = jax.ShapeDtypeStruct((100003, 3), jnp.float32)
    assert explain_on(H100, jnp.sin, x3).block_backend == "mosaic_gpu"
    ampere = explain_on(A100, jnp.sin, x3)
    assert ampere.engine == "scan" and "power-of-two size" in ampere.reason, ampere


@needs_abstract_devices
def test_hopper_falls_back_to_triton_with_mosaic_gpus_reason():
    """What the Mosaic GPU kernel does not take goes to Triton, and explain says why."""
    mixed = explain_on(H100, lambda x: x - jnp.mean(x), X2)  # the block's mean: not row by row
    assert "only when fun works row by row" in mixed.reason and "(Pallas Triton" in mixed.reason
    floor = explain_on(H100, lambda x: jnp.floor(x * 3.0), X1)
    assert "Mosaic GPU has no lowering for floor (in fun)" in floor.reason, floor
    with jax.sharding.use_abstract_mesh(abstract_mesh("cuda", H100)):
        small = ajm.explain(SIN, X1, 64, reduction=jnp.add, chunk_reduction=lambda y: y.sum(0))
    assert "Mosaic GPU blocks need at least 128 rows (a warpgroup's threads)" in small.reason


@needs_abstract_devices
def test_hopper_groups_wide_rows_and_weighs_their_reads():
    """A layer's 32 outputs go in element groups on Mosaic GPU (lowered: one custom
    call per group, no Triton); k-NN against 128 query points needs 26 groups, each
    reading every feature and launching once, which the roofline model finds slower
    than the scan engine at 10007 rows: Mosaic GPU declines with that verdict, and
    Triton's kernel (the next step) is weighed and taken."""
    w = np.linspace(-0.5, 0.5, 16 * 32, dtype=np.float32).reshape(16, 32)
    layer = lambda x: jnp.tanh(x @ w)
    x16 = jax.ShapeDtypeStruct((100003, 16), jnp.float32)
    plan = explain_on(H100, layer, x16)
    assert plan.block_backend == "mosaic_gpu", plan
    groups = int(plan.reason.split(", in ")[-1].split(" kernels, each folding a group")[0])
    assert groups > 1, plan.reason
    text = lowered_on(H100, layer, x16)
    assert text.count("mosaic_gpu") >= groups and "triton" not in text
    q = np.linspace(-1, 1, 128 * 16, dtype=np.float32).reshape(128, 16)
    knn = lambda p: jnp.sum(p * p, axis=1, keepdims=True) - 2.0 * (p @ q.T)
    plan = explain_on(H100, knn, jax.ShapeDtypeStruct((10007, 16), jnp.float32))
    assert plan.block_backend == "triton", plan
    why = "Pallas Mosaic GPU not used: the roofline model says the scan engine is faster: "
    assert why in plan.reason and "27 launches" in plan.reason, plan.reason


@needs_abstract_devices
def test_constants_of_the_blocks_size_and_of_it_by_chance():
    """fun traced on 128 rows: 128 query points are a constant of that size by chance
    (a trace on 256 rows has them too), a column of the block's row numbers is not.
    The k-NN's backward kernel runs at Triton's own block."""
    q = np.linspace(-1, 1, 128 * 16, dtype=np.float32).reshape(128, 16)
    knn = lambda p: jnp.sum(p * p, axis=1, keepdims=True) - 2.0 * (p @ q.T)
    sized = lambda x: x * np.arange(x.shape[0], dtype=np.float32)[:, None]
    x16 = jax.ShapeDtypeStruct((100003, 16), jnp.float32)
    with jax.sharding.use_abstract_mesh(abstract_mesh("cuda", H100)):
        top = ajm.explain(knn, x16, 1024, reduction=ajm.top_k(8, smallest=True))
        plan = ajm.explain(sized, x16, 1024, reduction=jnp.add, chunk_reduction=jnp.sum)
    assert top.block_backend == "mosaic_gpu", top.reason
    # Mosaic GPU's backward kernel takes no top-k: Triton's runs at Triton's own block
    # (its forward's: 256 // k rows), not at Mosaic GPU's 128 rows of 128 distances.
    assert top.backward.startswith("backward kernel, blocks of 32 rows"), top.backward
    assert "(Pallas Triton); Pallas Mosaic GPU not used" in top.backward, top.backward
    assert plan.block_backend == "triton", plan.reason
    assert "a constant of fun has a leading axis of the block's 128 rows" in plan.reason


@needs_abstract_devices
def test_ampere_keeps_triton_and_says_why():
    plan = explain_on(A100, SIN, X1)
    assert "(Pallas Triton" in plan.reason, plan
    assert "needs compute capability 9.0 or newer (Hopper); " in plan.reason
    assert "has compute capability 8.0" in plan.reason
    forced = explain_on(A100, SIN, X1, gpu_backend="mosaic_gpu")
    assert forced.engine == "scan" and "compute capability 9.0" in str(forced), forced


@needs_abstract_devices
def test_forcing_triton_on_hopper():
    plan = explain_on(H100, SIN, X1, gpu_backend="triton")
    assert "(Pallas Triton" in plan.reason and "Mosaic" not in plan.reason, plan
    assert "triton" in lowered_on(H100, SIN, X1, gpu_backend="triton")


@needs_abstract_devices
def test_without_pallas_triton_hopper_still_fuses_and_ampere_falls_back(monkeypatch):
    """As a jax without ``jax.experimental.pallas.triton`` would have it."""

    def gone():
        raise ImportError("No module named 'jax.experimental.pallas.triton'")

    monkeypatch.setattr(targets, "pallas_triton", gone)
    plan = explain_on(H100, SIN, X1)
    assert plan.engine == "pallas" and plan.block_backend == "mosaic_gpu", plan
    assert plan.backward.endswith("per program (Pallas Mosaic GPU)"), plan.backward
    assert "triton" not in lowered_on(H100, SIN, X1)
    loss = lambda w, x: jnp.sum(ajm.batch_map(lambda v: jnp.sin(v * w), x, 4096, reduction=ajm.ADD))
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    with jax.sharding.use_abstract_mesh(abstract_mesh("cuda", H100)):
        text = grad.trace(jnp.float32(2), X2).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" not in text and text.count("mosaic_gpu") >= 2, text.count("mosaic_gpu")
    assert "fused_reduce_backward" in text
    ampere = explain_on(A100, SIN, X1)
    assert ampere.engine == "scan", ampere
    assert "Pallas Triton is missing from this jax" in str(ampere)
    assert "compute capability 9.0" in str(ampere)


def test_gpu_backend_option_is_checked(monkeypatch):
    with (
        pytest.raises(ValueError, match=r"gpu_backend='cutlass' is not one of"),
        ajm.config(gpu_backend="cutlass"),
    ):
        pass
    monkeypatch.setenv("ADV_JAX_MATH_GPU_BACKEND", "Triton")
    assert ajm.config  # the variable is read when no config block is active
    from adv_jax_math.core.config import current

    assert current().gpu_backend == "triton"
    monkeypatch.setenv("ADV_JAX_MATH_GPU_BACKEND", "wgmma")
    with pytest.raises(ValueError, match=r"ADV_JAX_MATH_GPU_BACKEND='wgmma' is not accepted"):
        current()


# The special columns of test_special_values (-1e30 ... +inf, NaN among finite values) in
# blocks of 256 rows: every monoid the features path takes, values and gradients; the
# rest of them in make test-slow.
FAST_SPECIAL = {"ADD", "LOGSUMEXP", "MAX_ARGMAX", "var(ddof=1)", "top_k(2)"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if n in FAST_SPECIAL else pytest.mark.slow)
        for n in special.TABLE
        if not n.startswith("softmax")
    ],
)
def test_special_columns(name):
    """NaN exactly where plain JAX has NaN, infinities exactly, gradients too, through the
    backward kernel (a top-k's too: each element's k slots)."""
    monoid, want_of, fun = special.TABLE[name]
    y = np.tile(special.Y, (40, 1))  # 280 rows of 11 special columns
    x = (jnp.asarray(y), jnp.linspace(-1.0, 1.0, len(y), dtype=np.float32)[:, None])
    want = want_of(fun(x))
    weights = special._weights(want)
    want_grad = jax.grad(lambda x: special._dot(want_of(fun(x)), weights))(x)
    loss = lambda x: special._dot(ajm.batch_map(fun, x, 256, reduction=monoid), weights)
    with ajm.config(backend="interpret", gpu_backend="mosaic_gpu"):
        plan = ajm.explain(fun, x, 256, reduction=monoid)
        special._close(ajm.batch_map(fun, x, 256, reduction=monoid), want, name)
        special._close(jax.grad(loss)(x), want_grad, f"grad {name}")
    assert "Pallas Mosaic GPU interpreter" in plan.reason, plan.reason
    assert plan.backward.startswith("backward kernel"), plan.backward
