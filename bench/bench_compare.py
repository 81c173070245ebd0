"""adv_jax_math against the original library, ``jax.lax.map`` and plain XLA.

Every competitor ("engine") takes ``batch_map``'s arguments, so each workload is
written once. ``bench/report.py`` measures all metrics from these definitions in
one process (interleaved runs, ratios); the tests below are the pytest-benchmark
view of the same cases (``make bench``) plus the goals that are not timings:
trace counts and gradient memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import adv_jax_math as ajm

import _original
from workloads import field_contributions

# -- engines: batch_map's signature ------------------------------------------------


def ours(fun, x, batch_size, reduction=None, chunk_reduction=ajm.identity):
    return ajm.batch_map(fun, x, batch_size, reduction=reduction, chunk_reduction=chunk_reduction)


def ours_no_remat(fun, x, batch_size, reduction=None, chunk_reduction=ajm.identity):
    with ajm.config(remat=False):  # read while tracing
        return ours(fun, x, batch_size, reduction, chunk_reduction)


def original(fun, x, batch_size, reduction=None, chunk_reduction=ajm.identity):
    run = _original.load().batch_map
    return run(fun, x, batch_size, reduction=reduction, chunk_reduction=chunk_reduction)


def lax_map(fun, x, batch_size, reduction=None, chunk_reduction=ajm.identity):
    """``jax.lax.map`` over rows (vmapped in batches), then one reduction of all rows."""
    row = lambda r: jax.tree.map(lambda y: y[0], fun(jax.tree.map(lambda a: a[None], r)))
    return chunk_reduction(lax.map(row, x, batch_size=batch_size))


def plain(fun, x, batch_size, reduction=None, chunk_reduction=ajm.identity):
    """Unchunked: the oracle."""
    return chunk_reduction(fun(x))


ENGINES: dict[str, Callable] = {
    "ours": ours,
    "ours remat=False": ours_no_remat,
    "original 1.3": original,
    "lax.map": lax_map,
    "plain": plain,
}

# -- workloads: program(engine, batch_size, count) -> function of the data ----------
# ``count()`` is called by ``fun`` each time it is traced.


def elementwise_sum(run, b, count):
    def f(w, x):
        def fun(c):
            count()
            return jnp.sin(w * c) * jnp.exp(-0.5 * c * c)

        return run(fun, x, b, reduction=jnp.add, chunk_reduction=jnp.sum)

    return f


def nbody(run, b, count):
    def f(targets, sources):
        def fun(s):
            count()
            return field_contributions(targets, s)

        return run(fun, sources, b, reduction=jnp.add, chunk_reduction=jnp.add.reduce)

    return f


def logsumexp(run, b, count):
    def f(mu, x):
        def fun(c):
            count()
            return -0.5 * (c - mu) ** 2 + jnp.cos(3 * c)

        return run(fun, x, b, reduction=jnp.logaddexp, chunk_reduction=jax.nn.logsumexp)

    return f


def dict_map(run, b, count):
    def f(xs):
        def fun(d):
            count()
            r = jnp.sqrt(jnp.sum(d["pos"] ** 2, axis=-1))
            return {"r": r * d["w"], "unit": d["pos"] / (r + 1.0)[:, None]}

        return run(fun, xs, b)

    return f


def grad_elementwise_sum(run, b, count):
    return jax.grad(elementwise_sum(run, b, count))


def grad_nbody(run, b, count):
    f = nbody(run, b, count)
    return jax.grad(lambda t, s: jnp.sum(f(t, s) ** 2))


def _keys(n):
    return jax.random.split(jax.random.key(n), 2)


def elementwise_data(n):
    return jnp.float32(1.3), 3 * jax.random.normal(_keys(n)[0], (n,))


def nbody_data(n, n_targets=256):
    k1, k2 = _keys(n)
    return jax.random.normal(k1, (n_targets, 3)), jax.random.normal(k2, (n, 3))


def logsumexp_data(n):
    return jnp.float32(0.5), 2 * jax.random.normal(_keys(n)[0], (n,))


def dict_data(n):
    k1, k2 = _keys(n)
    return ({"pos": jax.random.normal(k1, (n, 3)), "w": jax.random.uniform(k2, (n,))},)


@dataclass(frozen=True)
class Workload:
    name: str
    program: Callable
    data: Callable
    batch_size: int
    sizes: tuple[int, ...]  # a multiple of batch_size, then a non-multiple
    grad: bool = False


ELEMENTWISE = Workload(
    "elementwise sum", elementwise_sum, elementwise_data, 2**14, (2**20, 1_000_003)
)
NBODY = Workload("N-body (256, 3)", nbody, nbody_data, 1024, (2**15, 30_001))
LOGSUMEXP = Workload("logsumexp", logsumexp, logsumexp_data, 2**14, (2**18, 250_001))
DICT_MAP = Workload("dict map", dict_map, dict_data, 4096, (98_304, 100_000))
GRAD_ELEMENTWISE = Workload(
    "grad elementwise sum", grad_elementwise_sum, elementwise_data, 2**14, (2**20, 1_000_003), True
)
GRAD_NBODY = Workload("grad N-body", grad_nbody, nbody_data, 1024, (2**15, 30_001), True)
WORKLOADS = (ELEMENTWISE, NBODY, LOGSUMEXP, DICT_MAP, GRAD_ELEMENTWISE, GRAD_NBODY)


@dataclass(frozen=True)
class Case:
    workload: Workload
    n: int

    def __str__(self) -> str:
        return f"{self.workload.name}, n={self.n}"

    @property
    def divisible(self) -> bool:
        return self.n % self.workload.batch_size == 0

    @property
    def engines(self) -> tuple[str, ...]:
        # Rematerialization only changes gradients.
        return tuple(e for e in ENGINES if self.workload.grad or e != "ours remat=False")

    def args(self) -> tuple:
        return _data(self.workload.data, self.n)

    def function(self, engine: str, count: Callable[[], None] = lambda: None) -> Callable:
        """A fresh function object computing this case with ``engine``."""
        return self.workload.program(ENGINES[engine], self.workload.batch_size, count)


@functools.cache
def _data(make: Callable, n: int) -> tuple:
    return make(n)


CASES = tuple(Case(w, n) for w in WORKLOADS for n in w.sizes)


def traces_and_compiled(case: Case, engine: str, args: tuple | None = None):
    """``(times fun was traced, compiled executable)`` for a fresh jit of the case."""
    calls = []
    f = case.function(engine, lambda: calls.append(1))
    compiled = jax.jit(f).lower(*(args or case.args())).compile()
    return len(calls), compiled


def temp_bytes(compiled) -> int:
    return compiled.memory_analysis().temp_size_in_bytes


# -- pytest-benchmark ------------------------------------------------------------------

RUN_PARAMS = [(c, e) for c in CASES for e in c.engines]


@pytest.mark.parametrize(("case", "engine"), RUN_PARAMS, ids=[f"{c}-{e}" for c, e in RUN_PARAMS])
def test_run_time(benchmark, case, engine):
    args = case.args()
    f = jax.jit(case.function(engine))
    jax.block_until_ready(f(*args))
    benchmark.group = f"run: {case}"
    benchmark.pedantic(lambda: jax.block_until_ready(f(*args)), rounds=10, warmup_rounds=1)


COMPILE_PARAMS = [(c, e) for c in CASES if not c.divisible for e in ("ours", "original 1.3")]


@pytest.mark.parametrize(
    ("case", "engine"), COMPILE_PARAMS, ids=[f"{c}-{e}" for c, e in COMPILE_PARAMS]
)
def test_compile_time(benchmark, case, engine):
    args = case.args()
    benchmark.group = f"compile: {case}"
    benchmark.pedantic(lambda: traces_and_compiled(case, engine, args), rounds=3)


@pytest.mark.parametrize("case", [c for c in CASES if not c.divisible], ids=str)
def test_fun_traced_once(case):
    assert traces_and_compiled(case, "ours")[0] == 1
    assert traces_and_compiled(case, "original 1.3")[0] >= 2


def test_nbody_grad_memory_is_flat_and_10x_below_original():
    small, large = (Case(GRAD_NBODY, n) for n in (4096, 65536))
    ours_small = temp_bytes(traces_and_compiled(small, "ours")[1])
    ours_large = temp_bytes(traces_and_compiled(large, "ours")[1])
    orig_large = temp_bytes(traces_and_compiled(large, "original 1.3")[1])
    assert ours_large <= 1.1 * ours_small
    assert 10 * ours_large <= orig_large
