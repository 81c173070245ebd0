"""fun is traced once; gradient memory stays O(batch_size); no private JAX imports."""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import TraceCounter

import adv_jax_math as ajm

SRC = pathlib.Path(ajm.__file__).parent


@pytest.mark.parametrize(
    "reduction, chunk_reduction",
    [
        (None, ajm.identity),
        (jnp.add, jnp.sum),
        (jnp.maximum, jnp.maximum.reduce),
        (jnp.logaddexp, jax.nn.logsumexp),
        (ajm.MIN, ajm.identity),
    ],
)
@pytest.mark.parametrize("n", [100, 101, 97])
def test_fun_traced_once_for_non_divisible_n(reduction, chunk_reduction, n):
    fun = TraceCounter(lambda x: jnp.sin(x) * 2)
    jax.jit(
        lambda x: ajm.batch_map(fun, x, 8, reduction=reduction, chunk_reduction=chunk_reduction)
    )(jnp.ones((n, 3)))
    assert fun.calls == 1


def test_batch_vmap_traces_f_once():
    f = TraceCounter(lambda x: x @ x)
    ajm.batch_vmap(f, batch_size=4, reduction=jnp.add, chunk_reduction=jnp.sum)(jnp.ones((9, 3)))
    assert f.calls == 1


def test_generic_reduction_traces_chunk_and_remainder():
    fun = TraceCounter(jnp.exp)
    ajm.batch_map(fun, jnp.ones(10), 4, reduction=jnp.multiply, chunk_reduction=jnp.prod)
    assert fun.calls == 2  # full chunks once, the 2-row remainder once


def contributions(targets, sources):
    """Biot–Savart-style field of each source at each target: (S, T, 3)."""
    d = targets[None, :, :] - sources[:, None, :]
    r2 = jnp.sum(d * d, axis=-1, keepdims=True) + 1e-2
    return jnp.cross(d, sources[:, None, :]) / r2**1.5


def grad_temp_bytes(n, batch_size, targets=256):
    tgt = jnp.ones((targets, 3))

    def loss(scale, src):
        field = ajm.batch_map(
            lambda s: contributions(tgt * scale, s),
            src,
            batch_size,
            reduction=jnp.add,
            chunk_reduction=jnp.add.reduce,
        )
        return jnp.sum(field**2)

    src = jax.ShapeDtypeStruct((n, 3), jnp.float32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(1.0, src).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_gradient_memory_flat_in_n():
    small, big = grad_temp_bytes(1000, 128), grad_temp_bytes(16 * 1000, 128)
    # Plain autodiff would keep (256 x n x 3) intermediates: 16x growth.
    assert big <= 2 * small, (small, big)


def test_no_private_jax_imports():
    pattern = re.compile(r"^\s*(from|import)\s+jax\._src|jax\._src\.", re.M)
    offenders = [p.name for p in SRC.rglob("*.py") if pattern.search(p.read_text())]
    assert not offenders
