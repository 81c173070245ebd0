"""adv_jax_math against the original library, ``jax.lax.map`` and plain XLA.

The cases (``workloads.CASES``: each workload of ``workloads.COMPARE`` at each of its
sizes, with each engine of ``workloads.ENGINES``) are those of ``report.py``, which
measures all metrics in one process (interleaved runs, ratios); the tests below are
the pytest-benchmark view of them (``make bench``) plus the goals that are not
timings: trace counts and gradient memory.
"""

from __future__ import annotations

import jax
import pytest
from _timing import compile_fn
from cases import max_rel_error
from cases.workloads import CASES, COMPARE, HEADLINE, NBODY_FORCES, Case


def traces_and_compiled(case: Case, engine: str, args: tuple | None = None):
    """``(times fun was traced, Compiled)`` for a fresh jit of the case."""
    calls = []
    compiled = compile_fn(case.function(engine, lambda: calls.append(1)), args or case.args())
    return len(calls), compiled


RUN_PARAMS = [(c, e) for c in CASES for e in c.engines]


@pytest.mark.parametrize(("case", "engine"), RUN_PARAMS, ids=[f"{c}-{e}" for c, e in RUN_PARAMS])
def test_run_time(benchmark, case, engine):
    args = case.args()
    f = traces_and_compiled(case, engine, args)[1].executable
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
    small, large = (Case(NBODY_FORCES, n) for n in (4096, 65536))
    ours_small = traces_and_compiled(small, "ours")[1].temp_bytes
    ours_large = traces_and_compiled(large, "ours")[1].temp_bytes
    orig_large = traces_and_compiled(large, "original 1.3")[1].temp_bytes
    assert ours_large <= 1.1 * ours_small
    assert 10 * ours_large <= orig_large


@pytest.mark.parametrize("workload", dict.fromkeys(COMPARE + HEADLINE), ids=lambda w: w.name)
def test_chunked_matches_oracle(workload):
    """Every registered workload, on a few chunks and a remainder, against its oracle."""
    params, x = workload.inputs(2 * 64 + 5)
    chunked = workload.program("ours", batch_size=64)
    assert max_rel_error(chunked(params, x), workload.oracle()(params, x)) < 1e-5
