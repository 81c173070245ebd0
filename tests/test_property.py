"""Property test: random n, batch_size, monoid and pytree structure equal the oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adv_jax_math as ajm

PAIRS = {
    "map": (None, ajm.identity, lambda v: v),
    "sum": (jnp.add, jnp.sum, jnp.sum),
    "add.reduce": (jnp.add, jnp.add.reduce, lambda v: v.sum(0)),
    "max": (jnp.maximum, jnp.max, jnp.max),
    "min.reduce": (jnp.minimum, jnp.minimum.reduce, lambda v: v.min(0)),
    "logsumexp": (jnp.logaddexp, jax.nn.logsumexp, jax.nn.logsumexp),
}

trailing = st.lists(st.integers(1, 3), max_size=2).map(tuple)
structure = st.recursive(
    trailing.map(lambda t: ("leaf", t)),
    lambda kids: st.one_of(
        st.lists(kids, min_size=1, max_size=3).map(lambda ks: ("tuple", ks)),
        st.dictionaries(st.sampled_from("abc"), kids, min_size=1, max_size=3).map(
            lambda d: ("dict", d)
        ),
    ),
    max_leaves=4,
)


def build(spec, n, rng):
    kind, body = spec
    if kind == "leaf":
        return jnp.asarray(rng.normal(size=(n, *body)), jnp.float32)
    if kind == "tuple":
        return tuple(build(s, n, rng) for s in body)
    return {k: build(s, n, rng) for k, s in body.items()}


def fun(tree):
    return jax.tree.map(lambda v: jnp.tanh(v) * 3 + v**2, tree)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 40),
    batch_size=st.one_of(st.none(), st.integers(1, 45)),
    pair=st.sampled_from(sorted(PAIRS)),
    spec=structure,
    seed=st.integers(0, 2**16),
)
def test_matches_oracle(n, batch_size, pair, spec, seed):
    reduction, chunk_reduction, leaf_oracle = PAIRS[pair]
    x = build(spec, n, np.random.default_rng(seed))
    out = ajm.batch_map(fun, x, batch_size, reduction=reduction, chunk_reduction=chunk_reduction)
    expect = jax.tree.map(leaf_oracle, fun(x))
    assert_tree_close(out, expect, rtol=1e-5, atol=1e-4)
