"""Reductions written the ways real code writes them reach the monoid engines.

Each row is a call as a user writes it (defs, lambdas, methods, partials, operator /
jnp / lax binaries, pytrees with a different monoid per leaf, elementwise
prologues, keepdims): recognized as the right monoid with the right axes, equal in
value and gradient to the unchunked plain-JAX computation, ``fun`` traced once,
and planned onto the fused kernel for an abstract H100 and TPU v5 lite. Look-alikes
that are not monoids stay generic.
"""

import functools
import itertools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    TraceCounter,
    assert_tree_close,
    needs_abstract_devices,
    needs_kernel,
    on_abstract_device,
)
from jax import lax

import adv_jax_math as ajm


def _sum0(y):
    return jnp.sum(y, axis=0)


def _lse0(y):
    return jax.nn.logsumexp(y, axis=0)


def _pair(y):
    return y, jnp.cos(y)


def _named(y):
    return {"s": y, "m": jnp.sin(y)}


sin = jnp.sin
# name: (fun, reduction, chunk_reduction, [(monoid, axis) per result leaf], dtype)
CASES = {
    "def sum0 + jnp.add": (sin, jnp.add, _sum0, [("add", 0)], jnp.float32),
    "method t.sum(0) + operator.add": (sin, operator.add, lambda t: t.sum(0), [("add", 0)], None),
    "t.sum() + lambda a,b: a+b": (
        sin,
        lambda a, b: a + b,
        lambda t: t.sum(),
        [("add", None)],
        None,
    ),
    "DESC: lambda x: x.sum(axis=0)": (sin, jnp.add, lambda x: x.sum(axis=0), [("add", 0)], None),
    "partial(jnp.sum, axis=0) + lax.add": (
        sin,
        lax.add,
        functools.partial(jnp.sum, axis=0),
        [("add", 0)],
        None,
    ),
    "sum keepdims": (
        sin,
        jnp.add,
        lambda t: jnp.sum(t, axis=0, keepdims=True),
        [("add", 0)],
        None,
    ),
    "t.max() + jnp.maximum": (sin, jnp.maximum, lambda t: t.max(), [("max", None)], None),
    "jnp.max(axis=0) + lax.max": (sin, lax.max, lambda t: jnp.max(t, axis=0), [("max", 0)], None),
    "maximum.reduce + lambda": (
        sin,
        lambda a, b: jnp.maximum(a, b),
        jnp.maximum.reduce,
        [("max", 0)],
        None,
    ),
    "t.min(0) + jnp.minimum": (sin, jnp.minimum, lambda t: t.min(0), [("min", 0)], None),
    "jnp.amin + lax.min": (sin, lax.min, jnp.amin, [("min", None)], None),
    "def lse0 + logaddexp": (sin, jnp.logaddexp, _lse0, [("logsumexp", 0)], None),
    "scipy logsumexp": (
        sin,
        jnp.logaddexp,
        jax.scipy.special.logsumexp,
        [("logsumexp", None)],
        None,
    ),
    "logsumexp keepdims": (
        sin,
        jnp.logaddexp,
        lambda t: jax.nn.logsumexp(t, axis=0, keepdims=True),
        [("logsumexp", 0)],
        None,
    ),
    "prologue sum(t**2, 0)": (sin, jnp.add, lambda t: jnp.sum(t**2, axis=0), [("add", 0)], None),
    "prologue max(abs(t))": (
        sin,
        jnp.maximum,
        lambda t: jnp.max(jnp.abs(t)),
        [("max", None)],
        None,
    ),
    "prologue exp(t).sum(0)": (sin, jnp.add, lambda t: jnp.exp(t).sum(0), [("add", 0)], None),
    "tuple: sum and max": (
        _pair,
        lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
        lambda o: (o[0].sum(0), o[1].max()),
        [("add", 0), ("max", None)],
        None,
    ),
    "dict: min and logsumexp": (
        _named,
        lambda a, b: {"s": jnp.minimum(a["s"], b["s"]), "m": jnp.logaddexp(a["m"], b["m"])},
        lambda o: {"s": o["s"].min(0), "m": jax.nn.logsumexp(o["m"], axis=0)},
        [("logsumexp", 0), ("min", 0)],  # result leaves in key order: "m", "s"
        None,
    ),
    "int32 t.sum(0)": (lambda t: t * 3 - 1, jnp.add, lambda t: t.sum(0), [("add", 0)], jnp.int32),
    "Monoid object LOGSUMEXP": (sin, ajm.LOGSUMEXP, ajm.identity, [("logsumexp", 0)], None),
    "Monoid object ADD + jnp.sum": (sin, ajm.ADD, jnp.sum, [("add", None)], None),
}

N, B = 37, 8  # 5 chunks, the last one overlapping


def _x(dtype):
    x = np.random.default_rng(0).standard_normal((N, 4))
    return jnp.asarray(x * 4 if dtype == jnp.int32 else x, dtype or jnp.float32)


@pytest.mark.parametrize("name", CASES)
def test_recognized_value_grad_one_trace(name):
    fun, reduction, chunk_reduction, expected, dtype = CASES[name]
    x = _x(dtype)
    plan = ajm.explain(fun, x, B, reduction=reduction, chunk_reduction=chunk_reduction)
    assert plan.kind is ajm.Kind.MONOID, plan.recognition
    got = [(leaf.monoid.name, leaf.axis) for leaf in plan.reduction.leaves]
    assert got == expected, plan.recognition

    counted = TraceCounter(fun)
    run = jax.jit(
        lambda v: ajm.batch_map(counted, v, B, reduction=reduction, chunk_reduction=chunk_reduction)
    )
    out = run(x)
    assert counted.calls == 1
    if isinstance(reduction, ajm.Monoid) and chunk_reduction is ajm.identity:
        expect = jax.nn.logsumexp(fun(x), axis=0)
    else:
        expect = chunk_reduction(fun(x))
    assert_tree_close(out, expect)
    if dtype == jnp.int32:
        return
    total = lambda tree: sum(jnp.sum(leaf) for leaf in jax.tree.leaves(tree))
    grad = jax.grad(lambda v: total(run(v)))(x)
    plain = jax.grad(lambda v: total(expect_fn(fun, reduction, chunk_reduction)(v)))(x)
    assert_tree_close(grad, plain)


def expect_fn(fun, reduction, chunk_reduction):
    if isinstance(reduction, ajm.Monoid) and chunk_reduction is ajm.identity:
        return lambda v: jax.nn.logsumexp(fun(v), axis=0)
    return lambda v: chunk_reduction(fun(v))


@needs_kernel
@needs_abstract_devices
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", CASES)
def test_recognized_calls_take_the_kernel(name, platform):
    fun, reduction, chunk_reduction, _, dtype = CASES[name]
    with on_abstract_device(platform):
        x = jax.ShapeDtypeStruct((4096, 4), dtype or jnp.float32)
        plan = ajm.explain(fun, x, 1024, reduction=reduction, chunk_reduction=chunk_reduction)
    assert plan.engine == "pallas", plan.reason


counter = itertools.count(1)
LOOKALIKES = {
    "mean": (jnp.add, lambda t: t.mean(0)),
    "sum then max": (jnp.maximum, jnp.sum),
    "a*b+1": (lambda a, b: a * b + 1, jnp.sum),
    "sum over axis 1": (jnp.add, lambda t: t.sum(1)),
    "closes over a chunk counter": (jnp.add, lambda t: t.sum() * next(counter)),
    "sum of squares as max": (jnp.maximum, lambda t: jnp.sum(t**2)),
}


@pytest.mark.parametrize("name", LOOKALIKES)
def test_lookalikes_stay_generic(name):
    reduction, chunk_reduction = LOOKALIKES[name]
    plan = ajm.explain(jnp.sin, _x(None), B, reduction=reduction, chunk_reduction=chunk_reduction)
    assert plan.kind is ajm.Kind.GENERIC and plan.recognition, plan.recognition


def test_desc_singular_integral_call_form():
    # desc/integrals/singularities.py: reduction=jnp.add, chunk_reduction=lambda x: x.sum(axis=0)
    fun = lambda v: jnp.exp(-v) * v[:, :1]
    x = _x(None)
    chunk_reduction = lambda x: x.sum(axis=0)
    plan = ajm.explain(fun, x, 5, reduction=jnp.add, chunk_reduction=chunk_reduction)
    assert plan.kind is ajm.Kind.MONOID and plan.policy is ajm.Policy.OVERLAP
    assert_tree_close(
        ajm.batch_map(fun, x, 5, reduction=jnp.add, chunk_reduction=chunk_reduction),
        fun(x).sum(axis=0),
    )
