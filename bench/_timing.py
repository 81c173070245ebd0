"""The one timing helper of ``bench/``: compile once, warm up, repeat, block until ready.

Every script times through this module, so each number means the same thing
everywhere:

* :func:`compile_fn` — ``jax.jit(f).lower(*args).compile()`` of ``f``, timed (tracing
  included, and its XLA compile part alone), with the compiled temp memory
  (``memory_analysis().temp_size_in_bytes``);
* :func:`time_calls` — warm-up calls, then ``repeats`` timed calls of one function;
* :func:`interleaved` — several functions timed round by round (optionally in a
  shuffled order), so that load from other processes hits them alike;
* :func:`measure` — all of it for one function: compile once, warm up, repeat.

A sample is the seconds per call of ``loops`` consecutive calls, the last one
blocked with ``jax.block_until_ready``. :class:`Timing` keeps every sample and
gives their min and median.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax


@dataclass(frozen=True)
class Timing:
    """Seconds per call, one sample per timed repeat."""

    samples: tuple[float, ...]

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def __str__(self) -> str:
        return f"{self.min * 1e3:.3f} / {self.median * 1e3:.3f} ms (min / median of {len(self)})"

    def __len__(self) -> int:
        return len(self.samples)


@dataclass(frozen=True)
class Compiled:
    """A compiled function and what compiling it cost."""

    executable: Any  # jax.stages.Compiled: call it like the function
    seconds: float  # lower (tracing included) + XLA compile
    xla_seconds: float  # the XLA compile part

    @property
    def temp_bytes(self) -> int:
        return temp_bytes(self.executable)


@dataclass(frozen=True)
class Measurement:
    """One function, compiled once and timed: see :func:`measure`."""

    time: Timing
    compiled: Compiled
    out: Any  # the result of the first call

    @property
    def temp_bytes(self) -> int:
        return self.compiled.temp_bytes


def temp_bytes(compiled: Any) -> int:
    """Temporary device memory (bytes) of a compiled function (``jax.stages.Compiled``)."""
    return compiled.memory_analysis().temp_size_in_bytes


def compile_fn(f: Callable, args: Sequence[Any]) -> Compiled:
    """``jax.jit(f).lower(*args).compile()``, timed. Pass a fresh function object to
    include tracing (jit caches traces per function object)."""
    t0 = time.perf_counter()
    lowered = jax.jit(f).lower(*args)
    t1 = time.perf_counter()
    executable = lowered.compile()
    t2 = time.perf_counter()
    return Compiled(executable, t2 - t0, t2 - t1)


def call_time(f: Callable, args: Sequence[Any], loops: int = 1) -> float:
    """Seconds per call of ``loops`` calls of ``f(*args)``; the last output is blocked on."""
    t0 = time.perf_counter()
    for _ in range(loops):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / loops


def interleaved(
    fs: Mapping[str, Callable],
    args: Sequence[Any],
    *,
    rounds: int | None = None,
    seconds: float | None = None,
    min_rounds: int = 1,
    max_rounds: int = 1000,
    warmup: int = 1,
    min_sample_s: float | None = None,
    shuffle: int | None = None,
) -> dict[str, Timing]:
    """Time every function of ``fs`` on ``args``, one call (or ``loops``) each per round.

    ``warmup`` untimed rounds come first (the first call of a ``jax.jit`` function
    compiles it); the last one is timed to size the measurement:

    * ``rounds``: that many timed rounds; or, with ``seconds``, as many as take about
      that long in all, clamped to ``[min_rounds, max_rounds]``;
    * ``min_sample_s``: each sample times enough consecutive calls (``loops``) that
      the slowest function's sample lasts that long (for functions of microseconds);
    * ``shuffle``: the seed of a random order per round; None keeps the order of ``fs``.
    """
    if (rounds is None) == (seconds is None):
        raise ValueError("give exactly one of rounds and seconds")
    sized = rounds is None or min_sample_s is not None
    if sized and warmup < 1:
        raise ValueError("sizing by seconds or min_sample_s needs a warm-up round")
    warm = {}
    for _ in range(warmup):
        warm = {name: call_time(f, args) for name, f in fs.items()}
    loops = 1
    if min_sample_s is not None:
        loops = max(1, int(min_sample_s / max(max(warm.values()), 1e-9)))
    if rounds is None:
        per_round = loops * sum(warm.values())
        rounds = min(max_rounds, max(min_rounds, math.ceil(seconds / max(per_round, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in fs}
    order, rng = list(fs), random.Random(shuffle)
    for _ in range(rounds):
        if shuffle is not None:
            rng.shuffle(order)
        for name in order:
            samples[name].append(call_time(fs[name], args, loops))
    return {name: Timing(tuple(s)) for name, s in samples.items()}


def time_calls(
    f: Callable, args: Sequence[Any], *, repeats: int, warmup: int = 1, min_sample_s=None
) -> Timing:
    """``warmup`` calls, then ``repeats`` timed ones: :func:`interleaved` of one function."""
    return interleaved({"f": f}, args, rounds=repeats, warmup=warmup, min_sample_s=min_sample_s)[
        "f"
    ]


def measure(f: Callable, args: Sequence[Any], *, repeats: int = 5, warmup: int = 1) -> Measurement:
    """Compile ``f`` once (:func:`compile_fn`), call it ``warmup`` times (the first
    result is kept), then time ``repeats`` calls."""
    compiled = compile_fn(f, args)
    out = jax.block_until_ready(compiled.executable(*args))
    timing = time_calls(compiled.executable, args, repeats=repeats, warmup=max(warmup - 1, 0))
    return Measurement(timing, compiled, out)


def first_call(f: Callable, args: Sequence[Any] = ()) -> tuple[Any, float]:
    """``f(*args)``, blocked on, and its seconds: the checking call that is the warm-up."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    return out, time.perf_counter() - t0


def staged(
    fs: Mapping[str, Callable[..., Any]],
    args: Sequence[Any],
    rounds: Mapping[str, int],
    seed: int,
    first: Mapping[str, float],
) -> dict[str, Timing]:
    """Interleaved rounds with no warm-up (a checking call was it, timed in ``first``),
    each function taking part in its first ``rounds[name]`` rounds only (a slow one in
    fewer), shuffled from ``seed``; with 0 rounds (too slow to repeat) the first call's
    time is the one sample."""
    samples: dict[str, tuple[float, ...]] = {name: () for name in fs}
    done = 0
    for level in sorted({rounds[name] for name in fs} - {0}):
        names = [name for name in fs if rounds[name] >= level]
        t = interleaved(
            {name: fs[name] for name in names},
            args,
            rounds=level - done,
            warmup=0,
            shuffle=seed + done,
        )
        for name in names:
            samples[name] += t[name].samples
        done = level
    return {name: Timing(s or (first[name],)) for name, s in samples.items()}
