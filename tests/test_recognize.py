"""Recognizing monoid reductions by what they compute (``_recognize.recognize``)."""

import functools
import itertools
import operator

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import pytest
from helpers import assert_tree_close
from jax import lax

from adv_jax_math import ADD, LOGSUMEXP, MAX, MIN, identity
from adv_jax_math.analysis.jaxpr_graph import elementwise
from adv_jax_math.analysis.recognize import Recognition, recognize

F32, I32, BF16 = jnp.float32, jnp.int32, jnp.bfloat16
ROWS, OTHER_ROWS = 6, 3
W = np.linspace(-1.0, 1.0, 4, dtype=np.float32)


def S(*shape, dtype=F32):
    """A chunk of fun's output: ROWS rows of ``shape``."""
    return jax.ShapeDtypeStruct((ROWS, *shape), dtype)


def sum0(t):
    return t.sum(0)


def add(a, b):
    return a + b


def lse_by_hand(t, stop=True):
    m = jnp.max(t, axis=0)
    shift = lax.stop_gradient(m) if stop else m
    return jnp.log(jnp.sum(jnp.exp(t - shift), axis=0)) + shift


class Stats:
    """Methods as reduction / chunk_reduction."""

    def combine(self, a, b):
        return jnp.minimum(a, b)

    def chunk(self, t):
        return t.min(axis=0)


def pair_chunk(ys):
    return ys[0].sum(0), ys[1].max()


def pair_combine(a, b):
    return a[0] + b[0], jnp.maximum(a[1], b[1])


def dict_chunk(d):
    return {"l": jax.nn.logsumexp(d["x"], axis=0), "s": jnp.sum(d["y"] ** 2), "m": d["x"].min(0)}


def dict_combine(a, b):
    return {
        "l": jnp.logaddexp(a["l"], b["l"]),
        "m": lax.min(b["m"], a["m"]),
        "s": operator.add(a["s"], b["s"]),
    }


# (id, out_shape, reduction, chunk_reduction, [(monoid, axis, shape, dtype, source), ...])
RECOGNIZED = [
    ("jnp.add/jnp.sum", S(4), jnp.add, jnp.sum, [(ADD, None, ())]),
    ("operator.add/def", S(4), operator.add, sum0, [(ADD, 0, (4,))]),
    ("lax.add/t.sum(axis=0)", S(4), lax.add, lambda t: t.sum(axis=0), [(ADD, 0, (4,))]),
    ("lambda/add.reduce", S(4), lambda a, b: a + b, jnp.add.reduce, [(ADD, 0, (4,))]),
    ("def/partial", S(4), add, functools.partial(jnp.sum, axis=0), [(ADD, 0, (4,))]),
    ("jax.checkpoint(def)", S(4), add, jax.checkpoint(sum0), [(ADD, 0, (4,))]),
    (
        "sum keepdims",
        S(4),
        jnp.add,
        lambda t: jnp.sum(t, axis=0, keepdims=True),
        [(ADD, 0, (1, 4))],
    ),
    ("sum t**2", S(4), jnp.add, lambda t: jnp.sum(t**2, 0), [(ADD, 0, (4,))]),
    ("sum t*w (const)", S(4), jnp.add, lambda t: jnp.sum(t * W + 1.0, 0), [(ADD, 0, (4,))]),
    ("sum of 3-d, all", S(2, 4), jnp.add, jnp.sum, [(ADD, None, ())]),
    ("sum of 3-d, axis 0", S(2, 4), jnp.add, sum0, [(ADD, 0, (2, 4))]),
    ("sum of 1-d", S(), jnp.add, jnp.sum, [(ADD, 0, ())]),
    ("int32 sum", S(4, dtype=I32), jnp.add, sum0, [(ADD, 0, (4,), I32)]),
    ("bfloat16 sum", S(4, dtype=BF16), jnp.add, sum0, [(ADD, 0, (4,), BF16)]),
    ("jnp.maximum/t.max()", S(4), jnp.maximum, lambda t: t.max(), [(MAX, None, ())]),
    ("lax.max/jnp.max", S(4), lax.max, jnp.max, [(MAX, None, ())]),
    (
        "swapped max/partial",
        S(4),
        lambda a, b: jnp.maximum(b, a),
        functools.partial(jnp.max, axis=0),
        [(MAX, 0, (4,))],
    ),
    ("max abs", S(4), jnp.maximum, lambda t: jnp.max(jnp.abs(t)), [(MAX, None, ())]),
    ("maximum.reduce", S(4), jnp.maximum, jnp.maximum.reduce, [(MAX, 0, (4,))]),
    (
        "max relu (custom_jvp)",
        S(4),
        jnp.maximum,
        lambda t: jax.nn.relu(t).max(0),
        [(MAX, 0, (4,))],
    ),
    ("int32 max", S(4, dtype=I32), jnp.maximum, jnp.max, [(MAX, None, (), I32)]),
    ("methods (min)", S(4), Stats().combine, Stats().chunk, [(MIN, 0, (4,))]),
    ("lax.min/jnp.amin", S(4), lax.min, jnp.amin, [(MIN, None, ())]),
    (
        "min keepdims",
        S(4),
        jnp.minimum,
        lambda t: jnp.min(t, 0, keepdims=True),
        [(MIN, 0, (1, 4))],
    ),
    (
        "logaddexp/nn.logsumexp",
        S(4),
        jnp.logaddexp,
        jax.nn.logsumexp,
        [(LOGSUMEXP, None, ())],
    ),
    (
        "logaddexp/scipy logsumexp",
        S(4),
        jnp.logaddexp,
        jss.logsumexp,
        [(LOGSUMEXP, None, ())],
    ),
    (
        "swapped logaddexp/axis 0",
        S(4),
        lambda a, b: jnp.logaddexp(b, a),
        functools.partial(jax.nn.logsumexp, axis=0),
        [(LOGSUMEXP, 0, (4,))],
    ),
    (
        "logsumexp keepdims",
        S(4),
        jnp.logaddexp,
        lambda t: jax.nn.logsumexp(t, axis=0, keepdims=True),
        [(LOGSUMEXP, 0, (1, 4))],
    ),
    (
        "logsumexp by hand, stop_gradient",
        S(4),
        jnp.logaddexp,
        lse_by_hand,
        [(LOGSUMEXP, 0, (4,))],
    ),
    (
        "logsumexp by hand, no stop_gradient",
        S(4),
        jnp.logaddexp,
        functools.partial(lse_by_hand, stop=False),
        [(LOGSUMEXP, 0, (4,))],
    ),
    (
        "logsumexp by hand, max twice",
        S(4),
        jnp.logaddexp,
        lambda t: t.max(0) + jnp.log(jnp.sum(jnp.exp(t - t.max(0)), 0)),
        [(LOGSUMEXP, 0, (4,))],
    ),
    (
        "int32 logsumexp",
        S(4, dtype=I32),
        jnp.logaddexp,
        jax.nn.logsumexp,
        [(LOGSUMEXP, None, (), F32)],
    ),
    (
        "bfloat16 logsumexp",
        S(4, dtype=BF16),
        jnp.logaddexp,
        lambda t: jax.nn.logsumexp(t, 0),
        [(LOGSUMEXP, 0, (4,), BF16)],
    ),
    (
        "tuple, mixed monoids",
        (S(4), S(2)),
        pair_combine,
        pair_chunk,
        [(ADD, 0, (4,), F32, 0), (MAX, None, (), F32, 1)],
    ),
    (
        "dict, mixed monoids",
        {"x": S(4), "y": S(2, dtype=I32)},
        dict_combine,
        dict_chunk,
        [(LOGSUMEXP, 0, (4,), F32, 0), (MIN, 0, (4,), F32, 0), (ADD, None, (), I32, 1)],
    ),
    (
        "two results of one leaf",
        S(4),
        lambda a, b: (a[0] + b[0], jnp.minimum(a[1], b[1])),
        lambda t: (t.sum(0), t.min()),
        [(ADD, 0, (4,), F32, 0), (MIN, None, (), F32, 0)],
    ),
    ("Monoid ADD/jnp.sum", S(4), ADD, jnp.sum, [(ADD, None, ())]),
    ("Monoid LOGSUMEXP/identity", S(4), LOGSUMEXP, identity, [(LOGSUMEXP, 0, (4,))]),
    ("Monoid MAX/identity, int32", S(4, dtype=I32), MAX, identity, [(MAX, 0, (4,), I32)]),
]


def random_chunk(out_shape, rows, seed=0):
    rng = np.random.default_rng(seed)

    def leaf(s):
        shape = (rows, *s.shape[1:])
        if jnp.issubdtype(s.dtype, jnp.integer):
            return jnp.asarray(rng.integers(-50, 50, shape), s.dtype)
        return jnp.asarray(rng.normal(size=shape), s.dtype)

    return jax.tree.map(leaf, out_shape)


def from_recognition(rec: Recognition, ys):
    """The chunk result computed from the Recognition alone."""
    outs = [
        jnp.asarray(leaf.monoid.reduce(v, axis=leaf.axis)).reshape(leaf.shape).astype(leaf.dtype)
        for v, leaf in zip(rec.prologue(ys), rec.leaves, strict=True)
    ]
    return jax.tree.unflatten(rec.out_tree, outs)


def reference(reduction, chunk_reduction, ys):
    if chunk_reduction is not identity:
        return chunk_reduction(ys)
    rows = jax.tree.leaves(ys)[0].shape[0]
    return functools.reduce(
        reduction, [jax.tree.map(operator.itemgetter(i), ys) for i in range(rows)]
    )


@pytest.mark.parametrize(
    "out_shape, reduction, chunk_reduction, expected",
    [case[1:] for case in RECOGNIZED],
    ids=[case[0] for case in RECOGNIZED],
)
def test_recognized(out_shape, reduction, chunk_reduction, expected):
    rec = recognize(reduction, chunk_reduction, out_shape)
    assert rec.leaves is not None, rec.how
    assert rec.how
    assert len(rec.leaves) == len(expected)
    for leaf, source_j, want in zip(rec.leaves, rec.fun_sources, expected, strict=True):
        monoid, axis, shape, dtype, source = (*want, *(F32, 0)[len(want) - 3 :])
        assert leaf.monoid is monoid, (leaf, rec.how)
        assert leaf.axis == axis and leaf.shape == shape, leaf
        assert leaf.dtype == np.dtype(dtype) and source_j == source, leaf
    for rows, seed in ((ROWS, 0), (OTHER_ROWS, 1), (1, 2)):  # also at other row counts
        ys = random_chunk(out_shape, rows, seed)
        want = reference(reduction, chunk_reduction, ys)
        assert_tree_close(from_recognition(rec, ys), want)
    ys = random_chunk(out_shape, OTHER_ROWS + 4, 3)  # and traced, inside jit
    got = jax.jit(lambda ys: from_recognition(rec, ys))(ys)
    assert_tree_close(got, reference(reduction, chunk_reduction, ys))


def test_table_is_large_enough():
    assert len(RECOGNIZED) >= 24


COUNTER = itertools.count(1)
W_ROWS = np.ones((ROWS, 4), np.float32)

# (id, out_shape, reduction, chunk_reduction)
GENERIC = [
    ("no reduction", S(4), None, jnp.sum),
    ("identity chunk, non-Monoid", S(4), jnp.add, identity),
    ("mean", S(4), jnp.add, lambda t: t.mean(0)),
    ("sum then max", S(4), jnp.maximum, lambda t: jnp.max(jnp.sum(t, 0))),
    ("row sums then max", S(4), jnp.maximum, lambda t: jnp.max(jnp.sum(t, 1))),
    ("a - b", S(4), lambda a, b: a - b, jnp.sum),
    ("a * b + 1", S(4), lambda a, b: a * b + 1, jnp.sum),
    ("a + a", S(4), lambda a, b: a + a, jnp.sum),
    ("sum over axis 1", S(4), jnp.add, lambda t: t.sum(1)),
    ("sum over axes (0, 1) of 3-d", S(2, 4), jnp.add, lambda t: t.sum((0, 1))),
    ("sum combined by max", S(4), jnp.maximum, jnp.sum),
    ("max combined by add", S(4), jnp.add, jnp.max),
    ("logsumexp combined by add", S(4), jnp.add, jax.nn.logsumexp),
    ("counter after reduce", S(4), jnp.add, lambda t: jnp.sum(t, 0) * next(COUNTER)),
    ("counter in prologue", S(4), jnp.add, lambda t: jnp.sum(t * next(COUNTER), 0)),
    ("constant after reduce", S(4), jnp.add, lambda t: jnp.sum(t, 0) + 1.0),
    ("cumsum prologue", S(4), jnp.add, lambda t: jnp.sum(jnp.cumsum(t, 0), 0)),
    ("sort prologue", S(4), jnp.maximum, lambda t: jnp.max(jnp.sort(t, 0), 0)),
    ("slice prologue", S(4), jnp.add, lambda t: jnp.sum(t[1:], 0)),
    ("dot over rows", S(4), jnp.add, lambda t: jnp.ones(t.shape[0]) @ t),
    ("centering prologue", S(4), jnp.add, lambda t: jnp.sum(t - t.mean(0), 0)),
    ("divide by rows", S(4), jnp.add, lambda t: jnp.sum(t / t.shape[0], 0)),
    ("iota along rows", S(4), jnp.add, lambda t: jnp.sum(t * jnp.arange(t.shape[0])[:, None], 0)),
    ("constant with row axis", S(4), jnp.add, lambda t: jnp.sum(t * W_ROWS, 0)),
    ("two leaves mixed", (S(4), S(4)), jnp.add, lambda ys: jnp.sum(ys[0] * ys[1], 0)),
    (
        "logsumexp, two different shifts",
        S(4),
        jnp.logaddexp,
        lambda t: jnp.log(jnp.sum(jnp.exp(t - t.max(0)), 0)) + jnp.maximum(t.max(0), 5.0),
    ),
    ("logsumexp with b=", S(4), jnp.logaddexp, lambda t: jax.nn.logsumexp(t, 0, b=2.0)),
    (
        "logsumexp return_sign",
        S(4),
        lambda a, b: (jnp.logaddexp(a[0], b[0]), a[1] * b[1]),
        lambda t: jax.nn.logsumexp(t, 0, return_sign=True),
    ),
    ("int cast after sum", S(4), jnp.add, lambda t: jnp.sum(t, 0).astype(I32)),
    (
        "reduction tree differs",
        (S(4), S(4)),
        lambda a, b: [a[0] + b[0], a[1] + b[1]],
        lambda ys: (ys[0].sum(0), ys[1].sum(0)),
    ),
    (
        "reduction swaps leaves",
        (S(4), S(4)),
        lambda a, b: (a[1] + b[1], a[0] + b[0]),
        lambda ys: (ys[0].sum(0), ys[1].sum(0)),
    ),
    (
        "per-leaf monoid mismatch",
        (S(4), S(2)),
        lambda a, b: (a[0] + b[0], a[1] + b[1]),
        pair_chunk,
    ),
    ("chunk_reduction fails to trace", S(4), jnp.add, lambda t: float(t.sum())),
    ("reduction fails to trace", S(4), operator.add, lambda t: {"s": t.sum(0)}),
    ("not reduced", S(4), jnp.add, lambda t: t * 2.0),
    ("Monoid with unrecognized chunk", S(4), ADD, lambda t: t.mean(0)),
]


@pytest.mark.parametrize(
    "out_shape, reduction, chunk_reduction",
    [case[1:] for case in GENERIC],
    ids=[case[0] for case in GENERIC],
)
def test_look_alikes_stay_generic(out_shape, reduction, chunk_reduction):
    rec = recognize(reduction, chunk_reduction, out_shape)
    assert rec.leaves is None, rec
    assert rec.how and "\n" not in rec.how


@pytest.mark.parametrize(
    "chunk_reduction, reason",
    [
        (lambda t: t.mean(0), "div after reduce_sum"),
        (lambda t: jnp.sum(jnp.cumsum(t, 0), 0), "cumsum"),
        (lambda t: t.sum(1), "axes (1,)"),
        (jnp.max, "max"),
    ],
)
def test_reasons_are_explained(chunk_reduction, reason):
    assert reason in recognize(jnp.add, chunk_reduction, S(4)).how


def test_monoid_mismatch_raises():
    with pytest.raises(ValueError, match=r"ADD.*max"):
        recognize(ADD, jnp.max, S(4))
    with pytest.raises(ValueError, match=r"LOGSUMEXP.*add"):
        recognize(LOGSUMEXP, lambda t: t.sum(0), S(4))


def test_how_lines():
    assert recognize(None, jnp.sum, S(4)).how == "no reduction"
    how = recognize(jnp.add, lambda t: t.sum(0), S(4)).how
    assert how == "traced: reduce_sum over axis 0 + add"
    how = recognize(pair_combine, pair_chunk, (S(4), S(2))).how
    assert "leaf 0: reduce_sum" in how and "leaf 1: reduce_max over all axes + max" in how


def test_not_stale_and_unhashable():
    # The same bound method, its object switched from a sum to a max between calls:
    # recognized afresh each time (a cache keyed on the callable would keep summing).
    class Switch:
        def __init__(self):
            self.max = False

        def reduce(self, t):
            return t.max(0) if self.max else t.sum(0)

        def combine(self, a, b):
            return jnp.maximum(a, b) if self.max else a + b

    s = Switch()
    assert recognize(s.combine, s.reduce, S(4)).leaves[0].monoid is ADD
    s.max = True
    assert recognize(s.combine, s.reduce, S(4)).leaves[0].monoid is MAX

    class Unhashable:
        __hash__ = None

        def __call__(self, t):
            return t.max(0)

    rec = recognize(jnp.maximum, Unhashable(), S(4))
    assert rec.leaves is not None and rec.leaves[0].monoid is MAX


def test_closure_over_a_tracer_inside_jit():
    def outer(scale):
        rec = recognize(jnp.add, lambda t: jnp.sum(t * scale, 0), S(4))
        assert rec.leaves is not None, rec.how
        ys = jnp.ones((ROWS + 1, 4))
        return from_recognition(rec, ys)

    np.testing.assert_allclose(jax.jit(outer)(2.0), np.full(4, 2.0 * (ROWS + 1)))
    assert recognize(jnp.add, jnp.sum, S(4)).leaves is not None


def test_prologue_row_count_one_and_vmap_free():
    rec = recognize(jnp.add, lambda t: jnp.sum(jnp.sin(t) * W, axis=0), S(4))
    for rows in (1, 2, 17):
        ys = random_chunk(S(4), rows, rows)
        (v,) = rec.prologue(ys)
        assert v.shape == (rows, 4)
        np.testing.assert_allclose(v, jnp.sin(ys) * W, rtol=1e-6)


def test_prologue_captures_arrays():
    assert recognize(jnp.add, lambda t: jnp.sum(t * W, 0), S(4)).prologue_captures_arrays
    assert not recognize(jnp.add, lambda t: jnp.sum(t * 2.0, 0), S(4)).prologue_captures_arrays
    assert not recognize(jnp.add, jnp.sum, S(4)).prologue_captures_arrays
    assert not recognize(ADD, identity, S(4)).prologue_captures_arrays


def test_prologue_is_differentiable():
    chunk = lambda t: jnp.sum(jnp.sin(t) ** 2 * W, 0)
    rec = recognize(jnp.add, chunk, S(4))
    ys = random_chunk(S(4), OTHER_ROWS)
    got = jax.grad(lambda y: jnp.sum(from_recognition(rec, y)))(ys)
    np.testing.assert_allclose(got, jax.grad(lambda y: jnp.sum(chunk(y)))(ys), rtol=1e-5)


def test_elementwise_tells_what_may_run_twice():
    # The scan engine computes a logsumexp chunk once per pass only for such funs.
    x = jnp.ones((4, 3))
    seen = lambda f: elementwise(jax.make_jaxpr(f)(x))
    assert seen(lambda v: jnp.cos(3 * v) - 0.5 * v**2)
    assert seen(lambda v: jax.nn.relu(jax.jit(jnp.tanh)(v)).reshape(12))  # calls inlined
    assert seen(lambda v: jax.checkpoint(jnp.sin)(v) * 2)  # remat too
    assert seen(lambda v: jnp.broadcast_to(v[:, :, None], (4, 3, 5)) * 2)
    assert not seen(lambda v: v @ jnp.ones((3, 3)))
    assert not seen(lambda v: v - v.sum(1, keepdims=True))
    assert not seen(lambda v: jnp.cumsum(v, 0))

    def printed(v):
        jax.debug.callback(lambda _: None, v)
        return v * 2

    assert not seen(printed)  # an effect: running it twice would show twice
