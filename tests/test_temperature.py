"""A logsumexp with a temperature, ``eps * jax.nn.logsumexp(s / eps, axis=0)``, as
OTT-JAX reduces on every Sinkhorn step: recognized as a monoid (the logsumexp of
``s / eps``, its result times ``eps``) with the matching combine
``eps * jnp.logaddexp(a / eps, b / eps)``, on every engine, against jax itself:
values and gradients, with infinities; and what stays generic, as written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close, engine, normal

import adv_jax_math as ajm

EPS = 0.05


def tempered(eps):
    chunk = lambda s: eps * jax.nn.logsumexp(s / eps, axis=0)
    combine = lambda a, b: eps * jnp.logaddexp(a / eps, b / eps)
    return chunk, combine


def costs(x):
    """``(rows, 3)`` scores: a cost to a point, a shifted copy, -inf on some rows."""
    d = -jnp.sum((x - jnp.array([0.3, -0.2, 0.1])) ** 2, axis=-1)
    return jnp.stack([d, 2 * d - 1.0, jnp.where(x[:, 0] > 0.5, -jnp.inf, d)], 1)


def points(n: int = 203) -> jax.Array:
    return normal(0, (n, 3))


# by default each engine with one temperature (a Latin square: every engine and every
# temperature once); the rest of the product slow (make test-slow)
@pytest.mark.parametrize(
    "name, eps",
    [
        pytest.param(name, eps, id=f"{name}-{what}", marks=() if i == j else pytest.mark.slow)
        for i, name in enumerate(["scan", "interpret", "shard"])
        for j, (what, eps) in enumerate(
            {"0.05": EPS, "2.0": 2.0, "float32(0.02)": jnp.float32(0.02)}.items()
        )
    ],
)
def test_values_and_gradients_as_jax(name, eps):
    chunk, combine = tempered(eps)
    x = points()
    loss = lambda x, run: jnp.sum(jnp.sin(run(x)))
    with engine(name) as kw:
        ours = lambda x: ajm.batch_map(costs, x, 32, reduction=combine, chunk_reduction=chunk, **kw)
        plan = ajm.explain(costs, x, 32, reduction=combine, chunk_reduction=chunk, **kw)
        got, grad = jax.jit(lambda x: (ours(x), jax.grad(loss)(x, ours)))(x)
    assert plan.kind.name == "MONOID", str(plan)
    assert f"{float(eps):g} * logsumexp" in str(plan), str(plan)
    plain = lambda x: chunk(costs(x))
    assert_tree_close(got, plain(x), rtol=1e-5, atol=1e-6)
    assert_tree_close(grad, jax.grad(loss)(x, plain), rtol=1e-4, atol=1e-6)


def test_forward_mode_as_jax():
    chunk, combine = tempered(EPS)
    x, dx = points(), points(203) * 0.1
    ours = lambda x: ajm.batch_map(costs, x, 32, reduction=combine, chunk_reduction=chunk)
    got = jax.jvp(ours, (x,), (dx,))
    assert_tree_close(got, jax.jvp(lambda x: chunk(costs(x)), (x,), (dx,)), rtol=1e-4, atol=1e-6)


def test_other_combines_and_traced_temperatures_run_as_written():
    # a combine that is not eps * logaddexp(a / eps, b / eps), or an eps traced by jit,
    # is no monoid we know: the pair runs generically, giving what it computes
    chunk, _ = tempered(EPS)
    x = points()
    plan = ajm.explain(costs, x, 32, reduction=jnp.logaddexp, chunk_reduction=chunk)
    assert plan.kind.name == "GENERIC" and "not a monoid" in str(plan), str(plan)

    @jax.jit
    def traced(x, eps):
        chunk, combine = tempered(eps)
        plan = ajm.explain(costs, x, 32, reduction=combine, chunk_reduction=chunk)
        assert plan.kind.name == "GENERIC", str(plan)
        return ajm.batch_map(costs, x, 32, reduction=combine, chunk_reduction=chunk)

    assert_tree_close(traced(x, EPS), chunk(costs(x)), rtol=1e-5, atol=1e-6)


def test_a_plain_logsumexp_monoid_does_not_combine_tempered_results():
    chunk, _ = tempered(EPS)
    with pytest.raises(ValueError, match="does not match chunk_reduction"):
        ajm.batch_map(costs, points(), 32, reduction=ajm.LOGSUMEXP, chunk_reduction=chunk)
