"""The arg-extremum, top-k, softmax-weighted and variance monoids against plain JAX.

The cases (:func:`cases`): ``cases.map_reduce.MONOIDS_BENCH`` (the issue's sizes), each
``batch_map`` call beside the plain-JAX computations it is measured against:

* ``k-NN top-16``: the 16 nearest of ``2^20`` database rows (``d = 16``) for 256
  queries, ``reduction=ajm.top_k(16, smallest=True)`` over squared distances, against
  ``lax.top_k`` and ``jax.lax.approx_min_k`` on the stacked ``(256, 2^20)`` distance
  matrix (1 GiB in float32), and against a hand-written ``lax.scan`` that runs
  ``lax.top_k`` on each chunk and merges (not a library API: it shows what chunking
  alone costs);
* ``k-NN ARGMIN``: the nearest row per query, ``reduction=ajm.ARGMIN``, against
  ``jnp.argmin`` and ``approx_min_k(k=1)`` on the stacked distances;
* ``softmax-weighted sum``: ``2^20`` value rows (16 floats each) weighted by the
  softmax of their scores against 64 queries (``d = 16``),
  ``reduction=ajm.SOFTMAX_WEIGHTED``, against ``jax.nn.softmax`` + ``jnp.tensordot``;
* ``VAR``: the variance of ``2^24`` float32 values ``1000 + N(0, 1)``,
  ``reduction=ajm.VAR``, against ``jnp.var`` and the one-pass ``E[x^2] - E[x]^2``;
  errors relative to a float64 NumPy reference (:func:`var_errors`).

Every engine's result is checked against the case's oracle before it is timed
(indices exactly, values to ``rtol`` 1e-5; ``approx_min_k`` by its recall target).
``monoids_report.py`` measures all of it in one process, interleaved, and writes
``bench/results/monoids.{json,md}`` and the README section; the tests below are the
pytest-benchmark view (``make bench``), plus the goals that are not timings
(compiled temp memory, the variance's error).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _timing import compile_fn
from cases import map_reduce, max_rel_error
from jax import lax

BENCH = map_reduce.MONOIDS_BENCH
K = BENCH["topk"].reduction.k  # neighbours
QUERIES, DIM = BENCH["topk"].params.shape  # k-NN queries, database and query dimension
SOFTMAX_QUERIES = BENCH["close"].params.shape[0]
VALUE_DIM = BENCH["close"].inputs["v"].shape[1]  # floats per value row
VAR_OFFSET = BENCH["var"].loc
RECALL_TARGET = 0.95  # approx_min_k's default recall_target
RTOL = 1e-5


@dataclass(frozen=True)
class Engine:
    """One way to compute a case: a function of the case's arguments."""

    name: str
    fn: Callable
    ours: bool = False
    batch_size: int | None = None
    approximate: bool = False  # checked by recall, not equality
    # Timed rounds in monoids_report.py (None: the case's); 0: slow, timed once, by the
    # checking call itself (approx_min_k of 2^20 rows: a sort of 1 GiB, ~2 min on 2 cores).
    rounds: int | None = None
    context: bool = False  # shown for context, not a baseline the issue asks for


@dataclass(frozen=True, eq=False)
class Case:
    """A ``batch_map`` call (``call``), its engines (functions of the call's ``(params,
    xs)``) and how their results are compared with the oracle."""

    name: str
    description: str
    call: map_reduce.Case
    engines: tuple[Engine, ...]
    oracle: str  # the engine whose result is the reference; "float64" for VAR
    kind: str  # "topk", "argmin", "close" or "var"

    def __str__(self) -> str:
        return self.name

    def engine(self, name: str) -> Engine:
        return next(e for e in self.engines if e.name == name)

    def args(self, seed: int = 0) -> tuple:
        return _args(self, seed)

    def reference(self, seed: int = 0) -> Any:
        """The oracle's result (host arrays): an engine's, or float64 NumPy for VAR."""
        return _reference(self, seed)

    def check(self, engine: Engine, out: Any, ref: Any) -> dict:
        """Compare ``out`` with ``ref``; raise AssertionError when wrong, else return the
        comparison's numbers (error, indices equal, recall)."""
        return CHECKS[self.kind](engine, out, ref)


@functools.cache
def _args(case: Case, seed: int) -> tuple:
    return case.call.arrays(seed)


@functools.cache
def _reference(case: Case, seed: int) -> Any:
    args = case.args(seed)
    if case.oracle == "float64":
        return float(np.var(np.asarray(args[1], np.float64)))
    f = compile_fn(case.engine(case.oracle).fn, args).executable
    return jax.tree.map(np.asarray, f(*args))


# -- checks ------------------------------------------------------------------------------


def _check_topk(engine: Engine, out, ref) -> dict:
    (v, i), (rv, ri) = (jax.tree.map(np.asarray, o) for o in (out, ref))
    assert v.shape == rv.shape and i.shape == ri.shape, (v.shape, i.shape, rv.shape, ri.shape)
    k = ri.shape[0]
    found = [len(set(i[:, q]) & set(ri[:, q])) for q in range(ri.shape[1])]
    info = {
        "indices_equal": bool(np.array_equal(i, ri)),
        "recall": float(np.sum(found) / ri.size),
        "rel_error": max_rel_error(v, rv),
    }
    if engine.approximate:
        assert info["recall"] >= RECALL_TARGET, f"{engine.name}: recall {info['recall']:.3f}"
        return info
    bad = int(np.sum(i != ri))
    assert info["indices_equal"], f"{engine.name}: {bad} of {i.size} indices differ (k={k})"
    assert info["rel_error"] <= RTOL, f"{engine.name}: values off by {info['rel_error']:.2e}"
    return info


def _check_argmin(engine: Engine, out, ref) -> dict:
    i, ri = np.asarray(out), np.asarray(ref)
    assert i.shape == ri.shape, (i.shape, ri.shape)
    info = {"indices_equal": bool(np.array_equal(i, ri)), "recall": float(np.mean(i == ri))}
    if engine.approximate:
        assert info["recall"] >= RECALL_TARGET, f"{engine.name}: recall {info['recall']:.3f}"
    else:
        assert info["indices_equal"], f"{engine.name}: {int(np.sum(i != ri))} indices differ"
    return info


def _check_close(engine: Engine, out, ref) -> dict:
    assert np.shape(out) == np.shape(ref), (np.shape(out), np.shape(ref))
    err = max_rel_error(out, ref)
    assert err <= RTOL, f"{engine.name}: relative error {err:.2e}"
    return {"rel_error": err}


def var_rel_error(out, ref: float) -> float:
    return abs(float(out) - ref) / ref


def _check_var(engine: Engine, out, ref: float) -> dict:
    err = var_rel_error(out, ref)
    if not engine.context:  # the one-pass formula is shown for its error
        assert err <= 1e-6, f"{engine.name}: relative error {err:.2e} vs float64"
    return {"rel_error": err}


CHECKS = {"topk": _check_topk, "argmin": _check_argmin, "close": _check_close, "var": _check_var}


# -- the plain-JAX engines: functions of (params, xs) -----------------------------------------


def sq_dist_t(queries, rows):
    """Squared distances ``(queries, rows)``: the layout ``lax.top_k`` and ``approx_min_k``
    reduce (the last axis), computed as such (no transpose)."""
    cross = queries @ rows.T
    return jnp.sum(rows * rows, -1)[None] - 2 * cross + jnp.sum(queries * queries, -1)[:, None]


def stacked_top_k(queries, db):
    values, idx = lax.top_k(-sq_dist_t(queries, db), K)  # (queries, K)
    return -values.T, idx.T


def stacked_approx_min_k(queries, db):
    values, idx = lax.approx_min_k(sq_dist_t(queries, db), K)
    return values.T, idx.T


def scan_top_k(batch_size: int) -> Callable:
    """By hand: ``lax.top_k`` of each chunk's distances, merged with the running best by
    a second ``lax.top_k`` (n must be a multiple of ``batch_size``)."""

    def f(queries, db):
        n = db.shape[0]
        chunks = db.reshape(n // batch_size, batch_size, db.shape[1])

        def body(carry, chunk):
            values, idx = carry
            start, rows = chunk
            v, i = lax.top_k(-sq_dist_t(queries, rows), K)
            v, i = jnp.concatenate([values, v], 1), jnp.concatenate([idx, i + start], 1)
            best, pick = lax.top_k(v, K)
            return (best, jnp.take_along_axis(i, pick, 1)), None

        q = queries.shape[0]
        init = (jnp.full((q, K), -jnp.inf, db.dtype), jnp.zeros((q, K), jnp.int32))
        starts = jnp.arange(n // batch_size, dtype=jnp.int32) * batch_size
        (values, idx), _ = lax.scan(body, init, (starts, chunks))
        return -values.T, idx.T

    return f


def stacked_argmin(queries, db):
    return jnp.argmin(sq_dist_t(queries, db), axis=1)


def stacked_approx_argmin(queries, db):
    return lax.approx_min_k(sq_dist_t(queries, db), 1)[1][:, 0]


def stacked_softmax(queries, kv):
    s, v = map_reduce.attention(kv, queries)
    return jnp.tensordot(jax.nn.softmax(s, 0), v, ([0], [0]))  # (queries, VALUE_DIM)


def one_pass_var(_, x):
    return jnp.mean(x * x) - jnp.mean(x) ** 2


def var_errors(case: Case, seeds) -> dict[str, list[float]]:
    """Relative error of each engine's float32 variance against float64 NumPy, per seed
    (one compile per engine; the arguments are made and dropped seed by seed)."""
    fs = {e.name: compile_fn(e.fn, case.args(0)).executable for e in case.engines}
    errs: dict[str, list[float]] = {name: [] for name in fs}
    for seed in seeds:
        args = case.call.arrays(seed)
        ref = float(np.var(np.asarray(args[1], np.float64)))
        for name, f in fs.items():
            errs[name].append(var_rel_error(f(*args), ref))
        del args
    return errs


# -- the cases -----------------------------------------------------------------------------


def cases(
    n_db: int = 2**20,
    n_softmax: int = 2**20,
    n_var: int = 2**24,
    knn_batch: int = 2**14,
    knn_small_batch: int = 2**12,
    softmax_batch: int = 2**14,
    var_batch: int = 2**16,
) -> tuple[Case, ...]:
    """The four cases at these sizes (the defaults are the issue's)."""
    b, b2, sb, vb = knn_batch, knn_small_batch, softmax_batch, var_batch
    ours = lambda kind, n, b: replace(BENCH[kind].at(n), batch_size=b).program()
    knn = Case(
        "k-NN top-16",
        f"the {K} nearest of {n_db} rows (d={DIM}) for {QUERIES} queries, squared distances",
        BENCH["topk"].at(n_db),
        (
            Engine(f"ours top_k (B={b})", ours("topk", n_db, b), ours=True, batch_size=b),
            Engine(f"ours top_k (B={b2})", ours("topk", n_db, b2), ours=True, batch_size=b2),
            Engine("lax.top_k, stacked", stacked_top_k),
            Engine("approx_min_k, stacked", stacked_approx_min_k, approximate=True, rounds=0),
            Engine(
                f"lax.scan + lax.top_k by hand (B={b})", scan_top_k(b), batch_size=b, context=True
            ),
        ),
        oracle="lax.top_k, stacked",
        kind="topk",
    )
    argmin = Case(
        "k-NN ARGMIN",
        f"the nearest of {n_db} rows (d={DIM}) for {QUERIES} queries, squared distances",
        BENCH["argmin"].at(n_db),
        (
            Engine(f"ours ARGMIN (B={b})", ours("argmin", n_db, b), ours=True, batch_size=b),
            Engine("jnp.argmin, stacked", stacked_argmin),
            Engine("approx_min_k(k=1), stacked", stacked_approx_argmin, approximate=True),
        ),
        oracle="jnp.argmin, stacked",
        kind="argmin",
    )
    softmax = Case(
        "softmax-weighted sum",
        f"{n_softmax} value rows ({VALUE_DIM} floats) weighted by softmax over rows of "
        f"{SOFTMAX_QUERIES} queries' scores (d={DIM})",
        BENCH["close"].at(n_softmax),
        (
            Engine(
                f"ours SOFTMAX_WEIGHTED (B={sb})",
                ours("close", n_softmax, sb),
                ours=True,
                batch_size=sb,
            ),
            Engine("softmax + tensordot, stacked", stacked_softmax),
        ),
        oracle="softmax + tensordot, stacked",
        kind="close",
    )
    var = Case(
        "VAR",
        f"variance of {n_var} float32 values {VAR_OFFSET:g} + N(0, 1)",
        BENCH["var"].at(n_var),
        (
            Engine(f"ours VAR (B={vb})", ours("var", n_var, vb), ours=True, batch_size=vb),
            Engine("jnp.var", lambda _, x: jnp.var(x)),
            Engine("E[x^2] - E[x]^2, one pass", one_pass_var, context=True),
        ),
        oracle="float64",
        kind="var",
    )
    return knn, argmin, softmax, var


CASES = cases()
QUICK_CASES = cases(n_db=2**16, n_softmax=2**16, n_var=2**20, var_batch=2**14)


# -- pytest-benchmark ----------------------------------------------------------------------

RUN_PARAMS = [(c, e) for c in CASES for e in c.engines]


@pytest.mark.parametrize(
    ("case", "engine"), RUN_PARAMS, ids=[f"{c}-{e.name}" for c, e in RUN_PARAMS]
)
def test_run_time(benchmark, case: Case, engine: Engine):
    """Checked against the oracle, then timed (the check's call is the warm-up); a slow
    engine (``rounds=0``) is called once, timed, and that result is checked."""
    args = case.args()
    f = compile_fn(engine.fn, args).executable
    call = lambda: jax.block_until_ready(f(*args))
    benchmark.group = f"monoids: {case}"
    if engine.rounds == 0:
        out = benchmark.pedantic(call, rounds=1, warmup_rounds=0)
        benchmark.extra_info.update(case.check(engine, out, case.reference()))
        return
    benchmark.extra_info.update(case.check(engine, call(), case.reference()))
    benchmark.pedantic(call, rounds=3, warmup_rounds=0)


def temp_bytes(case: Case, name: str) -> int:
    return compile_fn(case.engine(name).fn, case.args()).temp_bytes


@pytest.mark.parametrize("case", [c for c in CASES if c.kind != "var"], ids=str)
def test_temp_memory_10x_below_stacked(case: Case):
    """Ours holds a chunk of distances (scores), not all of them."""
    stacked = temp_bytes(case, case.oracle)
    for e in case.engines:
        if e.ours:
            assert 10 * temp_bytes(case, e.name) <= stacked, e.name


def test_var_error_within_one_rounding_of_jnp_var():
    """Ours is as exact as ``jnp.var`` (two passes over the data) up to the rounding of
    the float32 result itself, for several seeds."""
    case = CASES[-1]
    errs = var_errors(case, range(3))
    ours = next(e.name for e in case.engines if e.ours)
    half_ulp = float(np.finfo(np.float32).eps) / 2
    for mine, theirs in zip(errs[ours], errs["jnp.var"], strict=True):
        assert mine <= max(theirs, half_ulp) + half_ulp, (mine, theirs)


@pytest.mark.parametrize("case", QUICK_CASES, ids=str)
def test_quick_cases_match_oracle(case: Case):
    """The quick-mode sizes (``monoids_report.py --quick``), every engine against the oracle."""
    args, ref = case.args(), case.reference()
    for e in case.engines:
        case.check(e, compile_fn(e.fn, args).executable(*args), ref)
