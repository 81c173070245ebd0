"""Shared fixtures: float64 on demand and tolerances per dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture
def x64():
    """Run the test with float64 enabled (restored afterwards)."""
    with jax.enable_x64(True):
        yield


TOL = {
    np.dtype(jnp.float32): dict(rtol=2e-5, atol=2e-5),
    np.dtype(jnp.float64): dict(rtol=1e-12, atol=1e-12),
    np.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-2),
    np.dtype(jnp.int32): dict(rtol=0, atol=0),
}


def assert_tree_close(actual, expected, **tol):
    """Leafwise comparison with structure, shape and dtype checks."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = jnp.asarray(a), jnp.asarray(e)
        assert a.shape == e.shape, (a.shape, e.shape)
        assert a.dtype == e.dtype, (a.dtype, e.dtype)
        kw = tol or TOL.get(np.dtype(e.dtype), dict(rtol=1e-5, atol=1e-5))
        np.testing.assert_allclose(
            np.asarray(a, dtype=np.float64), np.asarray(e, dtype=np.float64), **kw
        )
