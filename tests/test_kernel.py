"""The fused Pallas kernel itself (``kernels.fused_reduce``), in interpret mode on CPU.

What the engine matrix (test_engines.py) cannot reach through ``batch_map``: the
in-kernel loop over blocks (``steps > 1``), identities in masked rows, logsumexp
infinities, ties in max/min gradients, closed-over constants of every kind,
integer and boolean inputs, higher-order and vmapped gradients, ``check``'s
reasons. Oracles are plain JAX (helpers.oracle, from bench/cases: plain_pair).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    TraceCounter,
    assert_tree_close,
    contains_kernel,
    needs_kernel,
    oracle,
    reduction_kwargs,
)
from helpers import normal as standard_normal

import adv_jax_math as ajm
from adv_jax_math.analysis.recognize import recognize
from adv_jax_math.engines import registry as _engines
from adv_jax_math.kernels.fused_reduce.fused import check, fused_states
from adv_jax_math.monoids.reduction import MonoidReduction
from adv_jax_math.plan.base import Call

pytestmark = needs_kernel

MONOIDS = ("add", "max", "min", "logsumexp")
REDUCTIONS = [(m, axis) for m in MONOIDS for axis in (None, 0)]
RIDS = [f"{m}-{'all' if axis is None else axis}" for m, axis in REDUCTIONS]
W4 = jnp.array([0.5, -1.0, 2.0, 0.25], jnp.float32)


def normal(shape, dtype=jnp.float32, seed=0):
    return standard_normal(seed, shape, dtype)


def monoid_reduction(fun, xs, monoid, axis):
    """The library's MonoidReduction for ``monoid`` over ``axis`` of each leaf."""
    kw = reduction_kwargs(monoid, axis)
    rec = recognize(kw["reduction"], kw["chunk_reduction"], jax.eval_shape(fun, xs))
    assert rec.leaves is not None, rec.how
    return MonoidReduction(rec.leaves, rec.out_tree, rec.prologue, rec.how)


def fused(fun, xs, monoid, axis=None, *, max_rows=8, steps=None):
    """``batch_map`` on the fused kernel in interpret mode, at the block the engine
    chooses (``steps``: blocks each kernel program loops over)."""
    kw = reduction_kwargs(monoid, axis)
    call = Call(
        fun, jax.tree.map(jnp.asarray, xs), max_rows, kw["reduction"], kw["chunk_reduction"]
    )
    with ajm.config(backend="interpret"):
        plan = _engines.plan(call)
    assert plan.engine == "interpret", str(plan)
    if steps:
        plan = dataclasses.replace(plan, block_steps=steps)
    return _engines.run(plan, call)


def plain(fun, xs, monoid, axis=None, **_):
    return oracle(monoid, axis)(fun(xs))


TREE = lambda d: {"p": d["a"] * d["b"][:, None], "q": (jnp.exp(d["b"]),)}


def tree_input(n):
    return {"a": normal((n, 4)), "b": normal((n,), seed=1)}


# --------------------------------------------------------------------------- #
# Blocks, the in-kernel loop and masked rows
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("reduction", REDUCTIONS, ids=RIDS)
def test_in_kernel_loop(reduction):
    # 37 rows in blocks of 8: 5 blocks, looped 2 (or 3) per program; the last
    # program's blocks run past n and must be masked entirely.
    steps = 2 if reduction[1] is None else 3
    for fun, xs in [(lambda x: x * W4, normal((37, 4))), (TREE, tree_input(37))]:
        got = fused(fun, xs, *reduction, steps=steps)
        assert_tree_close(got, plain(fun, xs, *reduction))


@pytest.mark.parametrize(
    "n, max_rows, reduction",
    [(32, 8, ("add", 0)), (5, None, ("max", None)), (1, 4, ("logsumexp", 0)), (9, 1, ("min", 0))],
)
def test_block_counts(n, max_rows, reduction):
    fun, xs = (lambda x: jnp.cos(x) * W4), normal((n, 4))
    assert_tree_close(fused(fun, xs, *reduction, max_rows=max_rows), plain(fun, xs, *reduction))


@pytest.mark.parametrize("monoid", MONOIDS)
def test_masked_rows_take_the_identity_not_zero(monoid):
    # max of negatives, min of positives: padding with zeros would win.
    x = jnp.abs(normal((19, 4))) + 1.0
    xs = x if monoid == "min" else -x
    ident = lambda v: v
    assert_tree_close(fused(ident, xs, monoid, steps=2), plain(ident, xs, monoid))


def test_logsumexp_infinities():
    ident = lambda x: x
    all_neg = jnp.full((21,), -jnp.inf)
    assert_tree_close(fused(ident, all_neg, "logsumexp"), jax.nn.logsumexp(all_neg))
    some_pos = jnp.zeros((21,)).at[13].set(jnp.inf)
    assert_tree_close(fused(ident, some_pos, "logsumexp"), jax.nn.logsumexp(some_pos))
    cols = normal((21, 4)).at[:, 2].set(-jnp.inf).at[3, 1].set(jnp.inf).at[:17, 0].set(-jnp.inf)
    assert_tree_close(fused(ident, cols, "logsumexp", 0), jax.nn.logsumexp(cols, axis=0))
    big = normal((21, 4)) * 1e3  # no overflow from the per-block shift
    assert_tree_close(fused(ident, big, "logsumexp"), jax.nn.logsumexp(big), rtol=1e-4)


def test_max_min_ties_forward_and_grad():
    xs = jnp.array([[1.0, 3.0], [3.0, 0.0], [2.0, 3.0], [3.0, -1.0], [0.0, 3.0]])
    w = jnp.array([1.0, 1.0])
    for reduction in [("max", None), ("max", 0), ("min", 0)]:

        def loss(x, w, engine, reduction=reduction):
            out = engine(lambda v: v * w, x, *reduction, max_rows=2)
            return jnp.sum(out * jnp.array([1.0, 2.0]))

        assert_tree_close(loss(xs, w, fused), loss(xs, w, plain))
        got = jax.grad(loss, argnums=(0, 1))(xs, w, fused)
        assert_tree_close(got, jax.grad(loss, argnums=(0, 1))(xs, w, plain))


# --------------------------------------------------------------------------- #
# Constants, integer and boolean inputs
# --------------------------------------------------------------------------- #


def test_closures_over_concrete_int_bool_and_numpy_constants():
    idx = jnp.arange(4)  # an int constant array
    mask = np.array([True, False, True, True])  # a NumPy bool constant
    scale = np.float32(1.5)
    fun = lambda x: jnp.where(mask, x * idx * scale, 0.0) + W4
    xs = normal((23, 4))
    for reduction in [("add", 0), ("logsumexp", None)]:
        assert_tree_close(fused(fun, xs, *reduction, steps=2), plain(fun, xs, *reduction))


def test_closure_over_traced_scalar_under_jit():
    fun = lambda s: lambda x: jnp.sin(x) * s + s * s
    xs = normal((29, 4))
    f = jax.jit(lambda s, xs: fused(fun(s), xs, "logsumexp", 0))
    assert_tree_close(f(1.7, xs), plain(fun(1.7), xs, "logsumexp", 0))
    assert contains_kernel(f.lower(1.7, xs).as_text(), "cpu")


def test_int_and_bool_inputs():
    n = 21
    xs = {
        "i": jnp.arange(n * 4, dtype=jnp.int32).reshape(n, 4) % 7 - 3,
        "m": jnp.arange(n) % 3 == 0,
        "a": normal((n, 4)),
    }
    fun = lambda d: {
        "count": d["m"].astype(jnp.int32),
        "imax": d["i"] * 2,
        "sel": jnp.where(d["m"][:, None], d["a"], -d["a"]) + d["i"],
    }
    for monoid in ("add", "max", "min"):
        assert_tree_close(fused(fun, xs, monoid, 0, steps=2), plain(fun, xs, monoid, 0))
    w = W4
    loss = lambda w, e: jnp.sum(e(lambda d: fun(d)["sel"] * w, xs, "logsumexp", 0))
    assert_tree_close(jax.grad(loss)(w, fused), jax.grad(loss)(w, plain))


# --------------------------------------------------------------------------- #
# Gradients and transforms
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("reduction", REDUCTIONS, ids=RIDS)
def test_grad_wrt_inputs_and_closed_over_params(reduction):
    xs, b = normal((27, 4)), jnp.float32(0.3)
    cot = jnp.array([1.0, -2.0, 0.5, 3.0])

    def loss(xs, w, b, engine):
        out = engine(lambda x: jnp.tanh(x * w) + b * x, xs, *reduction, steps=2)
        return jnp.sum(out * cot) if out.ndim else out

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(xs, W4, b, fused)
    want = jax.grad(loss, argnums=(0, 1, 2))(xs, W4, b, plain)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-5)


def test_bf16_grad():
    bf = normal((21, 4), jnp.bfloat16)
    f = lambda e: lambda x: e(jnp.sin, x, "logsumexp")
    assert_tree_close(jax.grad(f(fused))(bf), jax.grad(f(plain))(bf))


def test_second_order():
    xs = normal((19, 4))
    f = lambda e: lambda w: e(lambda x: x * w, xs, "logsumexp")
    assert_tree_close(jax.hessian(f(fused))(W4), jax.hessian(f(plain))(W4), rtol=1e-4, atol=1e-4)


def test_vmap_over_inputs_and_params():
    xs, ws = normal((3, 22, 4)), normal((3, 4), seed=5)
    f = lambda e: lambda x, w: e(lambda v: jnp.sin(v) * w, x, "logsumexp", 0)
    assert_tree_close(jax.vmap(f(fused))(xs, ws), jax.vmap(f(plain))(xs, ws))
    got = jax.vmap(f(fused), (None, 0))(xs[0], ws)
    assert_tree_close(got, jax.vmap(f(plain), (None, 0))(xs[0], ws))
    loss = lambda e: lambda x, w: jnp.sum(f(e)(x, w))
    g = jax.vmap(jax.grad(loss(fused), argnums=(0, 1)))(xs, ws)
    assert_tree_close(g, jax.vmap(jax.grad(loss(plain), argnums=(0, 1)))(xs, ws))


def test_fun_traced_once_per_block_size():
    fun = TraceCounter(jnp.exp)
    xs = normal((37, 4))
    r = monoid_reduction(jnp.exp, xs, "add", None)
    verdict = check(r.prepare(fun), xs, r, platform="cpu", max_rows=8)
    assert verdict.problem is None and fun.calls == 1  # traced once, at the block it runs
    fun.calls = 0
    jax.grad(lambda x: fused(fun, x, "add", max_rows=8))(xs)
    assert fun.calls == 1  # the forward kernel and the tangent scan share one trace


def test_gradient_memory_does_not_grow_with_intermediates():
    # fun's intermediates are 64x its input; the checkpointed tangent scan keeps only inputs.
    proj = normal((4, 64))
    fun = lambda v: jnp.tanh(v @ proj)

    def temp_bytes(n):
        xs = jax.ShapeDtypeStruct((n, 4), jnp.float32)
        g = jax.jit(jax.grad(lambda x: fused(fun, x, "add", max_rows=256)))
        return g.lower(xs).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(4096), temp_bytes(16384)
    inputs = (16384 - 4096) * 4 * 4
    assert large - small < 8 * inputs, (small, large)  # O(n * 64 * 4) bytes would be 64x


# --------------------------------------------------------------------------- #
# check(): why the kernel cannot run, said with what was given
# --------------------------------------------------------------------------- #

R_ADD = monoid_reduction(jnp.sin, jnp.ones((9, 2)), "add", None)


@pytest.mark.parametrize(
    "fun, xs, platform, reason",
    [
        (lambda d: d[0], (jnp.ones(4), jnp.ones(5)), "cpu", r"different leading sizes"),
        (jnp.sin, jnp.ones((0, 2)), "cpu", r"n == 0"),
        (lambda x: jnp.sum(x, axis=0), jnp.ones((9, 2)), "cpu", "one output row per input row"),
        (jnp.sin, jnp.ones((9, 2)), "metal", "platform='metal'"),
        (jnp.sin, jnp.float32(1), "cpu", "0-d"),
        (lambda x: x + jnp.ones((10, 2)), jnp.ones((10, 2)), "cpu", "could not be traced"),
    ],
    ids=["leading sizes", "empty", "rows", "platform", "0-d", "trace"],
)
def test_check_says_why(fun, xs, platform, reason):
    verdict = check(lambda x: [fun(x)], xs, R_ADD, platform=platform, max_rows=None)
    assert verdict.problem is not None and reason in verdict.problem, verdict


def test_fused_states_errors():
    block = lambda f: jax.make_jaxpr(f, return_shape=True)(jnp.ones((8, 2)))
    with pytest.raises(ValueError, match="one output row per input row"):
        fused_states(
            block(lambda x: [jnp.sum(x, 0)]), jnp.ones((9, 2)), R_ADD, rows=8, interpret=True
        )
    if jax.default_backend() != "cpu":  # lowered for the device there (device_check_tpu.sh)
        return
    with pytest.raises(ValueError, match="interpret"):  # no compiled Pallas on CPU
        traced = block(lambda v: [jnp.sin(v)])
        run = lambda x: fused_states(traced, x, R_ADD, rows=8, interpret=False, platform="cpu")
        jax.jit(run).lower(jnp.ones((9, 2)))
