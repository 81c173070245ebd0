"""config(progress=True): chunks done, rows per second and time left on stderr."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_close

import adv_jax_math as ajm
from adv_jax_math.core import progress as _progress

X = jnp.linspace(0.0, 1.0, 1000)


def sin(v):  # jnp.sin through a cumsum: not row-local, so a map of it keeps its chunks
    return jnp.cumsum(jnp.sin(v)[:, None], -1)[:, 0]


def run(x, **kw):
    return ajm.batch_map(sin, x, 100, **kw)  # 10 chunks of 100 rows


def test_ten_chunk_jitted_loop_reports_on_stderr(capsys):
    with ajm.config(progress=True):
        f = jax.jit(lambda x: run(x, reduction=jnp.add, chunk_reduction=jnp.sum))
        out = jax.block_until_ready(f(X))
    jax.effects_barrier()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "adv_jax_math" in line]
    assert len(lines) == 1, err  # not a terminal: one line per call
    assert "10/10 chunks" in lines[0] and "rows/s" in lines[0]
    assert_tree_close(out, jnp.sum(jnp.sin(X)))


def test_map_and_every_call_reports(capsys):
    with ajm.config(progress=True):
        f = jax.jit(run)
        for _ in range(2):
            jax.block_until_ready(f(X))
    jax.effects_barrier()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "10/10 chunks" in ln]
    assert len(lines) == 2


def test_env_variable(monkeypatch, capsys):
    monkeypatch.setenv("ADV_JAX_MATH_PROGRESS", "1")
    jax.block_until_ready(jax.jit(run)(X))
    jax.effects_barrier()
    assert "10/10 chunks" in capsys.readouterr().err


@pytest.mark.parametrize("reduce", [{}, {"reduction": jnp.add, "chunk_reduction": jnp.sum}])
def test_compiled_program_unchanged_with_progress_off(reduce):
    def text(**opts):
        with ajm.config(**opts):
            return jax.jit(lambda x: run(x, **reduce)).lower(X).as_text()

    off, default, on = text(progress=False), text(), text(progress=True)
    assert off == default
    assert "callback" not in off
    assert "callback" in on


def test_progress_under_grad(capsys):
    with ajm.config(progress=True):
        g = jax.jit(jax.grad(lambda s: run(X * s, reduction=jnp.add, chunk_reduction=jnp.sum)))
        got = g(1.0)
    jax.effects_barrier()
    assert "10/10 chunks" in capsys.readouterr().err
    assert_tree_close(got, jnp.sum(jnp.cos(X) * X), rtol=1e-4)


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_terminal_line_rewrites_itself(monkeypatch):
    stream = FakeTerminal()
    reporter = _progress.Reporter()
    monkeypatch.setattr(reporter, "_stream", lambda: stream)
    monkeypatch.setattr(_progress, "_tqdm", lambda total, label: None)
    for i in range(4):
        reporter.step(7, 4, 10, "chunks", i)
        if i:
            reporter._state[7]["shown"] = -1.0  # let the next step print
    reporter.finish(7, 4, 10, "chunks")
    text = stream.getvalue()
    assert text.startswith("\r") and "s left" in text and text.endswith("\n")
    assert "4/4 chunks" in text and text.count("\n") == 1
