"""Every decision of the DESIGN.md §1 table, each with a test."""

import operator
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close

import adv_jax_math as ajm

SUM = dict(reduction=jnp.add, chunk_reduction=jnp.sum)


def test_chunk_size_alias_used_when_batch_size_is_none():
    x = jnp.arange(10.0)
    plan = ajm.explain(jnp.sin, x, chunk_size=3)
    assert plan.batch_size == 3 and plan.chunks * plan.rows_per_chunk + plan.remainder == 10
    assert_tree_close(ajm.batch_map(jnp.sin, x, chunk_size=3), jnp.sin(x))


def test_batch_size_wins_over_chunk_size():
    plan = ajm.explain(lambda x: jnp.sort(x, -1), jnp.ones((10, 3)), 5, chunk_size=3)
    assert plan.batch_size == 5 and plan.chunks == 2


def test_row_local_maps_run_whole():
    # one fusion with nothing larger than the inputs and outputs: chunks would bound nothing
    calls = []
    fun = lambda x: calls.append(x.shape) or jnp.sin(x) * jnp.exp(-x) + 1.0
    x = jnp.linspace(0.0, 3.0, 1003).reshape(-1, 1) * jnp.ones(4)
    plan = ajm.explain(fun, x, 64)
    assert (plan.policy, plan.chunks, plan.rows_per_chunk) == (ajm.Policy.SINGLE, 1, 1003)
    assert "its jaxpr runs on all 1003 rows at once" in plan.notes[0]
    calls.clear()
    got = jax.jit(lambda x: ajm.batch_map(fun, x, 64))(x)
    assert calls == [(64, 4)], calls  # traced once, on a chunk; its jaxpr run on all rows
    assert_tree_close(got, fun(x))
    grad = jax.grad(lambda x: ajm.batch_map(fun, x, 64).sum())(x)
    assert_tree_close(grad, jax.grad(lambda x: fun(x).sum())(x))
    text = str(jax.make_jaxpr(lambda x: ajm.batch_map(fun, x, 64))(x))
    assert "while" not in text and "scan" not in text
    # its reverse mode keeps nothing per row (XLA recomputes elementwise values): whole too
    assert plan.backward.startswith("whole too") and plan.derivatives is None, plan.backward
    # a feature reduction is row-local too: norms per row, run whole (reverse mode keeps
    # a few numbers per row, less than a row's input and output: whole too)
    norms = lambda c: c / jnp.linalg.norm(c, axis=-1, keepdims=True)
    plan = ajm.explain(norms, x, 64)
    assert plan.chunks == 1 and plan.derivatives is None
    # (12 B per row with jax <= 0.12.0, 8 B with 0.12.1: fewer residuals saved)
    kept = re.search(
        r"whole too: reverse mode keeps (\d+) B of fun's intermediates per row", plan.backward
    )
    assert kept is not None and int(kept[1]) <= 12, plan.backward
    assert_tree_close(ajm.batch_map(norms, x, 64), norms(x))
    # each row times a matrix of constants is row-local (a sort of the products is not)
    w = jnp.cos(jnp.arange(4 * 6.0).reshape(4, 6))
    layer = lambda c: jnp.tanh(c @ w)
    assert ajm.explain(layer, x, 64).chunks == 1
    assert_tree_close(ajm.batch_map(layer, x, 64), layer(x))
    assert ajm.explain(lambda c: jnp.sort(c @ w, axis=-1), x, 64).chunks > 1
    # a softmax: reverse mode run whole would keep its exponentials for all rows, more
    # than the rows' inputs and outputs: the derivatives run in the chunks
    exp = lambda c: jnp.exp(c * 3.0 - jnp.max(c * 3.0, axis=-1, keepdims=True))
    softmax = lambda c: exp(c) / exp(c).sum(-1, keepdims=True)  # (jax.nn's: a custom rule)
    plan = ajm.explain(softmax, x, 64)
    if jax.__version_info__ < (0, 10, 0):  # derivatives in chunks need jax >= 0.10: no whole
        assert plan.policy != ajm.Policy.SINGLE and plan.derivatives is None, str(plan)
    else:
        assert (plan.policy, plan.derivatives.rows_per_chunk) == (ajm.Policy.SINGLE, 64), plan
        assert plan.backward.startswith("in 16 chunks of 64 rows"), plan.backward
        assert "would keep" in plan.backward
        text = str(jax.make_jaxpr(lambda x: ajm.batch_map(softmax, x, 64))(x))
        assert "while" not in text and "scan" not in text  # the forward pass runs whole
    grad = jax.grad(lambda x: jnp.sum(ajm.batch_map(softmax, x, 64) ** 3))(x)
    assert_tree_close(grad, jax.grad(lambda x: jnp.sum(softmax(x) ** 3))(x))
    # kept in chunks: a custom derivative rule, an array of the chunk's shape, values
    # larger per row than the inputs and outputs, a reduction over the rows
    w = jnp.arange(256.0).reshape(64, 4)
    outer = lambda c: (c[:, :, None] * c[:, None, :]).sum(-1)
    for kept in (jax.nn.relu, lambda c: c * w, outer, lambda c: c - c.sum(0)):
        plan = ajm.explain(kept, x, 64)
        assert plan.chunks == 16 and plan.rows_per_chunk == 64, str(plan)
    assert_tree_close(ajm.batch_map(jax.nn.relu, x - 1, 64), jax.nn.relu(x - 1))


@pytest.mark.parametrize(
    "fun",
    [
        lambda c: jnp.full_like(c, c.shape[0]),  # no output read from the rows
        lambda c: (2 * c, jnp.ones_like(c)),  # one of two
        lambda c: c + jnp.arange(c.shape[0]),  # the row's place in its chunk
    ],
)
def test_maps_that_depend_on_the_chunk_keep_their_chunks(fun):
    # the original's semantics: fun sees each chunk (here of 2 rows), never all rows
    x = jnp.arange(6.0)
    want = jax.tree.map(lambda *c: jnp.concatenate(c), *(fun(x[i : i + 2]) for i in (0, 2, 4)))
    assert ajm.explain(fun, x, 2).chunks == 3
    assert_tree_close(ajm.batch_map(fun, x, 2), want)


def test_unexpected_kwargs_are_all_named():
    with pytest.raises(ValueError, match="'bogus'.*'other'"):
        ajm.batch_map(jnp.sin, jnp.ones(3), 2, bogus=1, other=2)
    with pytest.raises(ValueError, match="'oops'"):
        ajm.batch_vmap(jnp.sin, batch_size=2, oops=True)


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (True, TypeError, "batch_size=True"),
        (2.0, TypeError, "batch_size=2.0"),
        ("3", TypeError, "batch_size='3'"),
        (0, ValueError, "batch_size=0"),
        (-3, ValueError, "batch_size=-3"),
    ],
)
def test_invalid_batch_size(bad, exc, match):
    with pytest.raises(exc, match=match):
        ajm.batch_map(jnp.sin, jnp.ones(4), bad)
    with pytest.raises(exc, match=match.replace("batch_size", "chunk_size")):
        ajm.batch_map(jnp.sin, jnp.ones(4), chunk_size=bad)
    with pytest.raises(exc):
        ajm.batch_vmap(jnp.sin, batch_size=bad)


def test_numpy_integer_batch_size_is_accepted():
    out = ajm.batch_map(jnp.sin, jnp.arange(5.0), np.int64(2))
    assert_tree_close(out, jnp.sin(jnp.arange(5.0)))


@pytest.mark.parametrize("batch_size", [None, 10, 12, 100])
def test_batch_size_at_least_n_is_one_call(batch_size):
    calls = []
    f = lambda x: calls.append(x.shape) or x * 2
    out = ajm.batch_map(f, jnp.arange(10.0), batch_size)
    assert calls == [(10,)]
    assert_tree_close(out, jnp.arange(10.0) * 2)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 4, 6, 12, 13])
@pytest.mark.parametrize("reduction", [None, "sum", "generic"])
def test_mismatched_leading_sizes_raise_for_every_batch_size(batch_size, reduction):
    # 12 and 6 rows: batch sizes 1, 2, 3 and 6 divide both; the original silently
    # dropped rows for those.
    kw = {None: {}, "sum": SUM, "generic": dict(reduction=jnp.multiply)}[reduction]
    xs = {"a": jnp.ones(12), "b": jnp.ones(6)}
    with pytest.raises(ValueError, match=r"different leading sizes.*\['a'\]: 12.*\['b'\]: 6"):
        ajm.batch_map(lambda d: d["a"], xs, batch_size, **kw)
    with pytest.raises(ValueError, match="different leading sizes"):
        ajm.batch_vmap(lambda a, b: a * b, batch_size=batch_size)(jnp.ones(12), jnp.ones(6))


def test_zero_dim_leaf_raises():
    with pytest.raises(ValueError, match=r"\['s'\] is 0-d"):
        ajm.batch_map(lambda d: d["x"] * d["s"], {"x": jnp.ones(4), "s": jnp.float32(2)}, 2)
    with pytest.raises(ValueError, match="out of range"):
        ajm.batch_vmap(lambda x: x, batch_size=2)(jnp.float32(1))


@pytest.mark.parametrize("batch_size", [None, 1, 3])
def test_zero_dim_leaf_allowed_when_not_mapped(batch_size):
    if batch_size is None:
        assert ajm.batch_map(lambda s: s * 2, jnp.float32(2)) == 4
    f = ajm.batch_vmap(lambda x, s: x * s, in_axes=(0, None), batch_size=batch_size)
    assert_tree_close(f(jnp.arange(4.0), jnp.float32(3)), jnp.arange(4.0) * 3)


class TestEmptyInput:
    def test_map_gives_empty_outputs(self):
        out = ajm.batch_map(lambda x: {"y": x[:, None] * jnp.ones(3)}, jnp.ones((0,)), 4)
        assert out["y"].shape == (0, 3) and out["y"].dtype == jnp.float32

    @pytest.mark.parametrize(
        "reduction, chunk_reduction, expected",
        [
            (jnp.add, jnp.sum, 0.0),
            (jnp.maximum, jnp.max, -np.inf),
            (jnp.minimum, jnp.min, np.inf),
            (jnp.logaddexp, jax.nn.logsumexp, -np.inf),
        ],
    )
    def test_monoid_gives_identity(self, reduction, chunk_reduction, expected):
        out = ajm.batch_map(
            jnp.exp, jnp.ones((0, 2)), 4, reduction=reduction, chunk_reduction=chunk_reduction
        )
        assert out.shape == () and out == expected

    def test_axis0_monoid_identity_keeps_trailing_shape(self):
        out = ajm.batch_map(
            jnp.exp, jnp.ones((0, 2)), 4, reduction=jnp.add, chunk_reduction=jnp.add.reduce
        )
        assert_tree_close(out, jnp.zeros(2))

    def test_int_max_identity_is_dtype_min(self):
        out = ajm.batch_map(
            lambda x: x, jnp.ones(0, jnp.int32), 2, reduction=jnp.maximum, chunk_reduction=jnp.max
        )
        assert out == jnp.iinfo(jnp.int32).min and out.dtype == jnp.int32

    def test_generic_reduction_calls_chunk_reduction_on_empty(self):
        out = ajm.batch_map(
            jnp.exp, jnp.ones(0), 4, reduction=jnp.multiply, chunk_reduction=jnp.prod
        )
        assert out == 1.0


def test_strip_dim0_with_batch_size_other_than_one_warns_and_is_ignored():
    x = jnp.arange(6.0).reshape(3, 2)
    with pytest.warns(UserWarning, match="strip_dim0=True only works with batch_size=1"):
        out = ajm.batch_map(lambda x: x.sum(1), x, 2, strip_dim0=True)
    assert_tree_close(out, x.sum(1))


@pytest.mark.parametrize(
    "call",
    [
        lambda x, m: ajm.batch_map(jnp.sin, x, 2, mesh=m),
        lambda x, m: ajm.batch_map(jnp.sin, x, 2, reduction=ajm.ADD, mesh=m),
        lambda x, m: ajm.batch_vmap(jnp.sin, batch_size=2, mesh=m)(x),
        lambda x, m: ajm.explain(jnp.sin, x, 2, mesh=m),
        lambda x, m: ajm.batch_map(lambda r: r * 2, x, 3, strip_dim0=True),
    ],
    ids=["map", "monoid", "vmap", "explain", "strip_dim0"],
)
def test_ignored_arguments_warn_at_the_callers_line(call):
    """A mesh without shard=True, strip_dim0 without batch_size=1: one warning, pointing
    at the user's line (this file), not inside the package."""
    x = jnp.arange(6.0).reshape(3, 2)
    mesh = jax.make_mesh((1,), ("x",))
    with pytest.warns(UserWarning, match="is ignored") as record:
        call(x, mesh)
    assert [w.filename for w in record] == [__file__], [(w.filename, w.lineno) for w in record]


def test_strip_dim0_passes_rows_without_leading_axis():
    x = jnp.arange(12.0).reshape(4, 3)
    seen = []
    out = ajm.batch_map(lambda r: seen.append(r.shape) or r @ r, x, 1, strip_dim0=True)
    assert seen == [(3,)]
    assert_tree_close(out, jnp.einsum("ij,ij->i", x, x))
    red = ajm.batch_map(lambda r: r * 2, x, 1, strip_dim0=True, reduction=jnp.add)
    assert_tree_close(red, (x * 2).sum(0))


def test_strip_dim0_nesting():
    x = jnp.arange(24.0).reshape(4, 6)
    inner = lambda row: ajm.batch_map(jnp.sin, row, 4, **SUM)
    out = ajm.batch_map(inner, x, 1, strip_dim0=True)
    assert_tree_close(out, jnp.sin(x).sum(1))


def test_fun_output_rows_must_match_chunk_rows_without_reduction():
    with pytest.raises(ValueError, match=r"has shape \(\) for a chunk of 4 rows"):
        ajm.batch_map(lambda x: x.sum(), jnp.ones(8), 4)
    with pytest.raises(ValueError, match="one row per input row"):
        ajm.batch_map(lambda x: x.sum(), jnp.ones(10), 4)
    with pytest.raises(ValueError, match="one row per input row"):
        ajm.batch_map(lambda x: x, jnp.ones(10), 4, chunk_reduction=lambda y: y[:1])


def test_reduction_seeded_from_first_chunk_not_zeros():
    x = -jnp.arange(1.0, 11.0)  # all negative
    out = ajm.batch_map(
        lambda x: x, x, 4, reduction=jnp.maximum, chunk_reduction=lambda y: jnp.max(y)
    )  # generic: lambda
    assert out == -1.0
    prod = ajm.batch_map(lambda x: x, x[:7], 3, reduction=operator.mul, chunk_reduction=jnp.prod)
    assert_tree_close(prod, jnp.prod(x[:7]))


def test_bad_callables():
    with pytest.raises(TypeError, match="fun must be callable"):
        ajm.batch_map(3, jnp.ones(2), 1)
    with pytest.raises(TypeError, match="reduction must be"):
        ajm.batch_map(jnp.sin, jnp.ones(2), 1, reduction="add")
    with pytest.raises(TypeError, match="chunk_reduction must be"):
        ajm.batch_map(jnp.sin, jnp.ones(2), 1, chunk_reduction=None)


def test_mismatched_monoid_objects_raise():
    with pytest.raises(ValueError, match="does not match chunk_reduction"):
        ajm.batch_map(jnp.sin, jnp.ones(4), 2, reduction=ajm.LOGSUMEXP, chunk_reduction=jnp.sum)


class TestBatchVmapInAxes:
    def test_int_applies_to_every_positional_argument(self):
        a, b = jnp.arange(6.0).reshape(3, 2), jnp.arange(6.0).reshape(3, 2) + 1
        f = lambda a, b: a @ b
        assert_tree_close(ajm.batch_vmap(f, 0, batch_size=2)(a, b), jax.vmap(f, 0)(a, b))
        assert_tree_close(ajm.batch_vmap(f, 1, batch_size=1)(a, b), jax.vmap(f, 1)(a, b))

    @pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
    def test_any_integer_axis(self, axis):
        x = jnp.arange(60.0).reshape(3, 4, 5)
        f = lambda m: jnp.sum(m**2)
        expect = jax.vmap(f, axis)(x)
        assert_tree_close(ajm.batch_vmap(f, axis, batch_size=2)(x), expect)

    def test_pytree_in_axes_and_none_broadcast(self):
        args = ({"w": jnp.arange(3.0), "b": jnp.arange(4.0)}, jnp.arange(12.0).reshape(3, 4))
        in_axes = ({"w": None, "b": 0}, 1)
        f = lambda p, x: p["w"] @ x + p["b"]
        out = ajm.batch_vmap(f, in_axes, batch_size=3)(*args)
        assert_tree_close(out, jax.vmap(f, in_axes)(*args))

    def test_list_in_axes_like_tuple(self):
        f = lambda a, s: a * s
        out = ajm.batch_vmap(f, [0, None], batch_size=2)(jnp.arange(5.0), 2.0)
        assert_tree_close(out, jnp.arange(5.0) * 2)

    def test_kwargs_are_mapped_over_axis_0(self):
        f = lambda a, *, b: a * b
        out = ajm.batch_vmap(f, batch_size=2)(jnp.arange(5.0), b=jnp.arange(5.0))
        assert_tree_close(out, jax.vmap(f)(jnp.arange(5.0), b=jnp.arange(5.0)))

    @pytest.mark.parametrize(
        "in_axes, match",
        [
            ((0,), "has 1 entries but the function was called with 2"),
            ((None, None), "at least one mapped argument"),
            ((0, 1.5), "must be int or None"),
            ((0, 3), "out of range"),
        ],
    )
    def test_errors(self, in_axes, match):
        with pytest.raises((ValueError, TypeError), match=match):
            ajm.batch_vmap(lambda a, b: a + b, in_axes, batch_size=2)(jnp.ones(3), jnp.ones(3))

    def test_prefix_mismatch(self):
        with pytest.raises(ValueError, match="not a prefix"):
            ajm.batch_vmap(lambda p: p["a"], ({"a": 0, "b": 0},), batch_size=2)({"a": jnp.ones(2)})

    def test_per_example_gradients_seed_example(self):
        # The seed tutorial's example: w (3,), xs (4, 3).
        def loss(w, x):
            return jnp.sum(jnp.tanh(x @ w) ** 2)

        w = jnp.array([0.1, -0.2, 0.3])
        xs = jnp.arange(12.0).reshape(4, 3) / 7
        expect = jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, xs)
        for bs in (None, 1, 3, 4, 5):
            out = ajm.batch_vmap(jax.grad(loss), in_axes=(None, 0), batch_size=bs)(w, xs)
            assert_tree_close(out, expect)


@pytest.mark.parametrize(
    "n, batch_size, rows, masked",
    [
        (1000, 64, 64, 24),  # repeats <= n / 16: chunks of batch_size
        (30001, 1024, 1024, 719),
        (100, 32, 25, 0),  # 28 repeats would be > n / 16: balanced chunks, < k repeats
        (33, 32, 17, 1),
        (64, 16, 16, 0),
    ],
)
def test_overlap_chunking(n, batch_size, rows, masked):
    plan = ajm.explain(jnp.sin, jnp.ones(n), batch_size, reduction=jnp.add, chunk_reduction=jnp.sum)
    assert (plan.policy, plan.rows_per_chunk, plan.masked) == (ajm.Policy.OVERLAP, rows, masked)
    assert (
        plan.chunks * plan.rows_per_chunk - plan.masked == n and plan.rows_per_chunk <= batch_size
    )


@pytest.mark.parametrize(
    "mode, n, batch_size, policy",
    [
        ("auto", 10, 3, ajm.Policy.REMAINDER),  # overlap would repeat 2 of 10 rows (> 1/8)
        ("auto", 1000, 64, ajm.Policy.OVERLAP),  # 8 of 1000
        ("overlap", 10, 3, ajm.Policy.OVERLAP),
        ("separate", 1000, 64, ajm.Policy.REMAINDER),
    ],
)
def test_remainder_policy(mode, n, batch_size, policy):
    kw = dict(reduction=jnp.add, chunk_reduction=jnp.sum)
    x = jnp.arange(float(n))
    with ajm.config(remainder=mode):
        plan = ajm.explain(jnp.sin, x, batch_size, **kw)
        out = ajm.batch_map(jnp.sin, x, batch_size, **kw)
    assert plan.policy is policy and any(
        note.startswith(f"remainder={mode!r}") for note in plan.notes
    )
    assert_tree_close(out, jnp.sum(jnp.sin(x)))
