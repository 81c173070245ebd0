"""Pairwise reductions written as nested per-chunk ``batch_map`` calls take the pairwise
engine when the jaxpr shows the blocks are pairs.

``batch_map(lambda xc: batch_map(lambda yc: g(yc, xc), y, bj, reduction=M), x, bi)``
with ``g`` returning ``(bj, bi, ...)`` blocks is read as ``pairwise`` of ``g`` on blocks
of one row each, once ``_separable`` shows that block element ``[b, a]`` depends on y
row ``b`` and x row ``a`` alone: values and gradients against the dense plain-JAX
oracle on every CPU engine; the forms that are not pairwise (rows mixed, the result
post-processed, ``y`` computed from the chunk, a ``batch_vmap`` inside) computed as
written, with the reason in ``explain``.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close
from jax import lax
from test_pairwise import CASES, ENGINES, TILES, _flat, dense, inputs, sqdist

import adv_jax_math as ajm

# (a top-k is not: its result puts the k slots first, where the outer call stacks)
NAMES = ["logsumexp", "min_argmin", "argmin", "weighted_logsumexp", "var", "pytree"]
NAMES += ["softmax_weighted"]


def blocks(f):
    """``f`` written for one pair, as a user writes it for blocks: ``(bj, bi, ...)``."""
    return lambda yc, xc: jax.vmap(lambda yj: jax.vmap(lambda xi: f(xi, yj))(xc))(yc)


def softmax_blocks(yc, xc):
    """``CASES["softmax_weighted"]`` written for blocks: scores ``(bj, bi)``, values
    ``(bj, 2)``, the same for every x row (with ``(bj, bi, 2)`` each x row's scores would
    weigh every x row's values)."""
    return -sqdist_blocks(yc, xc), jnp.stack([yc[:, 0], jnp.sin(yc[:, 1])], -1)


BLOCKS = {"softmax_weighted": softmax_blocks}


def per_chunk(g, reduction, y, tiles=TILES):
    bi, bj = tiles
    outer = lambda xc: ajm.batch_map(lambda yc: g(yc, xc), y, bj, reduction=reduction)
    return outer, bi


@pytest.mark.parametrize("backend", list(ENGINES))
@pytest.mark.parametrize("name", NAMES)
def test_per_chunk_calls_take_the_pairwise_engine(name, backend):
    reduction, f, want = CASES[name]
    x, y = inputs()
    outer, bi = per_chunk(BLOCKS.get(name, blocks(f)), reduction, y)
    with ajm.config(backend=backend):
        plan = ajm.explain(outer, x, bi)
        got = jax.jit(lambda x: ajm.batch_map(outer, x, bi))(x)
    assert isinstance(plan, ajm.PairwisePlan), str(plan)
    assert plan.engine == ENGINES[backend] and plan.tiles == TILES, str(plan)
    assert "read from nested batch_map calls" in plan.reason, str(plan)
    assert_tree_close(got, want(dense(f, x, y)), rtol=2e-5, atol=2e-5)


def test_the_issues_form_with_broadcasting():
    # written with broadcasting, not vmap: (bj, 1, D) - (1, bi, D) summed over D
    x, y = inputs()
    g = lambda yc, xc: -jnp.sum((yc[:, None] - xc[None]) ** 2, -1)
    outer, bi = per_chunk(g, ajm.LOGSUMEXP, y)
    plan = ajm.explain(outer, x, bi)
    assert plan.engine == ENGINES["auto"], str(plan)
    want = jax.nn.logsumexp(dense(lambda a, b: -sqdist(a, b), x, y), 1)
    assert_tree_close(ajm.batch_map(outer, x, bi), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", list(ENGINES))
def test_per_chunk_gradients_match_dense_oracle(backend):
    # w.r.t. x, y and a closed-over scale
    reduction, f, want = CASES["logsumexp"]
    x, y = inputs()
    scaled = lambda s: lambda a, b: f(a, b) * s
    loss = lambda run: lambda s, x, y: jnp.sum(jnp.sin(run(scaled(s), x, y)))

    def ours(g, x, y):
        outer, bi = per_chunk(blocks(g), reduction, y)
        return ajm.batch_map(outer, x, bi)

    with ajm.config(backend=backend):
        got = jax.grad(loss(ours), argnums=(0, 1, 2))(0.7, x, y)
    expect = jax.grad(loss(lambda g, x, y: want(dense(g, x, y))), argnums=(0, 1, 2))(0.7, x, y)
    assert_tree_close(got, expect, rtol=2e-4, atol=2e-4)


def _mixes_x_rows(y):
    g = lambda yc, xc: -sqdist_blocks(yc, xc - xc.mean(0))
    return lambda xc: ajm.batch_map(lambda yc: g(yc, xc), y, 16, reduction=ajm.LOGSUMEXP)


def _post_processed(y):
    g = lambda yc, xc: -sqdist_blocks(yc, xc)
    return lambda xc: 2 * ajm.batch_map(lambda yc: g(yc, xc), y, 16, reduction=ajm.LOGSUMEXP)


def _y_from_the_chunk(y):
    g = lambda yc, xc: -sqdist_blocks(yc, xc)
    return lambda xc: ajm.batch_map(lambda yc: g(yc, xc), y + xc[0], 16, reduction=ajm.LOGSUMEXP)


def _batch_vmap_inside(y):
    inner = lambda xc: ajm.batch_vmap(
        lambda yj: -jnp.sum((xc - yj) ** 2, -1), batch_size=16, reduction=ajm.LOGSUMEXP
    )(y)
    return inner


def sqdist_blocks(yc, xc):
    return jnp.sum((yc[:, None] - xc[None]) ** 2, -1)


OTHERS = {
    "mixes x rows": (_mixes_x_rows, "not shown to be pairs"),
    "post-processed": (_post_processed, "does not return the inner call's result as is"),
    "y from the chunk": (_y_from_the_chunk, "computed in the outer function"),
    "batch_vmap inside": (_batch_vmap_inside, "the inner call is a batch_vmap"),
}


@pytest.mark.parametrize("name", list(OTHERS))
def test_other_forms_run_as_written_and_say_why(name):
    make, why = OTHERS[name]
    x, y = inputs()
    x = x[:32]  # whole chunks of 8 (a function mixing rows sees exactly these)
    outer = make(y)
    plan = ajm.explain(outer, x, 8)
    assert not isinstance(plan, ajm.PairwisePlan), str(plan)
    assert any(why in note for note in plan.notes), str(plan)
    want = jnp.concatenate([outer(x[i : i + 8]) for i in range(0, x.shape[0], 8)])
    assert_tree_close(ajm.batch_map(outer, x, 8), want, rtol=2e-5, atol=2e-5)


def test_plain_stacking_calls_are_unchanged():
    x = jnp.arange(12.0).reshape(6, 2)
    plan = ajm.explain(lambda c: c**2, x, 4)
    assert not any("pairwise" in note for note in plan.notes), str(plan)
    assert_tree_close(ajm.batch_map(lambda c: c**2, x, 4), x**2)


@pytest.mark.parametrize("name", ["logsumexp", "softmax_weighted"])
def test_per_chunk_value_and_grad_is_kernels_only(name):
    # the kernels of the batch_vmap form (test_nested), and no chunk loop outside them
    reduction, f, _ = CASES[name]
    x, y = inputs()
    outer, bi = per_chunk(BLOCKS.get(name, blocks(f)), reduction, y)
    inner = lambda xi: ajm.batch_vmap(lambda yj: f(xi, yj), batch_size=16, reduction=reduction)(y)
    forms = {
        "batch_map": lambda x: ajm.batch_map(outer, x, bi),
        "batch_vmap": lambda x: ajm.batch_vmap(inner, batch_size=bi)(x),
    }
    kernels = {}
    for form, run in forms.items():
        loss = lambda x, run=run: jnp.sum(run(x))
        with ajm.config(backend="interpret"):
            for mode, traced in (("forward", loss), ("both", jax.value_and_grad(loss))):
                outside = [e.primitive.name for e in _flat(jax.make_jaxpr(traced)(x).jaxpr)]
                assert not {"scan", "while"} & set(outside), (form, mode, outside)
                kernels[form, mode] = outside.count("pallas_call")
    assert kernels["batch_map", "forward"] == kernels["batch_vmap", "forward"] == 1, kernels
    assert kernels["batch_map", "both"] == kernels["batch_vmap", "both"], kernels


def _kernel1(yc, xc):
    return jnp.exp(-jnp.sum((yc[:, None] - xc[None]) ** 2, -1, keepdims=True))  # (bj, bi, 1)


def _per_pair_values(yc, xc):  # scores (bj, bi), values (bj, bi, 2): one value per pair
    v = jnp.broadcast_to(yc[:, None, :2], (yc.shape[0], xc.shape[0], 2)) * xc[None, :, :1]
    return -sqdist_blocks(yc, xc), v


def _vectors(yc, xc):  # a vector per pair: (bj, bi, 2)
    return jnp.stack([sqdist_blocks(yc, xc), jnp.abs(yc[:, None] - xc[None]).sum(-1)], -1)


def _top_k(k):
    """``top_k(k, smallest=True)`` over axis 0 with plain JAX: the k slots first."""

    def reduce(d):
        v, i = lax.top_k(-d.T, k)
        return -v.T, i.T

    return reduce


AS_WRITTEN = {  # name: (reduction, g, x rows (chunks of 8), plain-JAX reduction over y rows
    # (None: a sum, of g on y chunks of 16), read as pairwise)
    "top_k, k == bi": (ajm.top_k(8, smallest=True), sqdist_blocks, 16, _top_k(8), False),
    "top_k, k < bi": (ajm.top_k(4, smallest=True), sqdist_blocks, 8, _top_k(4), False),
    "softmax, values per pair": (
        ajm.SOFTMAX_WEIGHTED,
        _per_pair_values,
        16,
        lambda sv: jnp.tensordot(jax.nn.softmax(sv[0], 0), sv[1], ([0], [0])),
        False,
    ),
    "min_argmin of vectors": (
        ajm.MIN_ARGMIN,
        _vectors,
        16,
        lambda d: (d.min(0), d.argmin(0)),
        True,
    ),
    "mean_var of vectors": (ajm.MEAN_VAR, _vectors, 16, lambda d: (d.mean(0), d.var(0)), True),
    "squeeze without an axis": (
        ajm.ADD,
        lambda yc, xc: jnp.squeeze(_kernel1(yc, xc)),
        24,
        None,
        False,
    ),
    # the program as written calls it on 16 y rows (read there), not on all 53
    "branch above the batch size": (
        ajm.ADD,
        lambda yc, xc: _kernel1(yc, xc)[..., 0] * (2.0 if yc.shape[0] > 20 else 1.0),
        24,
        None,
        True,
    ),
    "branch on the block size": (
        ajm.ADD,
        lambda yc, xc: _kernel1(yc, xc)[..., 0] * (2.0 if xc.shape[0] > 1 else 1.0),
        24,
        None,
        False,
    ),
}


@pytest.mark.parametrize("name", list(AS_WRITTEN))
def test_readings_compute_the_program_as_written(name):
    # the outer call stacks each x chunk's inner result: a reading that replaces the
    # blocks by pairs must give exactly that (values, layout, shapes), or decline
    reduction, g, n, reduce, read = AS_WRITTEN[name]
    x, y = inputs()
    x = x[:n]
    outer = lambda xc: ajm.batch_map(lambda yc: g(yc, xc), y, 16, reduction=reduction)
    plan = ajm.explain(outer, x, 8)
    if read:
        assert isinstance(plan, ajm.PairwisePlan), str(plan)
    else:
        assert not isinstance(plan, ajm.PairwisePlan), str(plan)
        assert any("not a pairwise reduction" in note for note in plan.notes), str(plan)
    if reduce is None:  # a sum over y chunks of 16 rows, g on each (it computes with sizes)
        reduce = lambda xc: sum(g(y[j : j + 16], xc).sum(0) for j in range(0, y.shape[0], 16))
    else:
        reduce = lambda xc, r=reduce: r(g(y, xc))
    chunks = [reduce(x[i : i + 8]) for i in range(0, n, 8)]
    want = jax.tree.map(lambda *c: jnp.concatenate(c), *chunks)
    assert_tree_close(ajm.batch_map(outer, x, 8), want, rtol=2e-5, atol=2e-5)
