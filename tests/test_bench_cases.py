"""The case lists shared with the benchmarks and the accelerator compile checks
(``bench/cases/``), at the tests' small sizes: every ``map_reduce`` case (those of the
compile checks and of ``bench_monoids.py``) on 37 rows
(ragged against its batch of at most 16) through the public ``batch_map`` against its
plain-JAX oracle, values and (where the case has one) ``value_and_grad``; the pairwise
reductions are ``tests/test_pairwise.py``'s own."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from cases.map_reduce import CASES, MONOIDS_BENCH
from helpers import assert_tree_close, enable_x64

ROWS = 37
BF16 = dict(rtol=2e-2, atol=2e-2)
GRAD = dict(rtol=2e-4, atol=2e-4)  # float32 gradients summed in another order


@pytest.mark.parametrize("case", [*CASES, *MONOIDS_BENCH.values()], ids=lambda c: c.name)
def test_map_reduce_case_matches_its_oracle(case):
    small = dataclasses.replace(case.at(ROWS), batch_size=min(case.batch_size, 16))
    with enable_x64(case.x64):
        args = jax.tree.map(jnp.asarray, small.arrays())
        got = jax.jit(small.program())(*args)
        want = jax.jit(small.program(plain=True))(*args)
    bf16 = any(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(small.inputs))
    assert_tree_close(got, want, **(BF16 if bf16 else GRAD if case.grad else {}))
