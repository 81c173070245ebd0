"""Chunking without a second copy of ``fun``, exact accumulation, one tie rule.

* copies: the compiled program holds ``fun`` once for maps and every recognized
  monoid, whether or not ``batch_size`` divides ``n`` (a marker op is counted), but
  for a logsumexp of a small elementwise ``fun``: once per pass of its fold, each
  fused into its reduction (``_scan._cheap``);
* infinities and NaN in the rows the last two chunks share come out as in plain JAX
  (a 0/1 weight would turn ``inf`` into ``nan``);
* accuracy: a chunked float sum or logsumexp is within 2x the error of ``jnp.sum`` /
  ``jax.nn.logsumexp`` against float64, however many chunks;
* ties: a max/min gradient splits evenly over every tied row, as ``jax.grad(jnp.max)``,
  on the scan engine, the kernel (interpret mode) and 4 devices.
"""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, needs_kernel, normal, oracle, reduction_kwargs
from jax.ad_checkpoint import print_saved_residuals

import adv_jax_math as ajm

MONOIDS = ("add", "max", "min", "logsumexp")


def _marked(v):
    return jnp.cbrt(v) * 2.0  # cbrt appears nowhere else in the program


def _marked_mixing(v):
    return _marked(v) + jnp.sum(v, axis=1, keepdims=True)  # not elementwise


@pytest.mark.parametrize("fun", [_marked, _marked_mixing], ids=["elementwise", "mixing"])
@pytest.mark.parametrize("n", [10_000, 10_007])
@pytest.mark.parametrize("monoid", ("map", *MONOIDS))
def test_fun_compiled_once(monoid, n, fun):
    x = jnp.ones((n, 8))
    kw = {} if monoid == "map" else reduction_kwargs(monoid)
    with ajm.config(backend="scan"):
        plan = ajm.explain(fun, x, 1000, **kw)
        text = jax.jit(lambda v: ajm.batch_map(fun, v, 1000, **kw)).lower(x).as_text()
    assert plan.policy in (ajm.Policy.OVERLAP, ajm.Policy.SINGLE) or n % 1000 == 0, str(plan)
    two_passes = monoid == "logsumexp" and fun is _marked
    assert text.count("cbrt") == (2 if two_passes else 1), str(plan)


SPECIAL = {"inf": jnp.inf, "-inf": -jnp.inf, "nan": jnp.nan}


@pytest.mark.parametrize("value", list(SPECIAL))
@pytest.mark.parametrize("row", [7, 1, 9])  # repeated by the last two chunks; first; last
@pytest.mark.parametrize("monoid", ["add", "logsumexp"])
def test_special_values_in_overlapped_rows(monoid, row, value):
    # n=10, batch 4: chunks [0, 4), [4, 8), [6, 10); rows 6 and 7 are computed twice.
    x = jnp.arange(10.0).at[row].set(SPECIAL[value])
    with ajm.config(backend="scan", remainder="overlap"):
        plan = ajm.explain(lambda v: v, x, 4, **reduction_kwargs(monoid))
        got = ajm.batch_map(lambda v: v * 1.0, x, 4, **reduction_kwargs(monoid))
    assert plan.policy is ajm.Policy.OVERLAP and plan.masked == 2, str(plan)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(oracle(monoid)(x)))


def _relative_error(got, values, reduce):
    exact = reduce(np.asarray(values, np.float64))
    return abs(float(got) - float(exact)) / abs(float(exact))


@pytest.mark.parametrize("n", [2**18, 2**20], ids=["2^18", "2^20"])
@pytest.mark.parametrize("batch_size", [4, 64, 1024])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_chunked_sum_is_as_exact_as_jnp_sum(n, batch_size, dtype):
    x = (jnp.abs(normal(0, (n,))) + 0.5).astype(dtype)
    values = np.asarray(x.astype(jnp.float32))
    chunked = jax.jit(
        lambda v: ajm.batch_map(lambda r: r, v, batch_size, **reduction_kwargs("add"))
    )
    with ajm.config(backend="scan"):
        ours = _relative_error(chunked(x), values, np.sum)
    theirs = _relative_error(jnp.sum(x), values, np.sum)
    assert ours <= 2 * theirs + 1e-9, (ours, theirs)


@pytest.mark.parametrize("batch_size", [4, 64, 1024])
def test_chunked_logsumexp_is_as_exact_as_plain(batch_size):
    x = normal(1, (2**18,)) * 3
    lse = lambda v: np.log(np.sum(np.exp(v - v.max()))) + v.max()
    chunked = jax.jit(
        lambda v: ajm.batch_map(lambda r: r, v, batch_size, **reduction_kwargs("logsumexp"))
    )
    with ajm.config(backend="scan"):
        ours = _relative_error(chunked(x), x, lse)
    theirs = _relative_error(jax.nn.logsumexp(x), x, lse)
    assert ours <= 2 * theirs + 1e-7, (ours, theirs)


ENGINES = {
    "scan": (dict(backend="scan"), {}),
    "interpret": (dict(backend="interpret"), {}),
    "shard": ({}, dict(shard=True)),
}


@needs_kernel  # (jax < 0.10 splits ties by chunk: see _tangent.SUPPORTED)
@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("monoid", ["max", "min"])
def test_ties_share_the_gradient_evenly(engine, monoid):
    if engine == "shard" and jax.device_count() != 4:
        pytest.skip("needs the 4 virtual CPU devices")
    options, kw = ENGINES[engine]
    x = jnp.full((7,), 2.0)

    def loss(v):
        with ajm.config(**options):
            return ajm.batch_map(lambda r: r * 1.5, v, 3, **reduction_kwargs(monoid), **kw)

    assert_tree_close(jax.grad(loss)(x), jax.grad(lambda v: oracle(monoid)(v * 1.5))(x))
    assert_tree_close(jax.grad(loss)(x), jnp.full((7,), 1.5 / 7))


def test_remat_off_stores_no_input_slices():
    # With remat off a gradient keeps fun's intermediates per chunk, but slices of the
    # inputs (and the overlap weights) are taken again instead of stored.
    x = normal(2, (1000,))

    def loss(w):
        fun = lambda c: jnp.sin(w * c) * jnp.exp(-0.5 * c * c)
        return ajm.batch_map(fun, x, 64, **reduction_kwargs("add"))

    with ajm.config(backend="scan", remat=False), contextlib.redirect_stdout(io.StringIO()) as out:
        print_saved_residuals(loss, 1.3)
        got = jax.grad(loss)(1.3)
    stacked = [line for line in out.getvalue().splitlines() if line.startswith("f32[16,64]")]
    # cos(w c), exp(-c^2/2) and a product of them; saving everything also stores c and
    # the overlap weights (4)
    assert len(stacked) == 3, out.getvalue()
    expect = jax.grad(lambda w: jnp.sum(jnp.sin(w * x) * jnp.exp(-0.5 * x * x)))(1.3)
    assert_tree_close(got, expect)
