"""Proving a blockwise ``g(yc, xc)`` pairwise from its jaxpr (``_separable.read_blocks``),
and a monoid's result laid out per x row (``_separable.per_x_row``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close, normal
from jax import lax

import adv_jax_math as ajm
from adv_jax_math.analysis.separable import Blocks, per_x_row, read_blocks
from adv_jax_math.batch.nested import pairs

BJ, BI, D = 5, 3, 3
W = np.linspace(-1.0, 1.0, D * D, dtype=np.float32).reshape(D, D)
TABLE = np.arange(BJ * BI, dtype=np.float32).reshape(BJ, BI)  # position-dependent


def sqdist(yc, xc):
    return jnp.sum((yc[:, None] - xc[None]) ** 2, -1)


def shapes(yc, xc):
    return yc.shape[0], xc.shape[0]


@jax.jit
def gram(yc, xc):
    return yc @ xc.T


@jax.custom_vjp
def doubled(a):
    return 2 * a


doubled.defvjp(lambda a: (2 * a, None), lambda _, g: (2 * g,))


def separable(g, y, x):
    """None when ``read_blocks`` reads ``g``'s blocks as pairs, else why not."""
    found = read_blocks(g, y, x)
    return None if isinstance(found, Blocks) else found


def pairwise(g, yc, xc):
    """``g``'s pairs as the reading evaluates them (``_nested.pairs``), on every pair of
    rows; leaves without x rows broadcast along them, as ``g``'s blocks are read."""
    ty, tx = jax.tree.structure(yc), jax.tree.structure(xc)
    flat = lambda ys, xs: g(jax.tree.unflatten(ty, ys), jax.tree.unflatten(tx, xs))
    f = pairs(read_blocks(g, yc, xc), flat)
    one = lambda yj, xi: f(jax.tree.leaves(xi), jax.tree.leaves(yj))
    return jax.vmap(jax.vmap(one, (None, 0)), (0, None))(yc, xc)


def blocks_as_pairs(g, yc, xc):
    """``g(yc, xc)`` with its leaves that have no x rows broadcast along them."""
    found = read_blocks(g, yc, xc)
    spread = lambda a, p: a if p else jnp.broadcast_to(a[:, None], (a.shape[0], BI, *a.shape[1:]))
    out = jax.tree.leaves(g(yc, xc))
    return jax.tree.unflatten(
        jax.tree.structure(found.shapes),
        [spread(a, p) for a, p in zip(out, found.x_axes, strict=True)],
    )


def points(rows, key):
    return normal(key, (rows, D))


def weighted(rows, key):
    w = np.random.default_rng(key + 1).uniform(size=rows)
    return points(rows, key), jnp.asarray(w, jnp.float32)


ACCEPTED = {
    "sqdist": lambda yc, xc: -sqdist(yc, xc),
    "gaussian": lambda yc, xc: jnp.exp(-((yc[:, None, :] - xc[None, :, :]) ** 2).sum(-1) / 0.5),
    "dot": lambda yc, xc: yc @ xc.T,
    "closed_over": lambda yc, xc: (yc @ W) @ xc.T,
    "einsum": lambda yc, xc: jnp.einsum("jd,id->ji", yc, xc),
    "pytree_out": lambda yc, xc: {
        "a": sqdist(yc, xc),
        "b": (jnp.sin(yc @ xc.T), jnp.broadcast_to(yc[:, None, :2], (*shapes(yc, xc), 2))),
    },
    "relu_where": lambda yc, xc: jnp.where(yc @ xc.T > 0, jax.nn.relu(yc @ xc.T), 0.5),
    "jit_inside": lambda yc, xc: jnp.tanh(gram(yc, xc)),
    "checkpoint": lambda yc, xc: jax.checkpoint(sqdist)(yc, xc),
    "custom_vjp": lambda yc, xc: doubled(sqdist(yc, xc)),
    "norm": lambda yc, xc: jnp.linalg.norm(yc[:, None] - xc[None], axis=-1),
    "no_x": lambda yc, xc: jnp.broadcast_to(yc[:, :1], shapes(yc, xc)),
    "no_y": lambda yc, xc: jnp.broadcast_to(xc[:, 0], shapes(yc, xc)),
    "feature_rest": lambda yc, xc: yc[:, None] * xc[None].sum(-1, keepdims=True),
    "feature_ops": lambda yc, xc: jnp.concatenate(
        [jnp.cumsum(yc[:, None] * xc[None], -1), jnp.sort(yc[:, None] - xc[None], -1)], -1
    ).reshape(*shapes(yc, xc), 2, D),
    "feature_pad_top_k": lambda yc, xc: lax.top_k(
        jnp.pad(yc[:, None] * xc[None, :, ::-1], ((0, 0), (0, 0), (1, 1))), 2
    )[0],
    "constant_loop": lambda yc, xc: sqdist(yc, xc) * lax.fori_loop(0, 3, lambda k, c: c + k, 0.5),
    "batch_dot": lambda yc, xc: jnp.einsum(
        "jid,jid->ji", yc[:, None] - xc[None], yc[:, None] + xc[None]
    ),
    "vmap_inside": lambda yc, xc: jax.vmap(lambda yr: xc @ yr)(yc),
    "stack_unstack": lambda yc, xc: jnp.stack(
        [sqdist(yc, xc), *jnp.unstack(yc[:, None] * xc[None], axis=-1)], -1
    ),
    "iota_features": lambda yc, xc: (yc[:, None] - xc[None]) @ jnp.arange(D, dtype=jnp.float32),
    # leaves the same for every x row: (bj, ...), a softmax's values
    "values_without_x": lambda yc, xc: (-sqdist(yc, xc), yc[:, :2], yc.sum(1)),
    "squeeze_with_axis": lambda yc, xc: jnp.squeeze(sqdist(yc, xc)[..., None], -1),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted_and_pairwise(name):
    g = ACCEPTED[name]
    y = points(BJ, 0)
    x = points(BI, 10)
    assert separable(g, jax.eval_shape(lambda: y), jax.eval_shape(lambda: x)) is None
    assert_tree_close(blocks_as_pairs(g, y, x), pairwise(g, y, x))


def test_accepted_weighted_y():
    """``y`` a pytree ``(points, weights)``; weights ``(bj,)`` scale the kernel."""
    g = lambda yc, xc: yc[1][:, None] * jnp.exp(-sqdist(yc[0], xc))
    y, x = weighted(BJ, 0), points(BI, 10)
    assert separable(g, y, x) is None
    assert_tree_close(g(y, x), pairwise(g, y, x))


def kernel(yc, xc):
    return yc @ xc.T


REFUSED = {
    "mixes_x_rows": (lambda yc, xc: kernel(yc, xc - xc.mean(0)), "reduce_sum reduces over x rows"),
    "cumsum_y_rows": (lambda yc, xc: jnp.cumsum(kernel(yc, xc), 0), "cumsum runs along y rows"),
    "sort_x_rows": (lambda yc, xc: kernel(yc, jnp.sort(xc, 0)), "sort runs along x rows"),
    "x_rows_first": (lambda yc, xc: xc @ yc.T, "has axes ('i', 'j')"),
    "swapped_broadcast": (lambda yc, xc: sqdist(xc, yc), "has axes ('i', 'j')"),
    "position": (
        lambda yc, xc: kernel(yc, xc) + jnp.arange(xc.shape[0])[None, :],
        "add meets x rows with a position-dependent axis",
    ),
    "closed_over_table": (
        lambda yc, xc: kernel(yc, xc) * TABLE,
        "mul meets y rows with a position-dependent axis",
    ),
    "sum_y_rows": (
        lambda yc, xc: jnp.broadcast_to(kernel(yc, xc).sum(0, keepdims=True), shapes(yc, xc)),
        "reduce_sum reduces over y rows",
    ),
    "fori_loop": (
        lambda yc, xc: lax.fori_loop(0, 2, lambda k, a: 2 * a, kernel(yc, xc)),
        "scan reads x rows and y rows",
    ),
    "while_loop": (
        lambda yc, xc: lax.while_loop(lambda a: a.sum() < 9, lambda a: 2 * a, kernel(yc, xc)),
        "while reads x rows and y rows",
    ),
    "reversed_x": (lambda yc, xc: kernel(yc, xc[::-1]), "rev reverses x rows"),
    "gather_x": (lambda yc, xc: kernel(yc, xc[jnp.array([2, 0, 1])]), "gather reads x rows"),
    "rolled_x": (lambda yc, xc: jnp.roll(kernel(yc, xc), 1, axis=1), "slice takes part of x"),
    "tril": (lambda yc, xc: jnp.tril(kernel(yc, xc)), "select_n meets y rows with a position"),
    "vmap_mixes": (
        lambda yc, xc: jax.vmap(lambda yr: (xc - xc.mean(0)) @ yr)(yc),
        "reduce_sum reduces over x rows",
    ),
    "unstack_x": (
        lambda yc, xc: jnp.stack(jnp.unstack(kernel(yc, xc), axis=1)[::-1], 1),
        "takes part of x rows (axis 1)",  # split before jax 0.10
    ),
    "effects": (
        lambda yc, xc: (jax.debug.print("{}", 1), kernel(yc, xc))[1],
        "debug_print has effects",
    ),
    "part_of_x": (lambda yc, xc: kernel(yc, xc[:2]), "slice takes part of x rows"),
    "x_summed_in": (lambda yc, xc: yc[:, None] * xc.sum(0), "reduce_sum reduces over x rows"),
    "contracts_y": (lambda yc, xc: kernel(yc.T @ yc, xc), "dot_general contracts y rows"),
    "reshape_rows": (lambda yc, xc: kernel(yc, xc).reshape(BI, BJ).T, "reshape merges or splits"),
    "y_rows_second": (lambda yc, xc: yc.T, "output 0 of shape (3, 5) has axes (None, 'j')"),
    "x_on_axis_2": (lambda yc, xc: yc[:, None, None, 0] * xc[None, None, :, 0], "has axes"),
    "bad_leaf": (lambda yc, xc: {"a": kernel(yc, xc), "b": kernel(xc, yc)}, "output ['b']"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused(name):
    g, why = REFUSED[name]
    y, x = jax.ShapeDtypeStruct((BJ, D), jnp.float32), jax.ShapeDtypeStruct((BI, D), jnp.float32)
    reason = separable(g, y, x)
    assert reason is not None and why in reason, reason


def test_refused_diagonal():
    """x and y rows on one axis (``bi == bj``): element ``a`` pairs x row ``a`` with y row
    ``a`` only."""
    y = x = jax.ShapeDtypeStruct((4, D), jnp.float32)
    g = lambda yc, xc: jnp.broadcast_to(jnp.sum((yc - xc) ** 2, -1)[:, None], (4, 4))
    assert separable(g, y, x) == "sub puts x rows and y rows on one axis"


def test_refused_rows():
    """Fewer than 2 rows (or leaves with different numbers of rows) prove nothing."""
    one, many = jnp.zeros((1, D)), jnp.zeros((BJ, D))
    assert "x leaves need" in separable(kernel, many, one)
    assert "y leaves need" in separable(lambda yc, xc: kernel(yc[0], xc), (many, one), many)


@pytest.mark.parametrize(
    "g",
    [
        lambda yc, xc: -jnp.sum((yc[:, None] - xc[None]) ** 2, -1) / xc.shape[0],
        lambda yc, xc: jnp.full((yc.shape[0], xc.shape[0]), yc.shape[0] * 1.0),
        lambda yc, xc: yc[:, :1] * xc[:, 0] if xc.shape[0] > 3 else yc[:, :1] + xc[:, 0],
        lambda yc, xc: sqdist(yc, xc) * (2.0 if xc.shape[0] > 1 else 1.0),
    ],
    ids=["divides by bi", "fills with bj", "branches on bi", "branches on one row"],
)
def test_functions_of_the_block_sizes_are_refused(g):
    # the program as written may call them on blocks of other sizes than those traced
    y, x = jax.ShapeDtypeStruct((4, 3), jnp.float32), jax.ShapeDtypeStruct((3, 3), jnp.float32)
    assert "computes with its blocks' sizes" in separable(g, y, x)


@pytest.mark.parametrize(
    "g, why",
    [
        (lambda yc, xc: jnp.squeeze(sqdist(yc, xc)[..., None]), "are [()] on blocks of 1 x 1 rows"),
        (
            lambda yc, xc: jnp.squeeze(sqdist(yc, xc)[..., None])[:, :],
            "fails on blocks of 1 x 1 rows: IndexError",
        ),
    ],
    ids=["squeeze without an axis", "then indexed"],
)
def test_block_functions_that_change_at_one_row_are_refused(g, why):
    y, x = jax.ShapeDtypeStruct((4, 3), jnp.float32), jax.ShapeDtypeStruct((3, 3), jnp.float32)
    assert why in separable(g, y, x)


S = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
LAYOUTS = {  # name: (monoid, its leaves' items, their x axes, laid out per x row)
    "add": (ajm.ADD, [S(4)], [0], True),
    "min_argmin of vectors": (ajm.MIN_ARGMIN, [S(4, 2)], [0], True),
    "mean_var of vectors": (ajm.MEAN_VAR, [S(4, 2)], [0], True),
    "x rows on axis 1": (ajm.LOGSUMEXP, [S(2, 4)], [1], True),
    "top_k, k slots first": (ajm.top_k(3), [S(4)], [0], False),
    "top_k, k == x rows": (ajm.top_k(4), [S(4)], [0], False),
    "softmax, values without x": (ajm.SOFTMAX_WEIGHTED, [S(4), S(2)], [0, None], True),
    "softmax, values with x": (ajm.SOFTMAX_WEIGHTED, [S(4), S(4, 2)], [0, 0], False),
    "softmax, values (x, 4)": (ajm.SOFTMAX_WEIGHTED, [S(4), S(4, 4)], [0, 0], False),
    "weights on a feature axis": (ajm.WEIGHTED_LOGSUMEXP, [S(4), S(4)], [0, None], False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_per_x_row(name):
    monoid, items, x_axes, laid_out = LAYOUTS[name]
    why = per_x_row(monoid, items, x_axes)
    assert (why is None) == laid_out, why
