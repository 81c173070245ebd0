"""``softmax_weighted(heads=True)``: scores and values paired head by head (issue 43),
so that multi-head attention is one call. Against the plain-JAX softmax per head and
``jax.nn.dot_product_attention`` (layout ``(B, T, N, H)``, causal and not): values,
reverse and forward mode, on every engine of ``batch_map`` and ``pairwise``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_tree_close,
    each_on_an_engine,
    engine,
    needs_abstract_devices,
    normal,
    on_abstract_device,
)

import adv_jax_math as ajm
from adv_jax_math.pairs import api as pairs_api

HEADS = ajm.softmax_weighted(heads=True)


def per_head(s, v, k=1):
    """The oracle: ``sum_i softmax(s, 0)[i, *a, *h] v[i, *h, *u]``."""
    p = jax.nn.softmax(s, axis=0)
    na, nu = s.ndim - 1 - k, v.ndim - 1 - k
    p = p.reshape(p.shape + (1,) * nu)
    return jnp.sum(p * v.reshape(v.shape[:1] + (1,) * na + v.shape[1:]), axis=0)


SHAPES = {  # scores' rows, values' rows, heads
    "one score per head": ((29, 3), (29, 3, 4), 1),
    "queries by heads": ((29, 2, 3), (29, 3, 4), 1),
    "a scalar value per head": ((29, 3), (29, 3), 1),
    "two head axes": ((29, 2, 3), (29, 2, 3, 5), 2),
}


@pytest.mark.parametrize("shape, name", each_on_an_engine(SHAPES))
def test_batch_map_pairs_scores_and_values_head_by_head(shape, name):
    ss, sv, k = SHAPES[shape]
    s, v = 2 * normal(0, ss), normal(1, sv)
    red = ajm.softmax_weighted(return_lse=True, heads=k)
    with engine(name) as kw:
        run = lambda s, v: ajm.batch_map(lambda r: r, (s, v), 6, reduction=red, **kw)
        out, lse = jax.jit(run)(s, v)
        loss = lambda s, v: jnp.sum(jnp.sin(run(s, v)[0])) + jnp.sum(run(s, v)[1])
        grads = jax.jit(jax.grad(loss, (0, 1)))(s, v)
        tangent = jax.jvp(lambda s: run(s, v)[0], (s,), (jnp.cos(s),))[1]
    assert out.shape == ss[1:] + sv[1 + k :]
    assert_tree_close(out, per_head(s, v, k), rtol=1e-5, atol=1e-6)
    assert_tree_close(lse, jax.nn.logsumexp(s, 0), rtol=1e-5, atol=1e-6)
    plain = lambda s, v: jnp.sum(jnp.sin(per_head(s, v, k))) + jnp.sum(jax.nn.logsumexp(s, 0))
    assert_tree_close(grads, jax.grad(plain, (0, 1))(s, v), rtol=1e-4, atol=1e-5)
    want = jax.jvp(lambda s: per_head(s, v, k), (s,), (jnp.cos(s),))[1]
    assert_tree_close(tangent, want, rtol=1e-4, atol=1e-5)


# -- multi-head attention through pairwise ------------------------------------------
def attention(q, k, v, causal, tiles="auto"):
    """``jax.nn.dot_product_attention``'s layout, ``(B, T, N, H)``: one pairwise call
    per batch row (``jax.vmap``), every head in it (``heads=True``)."""
    t, f = jnp.arange(q.shape[1]), scores(q.shape[-1] ** -0.5, causal)
    one = lambda q, k, v: ajm.pairwise(f, (q, t), (k, v, t), HEADS, tiles=tiles)
    return jax.vmap(one)(q, k, v)


def scores(scale, causal):
    def f(qi, kvj):
        (qh, i), (kh, vh, j) = qi, kvj
        s = jnp.einsum("nh,nh->n", qh, kh) * scale  # (N,): a score per head
        return (jnp.where(j <= i, s, -jnp.inf) if causal else s), vh  # values (N, H)

    return f


def _qkv(b, t, n, h, dtype=jnp.float32):
    return tuple(normal(i, (b, t, n, h)).astype(dtype) for i in range(3))


def _loss(run):
    return lambda q, k, v: jnp.sum(jnp.sin(run(q, k, v)))


@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_attention_equals_dot_product_attention(causal):
    q, k, v = _qkv(2, 1000, 8, 64)  # B, T, N, H
    ours = lambda q, k, v: attention(q, k, v, causal)
    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    assert_tree_close(jax.jit(ours)(q, k, v), plain(q, k, v), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(_loss(ours), (0, 1, 2)))(q, k, v)
    assert_tree_close(
        got, jax.jit(jax.grad(_loss(plain), (0, 1, 2)))(q, k, v), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize(
    "backend, layout",
    [
        ("scan", None),
        ("interpret", "gpu"),
        pytest.param("interpret", "tpu", marks=pytest.mark.slow),
    ],
)
def test_multi_head_attention_on_the_other_engines(backend, layout, monkeypatch):
    if layout:
        monkeypatch.setattr(pairs_api, "INTERPRET_LAYOUT", layout)
    q, k, v = _qkv(2, 37, 4, 16)
    ours = lambda q, k, v: attention(q, k, v, True, tiles=(8, 16))
    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    with ajm.config(backend=backend):
        got = jax.jit(ours)(q, k, v)
        grads = jax.jit(jax.grad(_loss(ours), (0, 1, 2)))(q, k, v)
    assert_tree_close(got, plain(q, k, v), rtol=1e-5, atol=1e-5)
    assert_tree_close(grads, jax.grad(_loss(plain), (0, 1, 2))(q, k, v), rtol=1e-4, atol=1e-4)


@needs_abstract_devices
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_multi_head_attention_lowers_for_gpu_and_tpu(platform):
    q, k, v = _qkv(1, 300, 4, 64, jnp.bfloat16)
    grad = jax.value_and_grad(_loss(lambda q, k, v: attention(q, k, v, True)), (0, 1, 2))
    with on_abstract_device(platform):
        text = jax.jit(grad).trace(q, k, v).lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo" in text


@needs_abstract_devices
def test_multi_head_attention_on_a_tpu_runs_in_xla_loops():
    """Several scores per pair: on a TPU v5e the matmul tile kernel took 46-56 ms for
    multi-head attention, XLA's loops 4.1 ms (choose.TPU_WIDE_PAIRS)."""
    q, k, v = (a[0] for a in _qkv(1, 4096, 8, 64, jnp.bfloat16))
    t = jnp.arange(4096)
    with on_abstract_device("tpu"):
        plan = ajm.explain_pairwise(scores(0.125, False), (q, t), (k, v, t), HEADS)
        one = ajm.explain_pairwise(
            scores(0.125, False), (q[:, :1], t), (k[:, :1], v[:, :1], t), HEADS
        )
    assert plan.engine == "pairwise tiles (matmul)", plan
    assert "f makes 8 values per pair (a score per head, say)" in str(plan), plan
    assert one.engine == "pairwise kernel (matmul, tpu)", one  # one head: the kernel


def test_heads_that_do_not_pair_are_refused():
    s, v = normal(0, (9, 3)), normal(1, (9, 4, 2))
    with pytest.raises(ValueError, match=r"rows of shapes \(3,\) and \(4, 2\); with heads=1"):
        ajm.batch_map(lambda r: r, (s, v), 4, reduction=HEADS)
    with pytest.raises(TypeError, match="heads=-1"):
        ajm.softmax_weighted(heads=-1)
    assert repr(HEADS) == "adv_jax_math.softmax_weighted(heads=1)"
    assert ajm.softmax_weighted() is ajm.SOFTMAX_WEIGHTED


def test_without_heads_every_score_takes_every_value():
    s, v = normal(0, (9, 3)), normal(1, (9, 3, 2))
    out = ajm.batch_map(lambda r: r, (s, v), 4, reduction=ajm.SOFTMAX_WEIGHTED)
    want = jnp.tensordot(jax.nn.softmax(s, 0), v, ([0], [0]))
    assert out.shape == (3, 3, 2)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(jax.device_count() != 4, reason="needs the 4 virtual CPU devices")
@pytest.mark.parametrize("shard", [True, "y"])
@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_multi_head_attention_spread_over_devices(shard, axis_type):
    """The queries (shard=True) or the keys ("y") over 4 devices under jax.set_mesh,
    203 of them (not a multiple of 4): values and gradients."""
    q, k, v = (a[0] for a in _qkv(1, 203, 4, 16))
    t, f = jnp.arange(203), scores(0.25, True)
    ours = lambda q, k, v: ajm.pairwise(f, (q, t), (k, v, t), HEADS, shard=shard)
    plain = lambda q, k, v: jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[
        0
    ]
    mesh = jax.make_mesh((4,), ("d",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    with jax.set_mesh(mesh):
        got = jax.jit(ours)(q, k, v)
        grads = jax.jit(jax.grad(_loss(ours), (0, 1, 2)))(q, k, v)
    assert_tree_close(got, plain(q, k, v), rtol=1e-5, atol=1e-5)
    assert_tree_close(grads, jax.grad(_loss(plain), (0, 1, 2))(q, k, v), rtol=1e-4, atol=1e-4)


def test_multi_head_attention_hessian_vector_product():
    """Forward over reverse mode (a Hessian-vector product) against XLA's attention."""
    q, k, v = _qkv(1, 70, 2, 8)
    dq, dk, dv = _qkv(1, 70, 2, 8)
    ours = lambda q, k, v: attention(q, k, v, True)
    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def hvp(run):
        grad = jax.grad(_loss(run), (0, 1, 2))
        return jax.jvp(grad, (q, k, v), (dq, dk, dv))[1]

    assert_tree_close(jax.jit(lambda: hvp(ours))(), hvp(plain), rtol=1e-4, atol=1e-4)
