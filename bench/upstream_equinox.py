"""Stand-in for ``equinox`` in the original's test file (``bench/upstream_tests.py``).

That file only calls ``eqx.tree_equal(actual, expected, rtol=..., atol=...)``; this is
equinox's rule, without installing equinox: the same tree structure, then for each
pair of leaves, arrays (numpy or jax) of equal shape and dtype whose values are equal
(``allclose`` for inexact dtypes when a tolerance is given), other leaves ``==``.
"""

from __future__ import annotations

import jax
import numpy as np


def _is_array(x) -> bool:
    return isinstance(x, np.ndarray | np.generic | jax.Array)


def _leaf_equal(x, y, typematch: bool, rtol: float, atol: float) -> bool:
    if typematch and type(x) is not type(y):
        return False
    if not (_is_array(x) and _is_array(y)):
        return not (_is_array(x) or _is_array(y)) and bool(x == y)
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if (rtol == 0 and atol == 0) or not np.issubdtype(x.dtype, np.inexact):
        return bool(np.all(x == y))
    return bool(np.allclose(x, y, rtol=rtol, atol=atol))


def tree_equal(*pytrees, typematch: bool = False, rtol: float = 0.0, atol: float = 0.0) -> bool:
    """Whether all ``pytrees`` have the same structure and equal leaves (see above)."""
    leaves, treedef = jax.tree.flatten(pytrees[0])
    for other in pytrees[1:]:
        other_leaves, other_treedef = jax.tree.flatten(other)
        if other_treedef != treedef:
            return False
        if not all(
            _leaf_equal(x, y, typematch, rtol, atol)
            for x, y in zip(leaves, other_leaves, strict=True)
        ):
            return False
    return True
