"""Front-end validation (issue 26): calls that gave wrong results or unclear errors.

A table of expected errors, equinox/chex style: each entry is a call, the exception
type and a regex of the message, which names what was given and says what to do.
Every entry is checked through ``batch_map``, ``explain`` and (where the call has a
per-example form) ``batch_vmap``, on the scan and interpret engines and with
``shard=True`` on 4 devices. Associative reductions must keep working.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close
from jax import lax

import adv_jax_math as ajm

FOUR = jax.device_count() == 4
# (backend, shard)
ENGINES = [("scan", False), ("interpret", False)] + ([("scan", True)] if FOUR else [])

X = jnp.asarray(np.random.default_rng(0).normal(size=(18, 3)), jnp.float32)
B = 2
SUM0 = lambda y: y.sum(0)
CAT = lambda a, b: jnp.concatenate([a, b])


@contextlib.contextmanager
def engine(backend):
    with ajm.config(backend=backend):
        yield


# id: (fun, reduction, chunk_reduction, per-example fun for batch_vmap or None,
#      exception, message regex)
ERRORS = {
    "Monoid base class": (
        lambda r: r,
        ajm.Monoid(),
        ajm.identity,
        lambda r: r,
        TypeError,
        r"reduction=adv_jax_math\.MONOID \(Monoid\) does not define init, fold, merge, "
        r"finalize.*Pass one of adv_jax_math's monoids.*or a subclass of Monoid that defines",
    ),
    "jnp.argmin": (
        lambda r: r,
        jnp.argmin,
        ajm.identity,
        lambda r: r,
        TypeError,
        r"reduction=<function argmin.*cannot combine two results of chunk_reduction "
        r"\(float32\[\d+, 3\]\).*return one of the same shape.*reduction=adv_jax_math\.ARGMIN",
    ),
    # a reduction over rows passed as the combine: the error and a hint, not a
    # KeyError from the table of hints (a regression)
    "jax.nn.logsumexp as the combine": (
        lambda r: r,
        jax.nn.logsumexp,
        jax.nn.logsumexp,
        lambda r: r,
        TypeError,
        r"reduction=<function logsumexp.*cannot combine two results of chunk_reduction "
        r"\(float32\[\]\): calling it raised TypeError.*e\.g\. jnp\.add; for logsumexp over "
        r"rows use reduction=adv_jax_math\.LOGSUMEXP.*with reduction=jnp\.logaddexp",
    ),
    "a combine that fails, no hint": (
        lambda r: r,
        lambda a, b: a.reshape(7) + b,
        SUM0,
        lambda r: r,
        TypeError,
        r"reduction=<function <lambda>.*cannot combine two results of chunk_reduction "
        r"\(float32\[3\]\): calling it raised TypeError.*return one of the same shape, "
        r"e\.g\. jnp\.add$",
    ),
    "an enum class": (
        lambda r: r,
        ajm.Kind,
        ajm.identity,
        lambda r: r,
        TypeError,
        r"reduction=<enum 'Kind'> is a class, not a reduction; pass a binary callable",
    ),
    "scalar output, ARGMIN": (
        lambda r: r.sum(),
        ajm.ARGMIN,
        ajm.identity,
        None,  # per example, a scalar is one row: valid
        ValueError,
        r"reduction=adv_jax_math\.ARGMIN reduces the rows of fun's output, but fun returned "
        r"\(\) \(a 0-d leaf\) for a chunk of \d+ rows; fun must return arrays with one row",
    ),
    "None output, MEAN": (
        lambda r: None,
        ajm.MEAN,
        ajm.identity,
        lambda r: None,
        ValueError,
        r"reduction=adv_jax_math\.MEAN reduces the rows of fun's output, but fun returned "
        r"nothing \(no array leaves\).*one row per input row",
    ),
    "twice the rows, ARGMIN": (
        lambda r: jnp.concatenate([r, r]),
        ajm.ARGMIN,
        ajm.identity,
        None,
        ValueError,
        r"fun\(chunk\) has shape \((2|4), 3\) for a chunk of (1|2) rows; "
        r"reduction=adv_jax_math\.ARGMIN reduces axis 0 of each output leaf as the rows",
    ),
    "transposed, top_k(2)": (
        lambda r: r.T,
        ajm.top_k(2),
        ajm.identity,
        None,
        ValueError,
        r"fun\(chunk\) has shape \(3, \d+\) for a chunk of \d+ rows; "
        r"reduction=adv_jax_math\.top_k\(2\) reduces axis 0.*not transposed or repeated",
    ),
    "transposed, MEAN_VAR": (
        lambda r: r.T,
        ajm.MEAN_VAR,
        ajm.identity,
        None,
        ValueError,
        r"fun\(chunk\) has shape \(3, \d+\).*reduction=adv_jax_math\.MEAN_VAR reduces axis 0",
    ),
    "softmax weights and values, other row counts": (
        lambda r: (r[:, 0], jnp.concatenate([r, r])),
        ajm.SOFTMAX_WEIGHTED,
        ajm.identity,
        None,
        ValueError,
        r"fun\(chunk\)\[1\] has shape \(\d+, 3\) for a chunk of \d+ rows; "
        r"reduction=adv_jax_math\.SOFTMAX_WEIGHTED reduces axis 0",
    ),
    "None in a pytree of monoids": (
        lambda r: {"rows": r, "cols": r},
        {"rows": None, "cols": ajm.LOGSUMEXP},
        ajm.identity,
        lambda r: {"rows": r, "cols": r},
        ValueError,
        r"reduction\['rows'\] is None in reduction=\{'rows': None, 'cols': "
        r"adv_jax_math\.LOGSUMEXP\}: in a pytree of reductions every leaf must be a Monoid "
        r"object.*give that part a monoid too",
    ),
    "concatenation in a loop": (
        lambda r: r,
        CAT,
        ajm.identity,
        lambda r: r,
        ValueError,
        r"reduction=<function <lambda>.* returns float32\[\d+, 3\] for two partial results "
        r"float32\[\d+, 3\]: a reduction must return the structure, shapes and dtypes of its "
        r"inputs.*pass reduction=None",
    ),
    "jnp.subtract": (
        lambda r: r,
        jnp.subtract,
        SUM0,
        lambda r: r,
        ValueError,
        r"reduction=<jnp.ufunc 'subtract'> is not associative: it computes a - b from its "
        r"arguments a and b.*Pass an associative reduction",
    ),
    "a / b": (
        jnp.exp,
        lambda a, b: a / b,
        SUM0,
        jnp.exp,
        ValueError,
        r"reduction=<function <lambda>.* is not associative: it computes a / b",
    ),
    "average of partial results": (
        lambda r: r,
        lambda a, b: (a + b) / 2,
        lambda y: y.mean(0),
        lambda r: r,
        ValueError,
        r"is not associative: it computes 0\.5\*a \+ 0\.5\*b.*reduction=adv_jax_math\.MEAN",
    ),
    "2 * a + b on a pytree": (
        lambda r: {"u": r, "v": r[:, 0]},
        lambda a, b: {"u": a["u"] + b["u"], "v": 2 * a["v"] + b["v"]},
        lambda y: jax.tree.map(SUM0, y),
        None,
        ValueError,
        r"is not associative: it computes 2\*a \+ b from its arguments a and b "
        r"\(for the result\['v'\]\)",
    ),
}


@pytest.mark.parametrize("name", ERRORS)
def test_error_names_what_was_given_and_what_to_do(name):
    fun, reduction, chunk_reduction, per_row, error, match = ERRORS[name]
    kw = dict(reduction=reduction, chunk_reduction=chunk_reduction)
    for backend, shard in ENGINES:
        with engine(backend):
            with pytest.raises(error, match=match):
                ajm.batch_map(fun, X, B, shard=shard, **kw)
            with pytest.raises(error, match=match):
                ajm.explain(fun, X, B, shard=shard, **kw)
            if per_row is not None:
                with pytest.raises(error, match=match):
                    ajm.batch_vmap(per_row, batch_size=B, shard=shard, **kw)(X)


def _top2(v):
    values, indices = lax.top_k(v.T, 2)
    return values.T, indices.T


# Monoid objects (and jnp.add with the identity, rows combined directly, as the
# original library) with strip_dim0=True: the plain-JAX reduction of vmap(fun)(x).
STRIPPED = {
    "ARGMIN": (ajm.ARGMIN, lambda v: jnp.argmin(v, 0)),
    "MEAN_VAR": (ajm.MEAN_VAR, lambda v: (v.mean(0), v.var(0))),
    "top_k(2)": (ajm.top_k(2), _top2),
    "ADD": (ajm.ADD, lambda v: v.sum(0)),
    "MAX": (ajm.MAX, lambda v: v.max(0)),
    "pytree": (
        {"a": ajm.ARGMIN, "b": ajm.LOGSUMEXP},
        lambda v: {"a": jnp.argmin(v["a"], 0), "b": jax.nn.logsumexp(v["b"], 0)},
    ),
    "jnp.add": (jnp.add, lambda v: v.sum(0)),
}


@pytest.mark.parametrize("backend, shard", ENGINES)
def test_strip_dim0_reduces_every_row(backend, shard):
    row = lambda r: jnp.sin(r) * 3.0
    tree_row = lambda r: {"a": row(r), "b": jnp.cos(r)}
    x = X[:5]
    for name, (reduction, reduce) in STRIPPED.items():
        if shard and name == "jnp.add":
            continue  # shard=True folds unreduced chunks of all devices together (a bug)
        fun = tree_row if name == "pytree" else row
        want = reduce(jax.vmap(fun)(x))
        with engine(backend):
            got = ajm.batch_map(fun, x, 1, reduction=reduction, strip_dim0=True, shard=shard)
            plan = ajm.explain(fun, x, 1, reduction=reduction, strip_dim0=True, shard=shard)
        assert_tree_close(got, want)
        if plan.reduction is not None:  # the plan's result shapes are the result's
            terms = plan.reduction.finish([leaf.out for leaf in plan.reduction.leaves])
            shape = lambda s: tuple(s.shape)
            assert jax.tree.map(shape, terms) == jax.tree.map(shape, want), name


# Associative generic reductions the check must accept: (fun, x, batch_size,
# reduction, chunk_reduction, the plain-JAX result, shard too).
_prod = lambda ms: lax.associative_scan(jnp.matmul, ms)[-1]
_M = jnp.asarray(np.random.default_rng(1).normal(size=(6, 2, 2)), jnp.float32)
_P = jnp.abs(X) + 0.5
ACCEPTED = {
    "a + b": (jnp.exp, X, B, lambda a, b: a + b, SUM0, jnp.exp(X).sum(0), True),
    "jnp.add, identity": (  # chunk results added elementwise (the original library)
        jnp.exp,
        X[:4],
        B,
        jnp.add,
        ajm.identity,
        jnp.exp(X[:2]) + jnp.exp(X[2:4]),
        False,
    ),
    "pytree add": (
        lambda r: {"u": r, "v": r[:, :1]},
        X,
        B,
        lambda a, b: jax.tree.map(jnp.add, a, b),
        lambda y: jax.tree.map(SUM0, y),
        {"u": X.sum(0), "v": X[:, :1].sum(0)},
        True,
    ),
    "jnp.maximum": (jnp.sin, X, B, jnp.maximum, lambda y: y.max(), jnp.sin(X).max(), True),
    "logaddexp, chunk logsumexp over axis 0": (
        jnp.cos,
        X,
        B,
        lambda a, b: jnp.logaddexp(a, b) * 1.0,
        lambda y: jax.nn.logsumexp(y, 0),
        jax.nn.logsumexp(jnp.cos(X), 0),
        True,
    ),
    "matmul": (
        lambda m: m,
        _M,
        B,
        jnp.matmul,
        _prod,
        functools.reduce(jnp.matmul, list(_M)),
        True,
    ),
    "harmonic": (
        lambda r: r,
        _P,
        B,
        lambda a, b: a * b / (a + b),
        lambda y: 1 / (1 / y).sum(0),
        1 / (1 / _P).sum(0),
        True,
    ),
    "last": (lambda r: r, X, B, lambda a, b: b, lambda y: y[-1], X[-1], False),
    "concatenation applied once": (
        lambda r: r,
        X[:5],
        3,
        CAT,
        lambda y: y.sum(0, keepdims=True),
        jnp.stack([X[:3].sum(0), X[3:5].sum(0)]),
        False,
    ),
}


@pytest.mark.parametrize("name", ACCEPTED)
def test_associative_reductions_are_accepted(name):
    fun, x, b, reduction, chunk_reduction, want, shards = ACCEPTED[name]
    for backend, shard in ENGINES:
        if shard and not shards:
            continue
        with engine(backend):
            got = ajm.batch_map(
                fun, x, b, reduction=reduction, chunk_reduction=chunk_reduction, shard=shard
            )
        assert_tree_close(got, want)
