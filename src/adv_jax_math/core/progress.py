"""Progress of long chunk loops: ``config(progress=True)`` / ``ADV_JAX_MATH_PROGRESS=1``.

:func:`scan` is ``lax.scan`` for the engines' chunk loops. With progress on, each
step first reports its chunk index through an ordered ``jax.debug.callback``
(so it works under ``jit``, on every platform), and a last callback, which
depends on the loop's result, reports the end. The reporter prints chunks done /
total, rows per second and time left on stderr: a ``tqdm`` bar when ``tqdm`` is
installed, otherwise a line that rewrites itself on a terminal, and one line per
call (at the end) when stderr is not a terminal. With progress off, :func:`scan`
is exactly ``lax.scan``: nothing is added to the compiled program.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import config as _config

__all__ = ["Reporter", "scan"]

_ids = itertools.count()


class Reporter:
    """Receives the callbacks of every loop and writes their progress to stderr."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict[int, dict[str, Any]] = {}

    def _stream(self) -> Any:
        return sys.stderr

    def step(self, loop: int, total: int, rows: int, label: str, index: Any) -> None:
        """Chunk ``index`` (0-based) of loop ``loop`` starts: ``index`` chunks are done."""
        done = int(index)
        with self._lock:
            state = self._state.get(loop)
            if state is None or done == 0 or done < state["done"]:
                self._close(state)
                state = self._state[loop] = {
                    "start": time.perf_counter(),
                    "done": 0,
                    "shown": 0.0,
                    "bar": _tqdm(total, label),
                }
            state["done"] = done
            self._show(state, total, rows, label, final=False)

    def finish(self, loop: int, total: int, rows: int, label: str, *_: Any) -> None:
        """The loop's result exists: every chunk is done."""
        with self._lock:
            state = self._state.pop(loop, None)
            if state is None:
                state = {"start": time.perf_counter(), "shown": 0.0, "bar": _tqdm(total, label)}
            state["done"] = total
            self._show(state, total, rows, label, final=True)
            self._close(state)

    def _close(self, state: dict | None) -> None:
        if state is not None and state.get("bar") is not None:
            state["bar"].close()
            state["bar"] = None

    def _show(self, state: dict, total: int, rows: int, label: str, final: bool) -> None:
        bar, done = state.get("bar"), state["done"]
        if bar is not None:
            bar.update(done - bar.n)
            return
        elapsed = time.perf_counter() - state["start"]
        stream = self._stream()
        tty = bool(getattr(stream, "isatty", lambda: False)())
        if not final and (not tty or elapsed - state["shown"] < 0.1):
            return
        state["shown"] = elapsed
        rate = done * rows / elapsed if elapsed > 0 else float("inf")
        left = (total - done) * elapsed / done if done else float("nan")
        text = f"adv_jax_math {label}: {done}/{total} chunks, {rate:,.0f} rows/s, " + (
            f"{elapsed:.2f} s" if final else f"{left:.1f} s left"
        )
        stream.write(("\r" + text + ("\n" if final else "")) if tty else text + "\n")
        stream.flush()


def _tqdm(total: int, label: str) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"adv_jax_math {label}", unit="chunk", leave=False)


REPORTER = Reporter()


def scan(
    body: Callable,
    init: Any,
    xs: Any,
    *,
    rows: int,
    label: str = "chunks",
) -> tuple[Any, Any]:
    """``lax.scan(body, init, xs)``, reporting progress when ``config(progress=True)``.

    ``rows`` is the number of rows per step (for rows per second).
    """
    if not _config.current().progress:
        return lax.scan(body, init, xs)
    total = len(jax.tree.leaves(xs)[0])
    loop = next(_ids)

    def stepped(carry: Any, inputs: Any) -> tuple[Any, Any]:
        i, x = inputs
        jax.debug.callback(
            lambda idx: REPORTER.step(loop, total, rows, label, idx), i, ordered=True
        )
        return body(carry, x)

    carry, ys = lax.scan(stepped, init, (jnp.arange(total), xs))
    witness = [leaf.reshape(-1)[:1] for leaf in jax.tree.leaves((carry, ys)) if leaf.size]
    jax.debug.callback(
        lambda *_: REPORTER.finish(loop, total, rows, label), witness[:1], ordered=True
    )
    return carry, ys
