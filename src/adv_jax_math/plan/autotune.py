"""``batch_size="auto"``: the fastest chunk size whose compiled program fits a budget.

When a call with ``batch_size="auto"`` is planned (at trace time), one chunk's
program (``plan.measure``: ``chunk_reduction(fun(rows))``, and its VJP when the call
is being differentiated, run over a few chunks in a loop as the call runs them) is
compiled at up to ``MAX_COMPILES`` candidate sizes (powers of two). Its
``memory_analysis()`` bytes are fitted as ``a + b * rows``, ``a`` including what the
whole call holds whatever the chunk size (``ChunkProgram.held``). Candidates the model
puts under the budget are timed on synthetic inputs (``ChunkProgram.seconds``), and a
local search over the sizes that fit finds the fastest; as a burst of load from other
processes makes one timing slow, the fastest sizes are timed again side by side
(:func:`_retime`). The size chosen was compiled and measured itself. ``explain`` shows
the planning time and the :class:`~adv_jax_math.plan.decision.Decision`.

Rule for "differentiated" (``config(autotune_grad="auto")``): a mapped input leaf
or a value ``fun`` closes over is a float tracer of an autodiff transformation
(``jax.grad``, ``jax.vjp``, ``jax.jvp``, ``jax.linearize``), looked for through
``vmap`` layers. The chunk's VJP is then measured with respect to exactly those
values, with one chunk rematerialized as the scan engine does (``remat=True``).
``jax.grad`` of a ``jax.jit``-compiled function differentiates a jaxpr traced
before the gradient exists: use ``config(autotune_grad="always")`` there.

Closed-over tracers never leak: the chunk is traced to a jaxpr whose constants are
passed to the measured program as arguments (placeholders of the same avals), and
concrete constants are reused for the timing runs. Decisions are cached in memory
by (chunk jaxpr, avals, what is differentiated, budget, platform, options), and on
disk with ``config(autotune_cache=path)``, so a second trace costs nothing.

The disk cache is a JSON object mapping keys to decisions, checked before use: an
entry that is not a valid decision for its call (``Decision.from_json``) gives a
``UserWarning`` naming the file, the entry and the problem, and is recomputed and
replaced alone. A file that cannot be read or is not a JSON object of entries is never
rewritten: a warning says so, and decisions are kept in memory only until it is fixed
or deleted. A decision that cannot be written (permissions, a full disk) warns and is
kept in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import time
import warnings
from typing import Any

import jax

from ..core import config as _config
from ..core.call import Call
from .decision import Candidate, Decision
from .measure import ChunkProgram, budget_in_force, fmt_bytes

__all__ = ["BudgetError", "Candidate", "Decision", "choose", "clear_cache"]

SMALLEST = 16  # first candidate (smaller ones only when 16 rows do not fit)
SECOND_PROBE = 256  # second point of the memory model
# Chunk programs compiled per decision, at most: with three, the search never timed
# the best's other neighbour (MLP per-example gradients, bench/bench_autotune.py:
# 16, 64, 256 timed where 128 was fastest); its planning went from 2.3-2.7 to 2.3-3.5 s.
MAX_COMPILES = 4
HEADROOM = 0.05  # estimated bytes plus 5% must fit the budget
# Re-timing (_retime): the RETIME_TOP fastest timed sizes within RETIME_WITHIN times
# the fastest are timed again, one run each per round, for up to RETIME_ROUNDS
# interleaved rounds; no round is started that would take re-timing past
# RETIME_SECONDS (the first always runs).
RETIME_TOP = 3
RETIME_WITHIN = 2.0
RETIME_ROUNDS = 5
RETIME_SECONDS = 0.5
_clock = time.perf_counter


class BudgetError(MemoryError):
    """Even one row of the chunk program does not fit the memory budget."""


_MEMORY: dict[str, Decision] = {}


def clear_cache() -> None:
    """Forget the decisions cached in memory (the disk cache is left alone)."""
    _MEMORY.clear()


def choose(call: Call, n: int, platform: str) -> Decision:
    """The chunk size for ``call`` over ``n`` rows on ``platform`` (see module doc)."""
    start = time.perf_counter()
    opts = _config.current()
    budget, source = budget_in_force(opts, platform)
    prog = ChunkProgram(call, n, opts)
    sizes = _sizes(n, allow_single=not (prog.differentiated and opts.remat))
    key = prog.key(budget, platform, _key_text)
    hit = _lookup(key, opts.autotune_cache, n, budget)
    if hit is not None:
        return dataclasses.replace(hit, seconds=time.perf_counter() - start)
    if platform != jax.default_backend():
        decision = _unmeasured(n, budget, source, prog, platform)
    else:
        decision = _search(prog, n, sizes, budget, source)
    decision = dataclasses.replace(decision, seconds=time.perf_counter() - start)
    _store(key, decision, opts.autotune_cache)
    return decision


def _sizes(n: int, allow_single: bool) -> list[int]:
    """Powers of two from 16 (or 1 for small ``n``) below ``n``, then ``n`` itself
    when one unchunked call has the measured program's memory."""
    low = SMALLEST if n > SMALLEST else 1
    sizes = [2**k for k in range(int(math.log2(low)), 63) if 2**k < n]
    if allow_single or not sizes:
        sizes.append(n)
    return sizes


def _search(prog: ChunkProgram, n: int, sizes: list[int], budget: int, source: str) -> Decision:
    """At most ``MAX_COMPILES`` chunk programs: the smallest size, a second probe
    (the memory model's second point), then a search one power of two at a time towards the
    faster side, among the sizes the model fits under the budget."""
    mem: dict[int, int] = {}
    secs: dict[int, float] = {}

    def measure(rows: int) -> int:
        if rows not in mem:
            mem[rows] = prog.bytes(rows)
        return mem[rows]

    def fits_measured(rows: int) -> bool:
        return measure(rows) * (1 + HEADROOM) <= budget

    if not fits_measured(sizes[0]):
        small = [2**k for k in range(int(math.log2(sizes[0]))) if 2**k < n]
        if not small or not fits_measured(1):
            held = prog.held()  # (for all n rows: the outputs' cotangents)
            one = (measure(1) if small else mem[sizes[0]]) - held
            also = f", and {fmt_bytes(held)} for the outputs' cotangents" if held else ""
            raise BudgetError(
                f"batch_size='auto': one row needs {fmt_bytes(one)} of compiled temporary "
                f"memory ({prog.grad_text()}){also}; the memory budget is {fmt_bytes(budget)} "
                f"({source}), of which {1 - 1 / (1 + HEADROOM):.0%} is kept as headroom. "
                "Raise it with adv_jax_math.config(memory_budget=...) or "
                "ADV_JAX_MATH_MEMORY_BUDGET"
            )
        sizes = small
    lo = sizes[0]
    # Second probe: proportional memory (over-estimating the per-row cost) says which
    # sizes surely fit; take the largest of them, at most 16 times the first size.
    reach = min(lo * budget / (measure(lo) * (1 + HEADROOM)), lo * SECOND_PROBE // SMALLEST)
    probe = [s for s in sizes if lo < s <= reach] or sizes[1:2]
    if probe:
        measure(probe[-1])
    fixed, per_row = _fit(mem)

    def estimate(rows: int) -> int:
        return mem.get(rows, int(fixed + per_row * rows))

    def fits(rows: int) -> bool:
        return estimate(rows) * (1 + HEADROOM) <= budget

    def timed(rows: int) -> float | None:
        """Whole-call seconds at ``rows`` (compiled and checked first); None if over."""
        if rows not in secs:
            if not fits_measured(rows):
                return None
            secs[rows] = prog.seconds(rows)
        return secs[rows]

    for rows in sorted(mem):
        if rows in sizes:
            timed(rows)
    while len(mem) < MAX_COMPILES:
        ok = [s for s in sizes if fits(s)]
        if _next_size(ok, secs) is None:
            break
        # One more run of the fastest sizes, side by side: a burst of load in one first
        # timing steered the search away (MLP gradients: 256 rows 1.4x slow, 32 next).
        _retime(prog, secs, rounds=min(1, RETIME_ROUNDS))
        nxt = _next_size(ok, secs)
        if nxt is None:  # the fastest is now one whose neighbours are all timed
            break
        if timed(nxt) is None:  # the model was optimistic: refit through the largest sizes
            fixed, per_row = _fit(mem, upper=True)
    retimed, rounds = _retime(prog, secs)
    ranked = sorted(secs, key=lambda r: secs[r])
    best = ranked[0]
    cands = tuple(Candidate(s, estimate(s), s in mem, fits(s), secs.get(s)) for s in sizes)
    why = f"{best} rows: the fastest of {len(secs)} timed sizes that fit"
    if rounds:
        sizes_text = ", ".join(map(str, sorted(retimed)))
        why += (
            f"; {sizes_text} rows timed again interleaved, {rounds} "
            f"round{'s' if rounds > 1 else ''}, the fastest run of each kept"
        )
    if len(ranked) > 1:
        r = ranked[1]
        why += f" ({secs[best] * 1e3:.2f} ms per call vs {secs[r] * 1e3:.2f} ms at {r} rows)"
    above = [s for s in sizes if s > best]
    if above and not fits(above[0]):
        why += f"; {above[0]} rows would exceed the budget"
    return Decision(
        best, n, budget, source, int(fixed), float(per_row), cands, prog.grad_text(), why
    )


def _retime(
    prog: ChunkProgram, secs: dict[int, float], rounds: int | None = None
) -> tuple[list[int], int]:
    """Time the fastest sizes of ``secs`` again, side by side: the ``RETIME_TOP``
    fastest within ``RETIME_WITHIN`` times the fastest. Each round times one run of
    each of them (``prog.seconds``, which keeps each size's fastest run, the
    search's included), in the previous round's order reversed, so that load from
    other processes hits them alike. At most ``rounds`` (``RETIME_ROUNDS``) rounds; one starts
    only if re-timing, with one more round as long as the last, stays within
    ``RETIME_SECONDS`` (the first always runs). Returns the sizes re-timed and the
    number of rounds (none when fewer than two sizes qualify)."""
    fastest = min(secs.values(), default=0.0)
    ranked = sorted(secs, key=lambda r: secs[r])
    order = [r for r in ranked if secs[r] <= RETIME_WITHIN * fastest][:RETIME_TOP]
    if len(order) < 2:
        return order, 0
    start, last, done = _clock(), 0.0, 0
    limit = RETIME_ROUNDS if rounds is None else rounds
    while done < limit and (done == 0 or _clock() - start + last <= RETIME_SECONDS):
        t0 = _clock()
        for rows in order:
            secs[rows] = prog.seconds(rows, spend=0.0, runs=1)
        last, done, order = _clock() - t0, done + 1, order[::-1]
    return sorted(order), done


def _next_size(ok: list[int], secs: dict[int, float]) -> int | None:
    """The untimed size next to the fastest timed one, on the side whose timed
    neighbour (or end) is faster, an unexplored end counting as fast. (Jumping to a
    gap's log-scale middle timed 16, 256, 1024, 64 rows, never 128, the fastest.)"""
    timed = [s for s in ok if s in secs]
    if not timed:
        return ok[0] if ok else None
    best = min(timed, key=lambda s: secs[s])
    i = ok.index(best)
    options = []
    for step in (-1, 1):
        gap, j = [], i + step
        while 0 <= j < len(ok) and ok[j] not in secs:
            gap.append(ok[j])
            j += step
        if gap:
            bound = secs[ok[j]] if 0 <= j < len(ok) else secs[best]
            options.append((bound, -step, gap[0]))
    return min(options)[2] if options else None


def _fit(mem: dict[int, int], upper: bool = False) -> tuple[float, float]:
    """``bytes = a + b * rows`` through the two smallest measured sizes (the two
    largest with ``upper``); a constant for one point."""
    pts = sorted(mem.items())
    if len(pts) < 2:
        return float(pts[0][1]), 0.0
    (r0, m0), (r1, m1) = pts[-2:] if upper else pts[:2]
    b = max((m1 - m0) / (r1 - r0), 0.0)
    return max(m0 - b * r0, 0.0), b


def _unmeasured(n: int, budget: int, source: str, prog: ChunkProgram, platform: str) -> Decision:
    """Lowering for another platform (an abstract mesh): nothing can be run here."""
    rows = min(n, 1024)
    why = (
        f"{rows} rows: the call is lowered for {platform!r} from a {jax.default_backend()!r} "
        "process, where chunk programs cannot be compiled and timed; a fixed default"
    )
    return Decision(rows, n, budget, source, 0, 0.0, (), prog.grad_text(), why)


def _key_text(parts: list[Any]) -> str:
    text = re.sub(r"0x[0-9a-fA-F]+", "", repr(parts))
    return hashlib.sha256(text.encode()).hexdigest()


def _read(path: str) -> tuple[dict, str | None]:
    """The entries of the cache file (none when it does not exist yet), and why the
    file is unusable (None when it is usable)."""
    if not os.path.exists(path):
        return {}, None
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        return {}, f"it cannot be read: {e}"
    except ValueError as e:
        return {}, f"it is not JSON: {e}"
    if not isinstance(data, dict):
        return {}, f"it holds a JSON {type(data).__name__}, not an object of entries"
    return data, None


def _lookup(key: str, path: str | None, n: int, budget: int) -> Decision | None:
    if key in _MEMORY:
        return dataclasses.replace(_MEMORY[key], cache="memory cache hit")
    if not path:
        return None
    entries, problem = _read(path)
    if problem is not None:
        warnings.warn(
            f"autotune cache {path!r} is unusable ({problem}); it is left as it is and "
            "batch_size='auto' decisions are kept in memory only: fix or delete the file",
            UserWarning,
            stacklevel=2,
        )
        return None
    if key not in entries:
        return None
    try:
        decision = Decision.from_json(entries[key], n, budget)
    except ValueError as e:
        warnings.warn(
            f"autotune cache {path!r}: entry {key!r} is unusable ({e}); the decision is "
            "recomputed and replaces it",
            UserWarning,
            stacklevel=2,
        )
        return None
    decision = dataclasses.replace(decision, cache="disk cache hit")
    _MEMORY[key] = decision
    return decision


def _store(key: str, decision: Decision, path: str | None) -> None:
    """Keep ``decision`` in memory and, with ``path``, in the file: its other entries
    are kept; a file that is unusable (see :func:`_read`) is not rewritten."""
    _MEMORY[key] = decision
    if not path:
        return
    entries, problem = _read(path)
    if problem is not None:  # _lookup has warned
        return
    entries[key] = decision.to_json()
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        warnings.warn(
            f"autotune cache {path!r}: the decision cannot be saved ({e}); it is kept in "
            "memory only. Check the file's directory, or set config(autotune_cache=...) / "
            "ADV_JAX_MATH_AUTOTUNE_CACHE to a writable file",
            UserWarning,
            stacklevel=2,
        )
