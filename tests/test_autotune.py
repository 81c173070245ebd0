"""batch_size="auto": the chunk size that fits a memory budget and runs fastest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_close

import adv_jax_math as ajm
from adv_jax_math.analysis.validate import batch_size_from
from adv_jax_math.core.config import parse_bytes
from adv_jax_math.plan import autotune as _autotune
from adv_jax_math.plan.measure import TIMING_ROWS, ChunkProgram

KIB, MIB = 2**10, 2**20
N = 4096


@pytest.fixture(autouse=True)
def fresh_cache():
    _autotune.clear_cache()
    yield
    _autotune.clear_cache()


W1 = jnp.cos(jnp.arange(8 * 2048.0).reshape(8, 2048))
W2 = jnp.sin(jnp.arange(2048 * 16.0).reshape(2048, 16)) / 64


def wide(x):
    """(B, 8) rows -> a (B, 2048) intermediate (matmul operands are materialized:
    8 KiB per row) -> one positive number per row."""
    return jnp.sum(jnp.tanh(jnp.tanh(x @ W1) @ W2) ** 2, axis=1)


def xs(n=N):
    return jnp.linspace(-1.0, 1.0, n * 8, dtype=jnp.float32).reshape(n, 8)


def temp_bytes(f, *args):
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


# -- arguments and options ----------------------------------------------------------------


@pytest.mark.parametrize("value", ["auto", "AUTO", " Auto "])
def test_batch_size_auto_accepted(value):
    assert batch_size_from(value, {}) == "auto"
    assert batch_size_from(None, {"chunk_size": value}) == "auto"


@pytest.mark.parametrize("value", ["fast", "", 2.0])
def test_other_strings_rejected(value):
    with pytest.raises(TypeError, match="'auto'"):
        batch_size_from(value, {})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (512, 512),
        ("512MiB", 512 * MIB),
        ("2GB", 2 * 10**9),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("64kib", 64 * KIB),
        (None, None),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "-3MiB", 0])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_budget_from_env(monkeypatch):
    monkeypatch.setenv("ADV_JAX_MATH_MEMORY_BUDGET", "3MiB")
    assert ajm.config().__enter__().memory_budget == 3 * MIB
    plan = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
    assert plan.autotune.budget == 3 * MIB and "config" in plan.autotune.budget_source


def test_default_budget_is_a_fraction_of_free_memory():
    plan = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
    assert "free" in plan.autotune.budget_source
    assert plan.autotune.budget > 0


# -- choices -------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [256 * KIB, 1 * MIB])
def test_small_budget_forces_chunks_and_is_respected(budget):
    x = xs()
    with ajm.config(memory_budget=budget):
        plan = ajm.explain(wide, x, "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
        assert plan.chunks > 1 and plan.batch_size < N
        f = lambda x: ajm.batch_map(wide, x, "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
        assert temp_bytes(f, x) <= budget
        assert_tree_close(jax.jit(f)(x), jnp.sum(wide(x)), rtol=1e-4)


def test_budget_too_small_for_one_row():
    with ajm.config(memory_budget=1 * KIB), pytest.raises(MemoryError) as info:
        ajm.batch_map(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
    text = str(info.value)
    assert "1.0 KiB" in text and "one row needs" in text and "memory_budget" in text


def test_explain_shows_model_candidates_and_reason():
    with ajm.config(memory_budget=1 * MIB):
        plan = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
    text = str(plan)
    assert "memory model" in text and "x rows" in text
    assert text.count("candidate") >= 5 and "measured" in text and "over budget" in text
    assert "chosen" in text and "fastest" in text
    d = plan.autotune
    assert d.batch_size == plan.batch_size
    chosen = next(c for c in d.candidates if c.rows == d.batch_size)
    assert chosen.measured and chosen.fits and chosen.seconds is not None
    timed = [c for c in d.candidates if c.seconds is not None]
    assert chosen.seconds == min(c.seconds for c in timed)
    assert all(c.bytes <= d.budget for c in timed)


def test_second_trace_is_a_cache_hit(tmp_path):
    cache = tmp_path / "autotune.json"
    with ajm.config(memory_budget=1 * MIB, autotune_cache=str(cache)):
        first = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
        again = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
        assert first.autotune.cache == "computed" and again.autotune.cache == "memory cache hit"
        assert again.batch_size == first.batch_size
        _autotune.clear_cache()
        disk = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
        assert disk.autotune.cache == "disk cache hit" and disk.batch_size == first.batch_size
    with ajm.config(memory_budget=2 * MIB):  # another budget: another decision
        other = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
        assert other.autotune.cache == "computed"


def test_map_and_remainder():
    x = xs(3001)
    with ajm.config(memory_budget=512 * KIB):
        out = ajm.batch_map(wide, x, "auto")
        plan = ajm.explain(wide, x, "auto")
    assert plan.chunks > 1
    assert_tree_close(out, wide(x), rtol=1e-4, atol=1e-3)


def test_map_outputs_larger_than_the_budget():
    # A map writes each chunk into its outputs (the call's results, no temporaries):
    # counted twice per row, 512 KiB of outputs made every size "over budget"
    # (BudgetError: "one row needs 1.0 MiB"); fixed sizes need 9 KiB here.
    w = jnp.cos(jnp.arange(8 * 32.0).reshape(8, 32))
    fun = lambda r: jnp.sort(jnp.tanh(r @ w), axis=-1)  # (n, 32): not row-local (a sort)
    x = jax.ShapeDtypeStruct((N, 8), jnp.float32)
    with ajm.config(memory_budget=256 * KIB):
        plan = ajm.explain(fun, x, "auto")
        assert temp_bytes(lambda x: ajm.batch_map(fun, x, "auto"), x) <= 256 * KIB
    assert plan.chunks > 1 and plan.autotune.fixed_bytes < 256 * KIB, str(plan)


def test_row_local_map_runs_whole_forward_and_reverse():
    # tanh row by row: one call on all rows, forward and in reverse mode (XLA recomputes
    # tanh in the backward pass): nothing to measure. Measuring a chunk program counted
    # the 1 MiB of outputs against a 256 KiB budget (BudgetError: "one row needs 2.0 MiB").
    fun = lambda r: jnp.tanh(r) * 2.0
    x = jax.ShapeDtypeStruct((N, 64), jnp.float32)
    f = lambda x: ajm.batch_map(fun, x, "auto")
    with ajm.config(memory_budget=256 * KIB):
        plan = ajm.explain(fun, x, "auto")
        assert temp_bytes(f, x) <= 256 * KIB
        assert temp_bytes(jax.grad(lambda x: jnp.sum(f(x))), x) <= 256 * KIB
        values = xs(N)
        got = jax.jit(jax.value_and_grad(lambda x: jnp.sum(f(x) ** 2)))(values)
    assert plan.policy is ajm.Policy.SINGLE and plan.batch_size == N
    assert "nothing compiled or timed" in plan.autotune.reason, plan.autotune
    want = jax.value_and_grad(lambda x: jnp.sum(fun(x) ** 2))(values)
    assert_tree_close(got, want, rtol=1e-5)


def test_row_local_map_whose_gradient_runs_in_chunks_fits_the_budget():
    # softmax rows: the forward pass runs whole; run whole, reverse mode kept both
    # layers' exponentials for all rows (4.8 MiB); its chunks hold the outputs'
    # cotangents (2 MiB), then chunks of the size chosen
    def fun(r):  # (jax.nn.softmax has a custom derivative rule: it keeps its chunks)
        for i in range(2):
            e = jnp.exp(r * 3.0 + 0.1 * i - jnp.max(r * 3.0, axis=-1, keepdims=True))
            r = e / e.sum(-1, keepdims=True)
        return r

    x = jax.ShapeDtypeStruct((N, 64), jnp.float32)
    loss = lambda x: jnp.sum(ajm.batch_map(fun, x, "auto") ** 2)
    with ajm.config(memory_budget=3 * MIB):
        assert temp_bytes(jax.grad(loss), x) <= 3 * MIB
        plan = ajm.explain(fun, x, "auto")
    assert plan.policy is ajm.Policy.SINGLE and plan.derivatives is not None, str(plan)
    assert plan.autotune.candidates and plan.batch_size < N, plan.autotune


# -- transformations -------------------------------------------------------------------------


def energy(w, x, batch_size):
    fun = lambda rows: jnp.sum(jnp.tanh(rows @ w) ** 2, axis=1) * wide(rows)
    return ajm.batch_map(fun, x, batch_size, reduction=jnp.add, chunk_reduction=jnp.sum)


def test_grad_measures_the_backward_pass_and_fits():
    w, x = jnp.ones((8, 16)) / 8, xs()
    budget = 1 * MIB
    with ajm.config(memory_budget=budget):
        g = jax.grad(lambda w: energy(w, x, "auto"))
        assert temp_bytes(jax.value_and_grad(lambda w: energy(w, x, "auto")), w) <= budget
        got = jax.jit(g)(w)
        decisions = list(_autotune._MEMORY.values())
    assert any("backward" in d.grad for d in decisions)
    assert_tree_close(got, jax.grad(lambda w: energy(w, x, None))(w), rtol=1e-3, atol=1e-3)


def test_forward_only_under_jit_measures_forward():
    w, x = jnp.ones((8, 16)) / 8, xs()
    with ajm.config(memory_budget=1 * MIB):
        jax.jit(lambda w: energy(w, x, "auto"))(w)
    assert all(d.grad == "forward only" for d in _autotune._MEMORY.values())


def test_grad_of_jit_with_autotune_grad_always():
    w, x = jnp.ones((8, 16)) / 8, xs()
    with ajm.config(memory_budget=1 * MIB, autotune_grad="always"):
        got = jax.grad(jax.jit(lambda w: energy(w, x, "auto")))(w)
    assert all("backward" in d.grad for d in _autotune._MEMORY.values())
    assert_tree_close(got, jax.grad(lambda w: energy(w, x, None))(w), rtol=1e-3, atol=1e-3)


def test_vmap_over_the_call():
    ws = jnp.stack([jnp.ones((8, 16)) / 8, jnp.ones((8, 16)) / 4])
    x = xs(1024)
    with ajm.config(memory_budget=1 * MIB):
        got = jax.vmap(lambda w: energy(w, x, "auto"))(ws)
    want = jnp.stack([energy(w, x, None) for w in ws])
    assert_tree_close(got, want, rtol=1e-4)


def test_shard_budget_per_device():
    x = xs()
    with ajm.config(memory_budget=512 * KIB):
        plan = ajm.explain(wide, x, "auto", reduction=jnp.add, chunk_reduction=jnp.sum, shard=True)
        local = plan.shard.local or plan.shard.remainder
        assert local.autotune is not None and local.chunks > 1
        out = ajm.batch_map(wide, x, "auto", reduction=jnp.add, chunk_reduction=jnp.sum, shard=True)
    assert_tree_close(out, jnp.sum(wide(x)), rtol=1e-4)


def test_batch_vmap_auto():
    w = jnp.ones((8, 16)) / 8
    per_example = lambda w, r: jnp.sum(jnp.tanh(r @ w) ** 2) * jnp.sum(jnp.sin(r * 3.0))
    with ajm.config(memory_budget=1 * MIB):
        got = ajm.batch_vmap(jax.grad(per_example), in_axes=(None, 0), batch_size="auto")(
            w, xs(512)
        )
    assert_tree_close(got, jax.vmap(jax.grad(per_example), (None, 0))(w, xs(512)), rtol=1e-4)


def test_jacobians_and_vectorize_auto():
    f = lambda v: jnp.tanh(jnp.outer(v, v)).sum(axis=0) * v
    v = jnp.linspace(0.1, 1.0, 64)
    with ajm.config(memory_budget=1 * MIB):
        assert_tree_close(ajm.batch_jacfwd(f, batch_size="auto")(v), jax.jacfwd(f)(v), rtol=1e-4)
        assert_tree_close(ajm.batch_jacrev(f, batch_size="auto")(v), jax.jacrev(f)(v), rtol=1e-4)
        h = ajm.batch_vectorize(
            lambda a, b: jnp.dot(a, b), signature="(n),(n)->()", batch_size="auto"
        )
        a, b = xs(300), xs(300) + 1
    assert_tree_close(h(a, b), jnp.sum(a * b, axis=1), rtol=1e-4)


def test_closed_over_tracers_do_not_leak():
    x = xs(512)

    @jax.jit
    def f(scale):
        fun = lambda r: wide(r * scale)
        return ajm.batch_map(fun, x, "auto", reduction=jnp.add, chunk_reduction=jnp.sum)

    with ajm.config(memory_budget=512 * KIB):
        got = f(jnp.float32(0.5))
        got_grad = jax.grad(f)(jnp.float32(0.5))
    assert np.isfinite(got) and np.isfinite(got_grad)
    assert_tree_close(got, jnp.sum(wide(x * 0.5)), rtol=1e-4)


# -- timing: runs through many chunks, noisy timings re-timed side by side ---------------


@pytest.fixture
def programs(monkeypatch):
    """The ChunkProgram objects the decisions made in the test use."""
    made = []

    class Recording(ChunkProgram):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(_autotune, "ChunkProgram", Recording)
    return made


def test_timing_program_runs_any_number_of_chunks_and_sums_them(programs):
    with ajm.config(memory_budget=1 * MIB):
        ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
    (prog,) = programs
    assert prog._compiled and prog.long_chunks(16) == TIMING_ROWS // 16
    for rows in prog._compiled:
        assert prog.long_chunks(rows) == max(1, min(N // rows, TIMING_ROWS // rows))
        cargs, xargs = prog._inputs(rows)
        k = prog.long_chunks(rows)  # distinct rows for every chunk of a run, as the call
        assert xargs[0].shape == (k, rows, 8)
        per_chunk = [jnp.sum(wide(xargs[0][i])) for i in range(k)]
        for m in (1, 2, 5, k + 1):
            (got,) = prog.compiled(rows)[0](cargs, xargs, np.int32(m))
            want = sum(per_chunk[i % k] for i in range(m))
            assert_tree_close(got, want, rtol=1e-4)


def test_seconds_is_chunks_times_the_fastest_run_per_chunk(programs):
    with ajm.config(memory_budget=1 * MIB):
        ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
    (prog,) = programs
    rows = 16
    chunks, long = prog.chunks(rows), prog.long_chunks(rows)
    assert (chunks, long) == (N // rows, TIMING_ROWS // rows)
    script, asked = iter([0.5, 0.4, 0.45, 0.3, 0.9]), []

    def run(rows, m):
        asked.append((rows, m))
        return next(script)

    prog.run, prog._best = run, {}
    assert prog.seconds(rows, spend=0.0, runs=3) == pytest.approx(chunks * 0.4 / long)
    assert asked == [(rows, long)] * 3
    assert prog.seconds(rows, spend=0.0, runs=1) == pytest.approx(chunks * 0.3 / long)
    assert prog.seconds(rows, spend=0.0, runs=1) == pytest.approx(chunks * 0.3 / long)  # kept
    assert prog.chunks(N) == prog.long_chunks(N) == 1


def scripted_runs(calls):
    """A stand-in for ChunkProgram.run: the call takes 1 - log2(rows) / 100 seconds
    (larger chunks are faster), but timings are noisy: a size's first two runs (the
    search's) are the slower the larger the chunk (noise that misleads the search),
    its fifth (the last re-timing round) 1.5x."""

    def run(self, rows, m):
        before = sum(r == rows for r, _ in calls)
        calls.append((rows, m))
        t = m * (1 - np.log2(rows) / 100) / self.chunks(rows)
        if before < 2:
            t *= 1 + np.log2(rows) / 10
        elif before == 4:
            t *= 1.5
        return t

    return run


def test_fastest_sizes_are_retimed_interleaved_and_the_fastest_run_kept(monkeypatch, programs):
    calls = []
    monkeypatch.setattr(ChunkProgram, "run", scripted_runs(calls))
    monkeypatch.setattr(_autotune, "RETIME_ROUNDS", 3)  # the burst is in the last round
    with ajm.config(memory_budget=1 * MIB):
        d = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum).autotune
    (prog,) = programs
    timed = [c.rows for c in d.candidates if c.seconds is not None]
    assert len(timed) == min(_autotune.MAX_COMPILES, sum(c.fits for c in d.candidates))
    run = lambda r: (r, prog.long_chunks(r))
    k = len(timed)
    search, again = calls[: -3 * k], calls[-3 * k :]
    # the search: each size's first timing is two runs in a row; before each next
    # size, one more run of every size timed so far (no more than that)
    firsts = [i for i, c in enumerate(search) if c not in search[:i]]
    assert sorted(search[i] for i in firsts) == sorted(run(r) for r in timed)
    assert all(search[i + 1] == search[i] for i in firsts)
    checks = [c for i, c in enumerate(search) if i not in firsts and i - 1 not in firsts]
    assert checks and len(checks) <= k * (k - 1) // 2
    order = again[:k]  # then three rounds, each the previous one reversed
    assert sorted(order) == sorted(run(r) for r in timed)
    assert again == order + order[::-1] + order
    for c in d.candidates:  # from the fastest run: neither the search's nor the burst
        if c.seconds is not None:
            assert c.seconds == pytest.approx(1 - np.log2(c.rows) / 100)
    # the search's timings alone would have chosen the smallest size
    assert d.batch_size == max(timed) != min(timed)
    sizes_text = ", ".join(map(str, sorted(timed)))
    assert f"{sizes_text} rows timed again interleaved, 3 rounds, the fastest run" in d.reason


def test_a_burst_of_load_in_one_first_timing_does_not_steer_the_search(monkeypatch, programs):
    """Per call, 1 + |log2(rows) - 8| / 20 seconds (256 rows fastest), but 256 rows'
    first timing (the search's second probe) runs 1.5x slow. Without a run of the
    sizes timed so far before each step, the search turned to smaller sizes and
    never timed 256 again."""
    calls = []

    def run(self, rows, m):
        calls.append(rows)
        t = 1 + abs(np.log2(rows) - 8) / 20
        if rows == 256 and calls.count(256) <= 2:
            t *= 1.5
        return t * m / self.chunks(rows)

    monkeypatch.setattr(ChunkProgram, "run", run)
    with ajm.config(memory_budget=8 * MIB):
        d = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum).autotune
    timed = [c.rows for c in d.candidates if c.seconds is not None]
    assert timed[0] == 16 and 256 in timed and max(timed) > 256, d  # went past 256
    assert d.batch_size == 256, d


def test_the_search_steps_to_the_fastest_size_next_to_the_fastest_timed(monkeypatch, programs):
    """Per call, 1 + |log2(rows) - 7| / 20 seconds: 128 rows fastest, every size fits.
    After 16 and 256 rows the search steps one size at a time (512, then 128); a
    jump to the middle of the untimed sizes above 256 spent a compile far away and
    never timed 128."""

    def run(self, rows, m):
        return (1 + abs(np.log2(rows) - 7) / 20) * m / self.chunks(rows)

    monkeypatch.setattr(ChunkProgram, "run", run)
    with ajm.config(memory_budget=64 * MIB):
        d = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum).autotune
    timed = [c.rows for c in d.candidates if c.seconds is not None]
    assert timed == [16, 128, 256, 512] and d.batch_size == 128, d


def test_no_retiming_keeps_the_first_timings(monkeypatch):
    calls = []
    monkeypatch.setattr(ChunkProgram, "run", scripted_runs(calls))
    monkeypatch.setattr(_autotune, "RETIME_ROUNDS", 0)
    with ajm.config(memory_budget=1 * MIB):
        d = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum).autotune
    timed = [c.rows for c in d.candidates if c.seconds is not None]
    assert len(calls) == 2 * len(timed) and d.batch_size == min(timed)
    assert "again" not in d.reason


class FakeProgram:
    """Takes ``step`` seconds of a fake clock to time a size; says 1 s per call."""

    def __init__(self, clock, step):
        self.clock, self.step, self.calls = clock, step, []

    def seconds(self, rows, spend=0.01, runs=2):
        self.clock[0] += self.step
        self.calls.append(rows)
        return 1.0


@pytest.mark.parametrize(
    ("secs", "step", "retimed", "rounds"),
    [
        ({16: 1.0, 32: 1.1, 64: 1.2, 128: 1.3}, 0.01, [16, 32, 64], 5),  # the fastest 3
        ({16: 1.0, 32: 2.5, 64: 1.9}, 0.01, [16, 64], 5),  # 32 is over 2x the fastest
        ({16: 1.0, 32: 1.1, 64: 1.2}, 0.1, [16, 32, 64], 1),  # 0.3 s a round: 1 fits 0.5 s
        ({16: 1.0, 32: 1.1}, 0.1, [16, 32], 2),  # 0.2 s a round: 2 fit
        ({16: 1.0, 32: 1.1}, 0.001, [16, 32], 5),  # RETIME_ROUNDS at most
        ({16: 1.0, 32: 2.5}, 0.01, [16], 0),  # one size: nothing to compare
    ],
)
def test_retime_is_bounded(monkeypatch, secs, step, retimed, rounds):
    clock = [0.0]
    monkeypatch.setattr(_autotune, "_clock", lambda: clock[0])
    prog = FakeProgram(clock, step)
    before = dict(secs)
    assert _autotune._retime(prog, secs) == (retimed, rounds)
    assert len(prog.calls) == len(retimed) * rounds
    assert clock[0] <= max(_autotune.RETIME_SECONDS, step * len(retimed)) + 1e-9
    for r in before:
        assert secs[r] == (1.0 if r in retimed and rounds else before[r])


def test_explain_prints_planning_time():
    with ajm.config(memory_budget=1 * MIB):
        plan = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
        again = ajm.explain(wide, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
    d = plan.autotune
    assert d.seconds > 0
    line = next(line for line in str(plan).splitlines() if line.startswith("autotune"))
    assert f"computed, {d.seconds * 1e3:.0f} ms planning" in line
    assert "memory cache hit" in str(again) and "ms planning" in str(again)
