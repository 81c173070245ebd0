"""What ``batch_size="auto"`` measures: one chunk's compiled program.

:class:`ChunkProgram` traces ``chunk_reduction(fun(rows))`` at a chunk size, turns
the values it closes over into arguments (placeholders of their avals, so tracers
of an outer ``jit``/``grad``/``vmap`` never leak into the measured program), adds
the VJP with respect to the values being differentiated, compiles it, reports its
bytes and times it on synthetic inputs. Also: the default memory budget.

The compiled program runs any number of chunks one after another in a loop, as the
call does (their outputs summed; the chunks are distinct rows, up to ``STACK_BYTES``
of them, then cycle), and a timed run goes through about ``TIMING_ROWS`` rows
(``long_chunks``). Each run of a
compiled program has a cost of its own, paid once by the call, not once per chunk:
timed one chunk per run, chunks of 16 rows looked 1.8x slower than they run in the
call (2 CPU cores), larger ones less so, which turned the choice. The minimum over
runs is kept: other processes only ever slow a run down.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.call import Call, autodiff_leaves, is_autodiff, is_inexact, tracer_layers
from ..core.config import Options
from ..core.trace import rows_aval

__all__ = [
    "BUDGET_FRACTION",
    "ChunkProgram",
    "budget_in_force",
    "default_budget",
    "fmt_bytes",
    "outer_batch",
]

BUDGET_FRACTION = 0.5  # of the memory free on the target device, by default
TIMING_SECONDS = 0.01  # a size's first timing: runs for this long (at least 2 runs)
TIMING_ROWS = 2048  # a timed run goes through about this many rows (at least one chunk)
STACK_BYTES = 64 << 20  # distinct input rows a timed run cycles through, at most


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def default_budget(platform: str) -> tuple[int, str]:
    """``BUDGET_FRACTION`` of the memory free on the target device, and how it was found."""
    free, where = None, platform
    if platform != "cpu":
        try:
            stats = jax.local_devices(backend=platform)[0].memory_stats() or {}
            if "bytes_limit" in stats:
                free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
                where = f"{platform} device memory_stats()"
        except (RuntimeError, ValueError, IndexError):
            free = None
    if free is None:
        free, where = _host_available(), "available system memory"
    return int(BUDGET_FRACTION * free), f"{BUDGET_FRACTION:.0%} of {fmt_bytes(free)} free ({where})"


def budget_in_force(opts: Options, platform: str) -> tuple[int, str]:
    """``config(memory_budget=...)`` when set, else :func:`default_budget`."""
    if opts.memory_budget:
        return opts.memory_budget, "config"
    return default_budget(platform)


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


def outer_batch(x: Any) -> int:
    """The product of the sizes of the ``vmap`` axes ``x`` is traced under."""
    size = 1
    for t in tracer_layers(x):
        dim, val = getattr(t, "batch_dim", None), getattr(t, "val", None)
        if isinstance(dim, int) and val is not None and 0 <= dim < np.ndim(val):
            size *= int(np.shape(val)[dim])
    return size


def _synthetic(shape: tuple, dtype: Any, rng: np.random.Generator) -> np.ndarray:
    if is_inexact(dtype):
        return rng.uniform(0.5, 1.5, shape).astype(dtype)
    return np.zeros(shape, dtype)


class ChunkProgram:
    """One chunk of ``call`` (``chunk_reduction(fun(rows))``, and its VJP when the
    call is being differentiated) at any number of rows: compiled, sized, timed."""

    def __init__(self, call: Call, n: int, opts: Options):
        self.call, self.n, self.opts = call, n, opts
        leaves = jax.tree.leaves(call.xs)
        self._traces: dict[int, tuple[Any, Any]] = {}
        self.probe_rows = 16 if n > 16 else 1
        consts = self._trace(self.probe_rows)[0].consts
        self.factor = max(outer_batch(v) for v in [*leaves, *consts, 1])
        grad_rows = autodiff_leaves(call.xs) if call.grad_rows is None else call.grad_rows
        self.xdiff = tuple(
            is_inexact(x.dtype) and self._wanted(g) for x, g in zip(leaves, grad_rows, strict=True)
        )
        self.differentiated = any(self.xdiff) or any(self._const_diff(consts))
        self._compiled: dict[int, Any] = {}
        self._args: dict[int, tuple[list, list]] = {}
        self._best: dict[int, float] = {}  # rows: seconds of the fastest timed run

    def _wanted(self, seen: bool) -> bool:
        mode = self.opts.autotune_grad
        return mode == "always" or (mode == "auto" and seen)

    def _const_diff(self, consts: list) -> list[bool]:
        return [is_inexact(jnp.result_type(c)) and self._wanted(is_autodiff(c)) for c in consts]

    def _trace(self, rows: int) -> tuple[Any, Any]:
        if rows not in self._traces:
            fun, chunk_reduction = self.call.fun, self.call.chunk_reduction
            self._traces[rows] = jax.make_jaxpr(
                lambda x: chunk_reduction(fun(x)), return_shape=True
            )(rows_aval(self.call.xs, rows))
        return self._traces[rows]

    def grad_text(self) -> str:
        if not self.differentiated:
            return "forward only"
        how = "one chunk rematerialized" if self.opts.remat else "remat=False"
        return f"forward and backward, {how}"

    def key(self, budget: int, platform: str, hasher: Any) -> str:
        closed, _ = self._trace(self.probe_rows)
        avals = lambda vs: [(tuple(jnp.shape(v)), str(jnp.result_type(v))) for v in vs]
        return hasher(
            [
                str(closed.jaxpr),
                avals(closed.consts),
                self._const_diff(closed.consts),
                avals(jax.tree.leaves(self.call.xs)),
                str(jax.tree.structure(self.call.xs)),
                self.xdiff,
                self.n,
                self.factor,
                budget,
                platform,
                self.opts.remat,
                self.opts.autotune_grad,
                self.call.reduction is None,
                jax.__version__,
            ]
        )

    def _build(self, rows: int) -> tuple[Any, list, list]:
        closed, out_shape = self._trace(rows)
        jaxpr, consts = closed.jaxpr, list(closed.consts)
        cdiff, xdiff = self._const_diff(consts), list(self.xdiff)
        remat = self.opts.remat

        def pick(values: list, mask: list) -> list:
            return [v for v, m in zip(values, mask, strict=True) if m]

        def merge(values: list, new: list, mask: list) -> list:
            it = iter(new)
            return [next(it) if m else v for v, m in zip(values, mask, strict=True)]

        def program(cargs: list, xleaves: list) -> Any:
            def f(dc: list, dx: list) -> list:
                return jax.core.eval_jaxpr(
                    jaxpr, merge(cargs, dc, cdiff), *merge(xleaves, dx, xdiff)
                )

            dc, dx = pick(cargs, cdiff), pick(xleaves, xdiff)
            if not dc and not dx:
                return f([], [])
            out, pull = jax.vjp(jax.checkpoint(f) if remat else f, dc, dx)
            ct = [
                jnp.ones_like(o) if is_inexact(o.dtype) else np.zeros(o.shape, jax.dtypes.float0)
                for o in out
            ]
            return out, pull(ct)

        const_avals = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in consts]
        x_avals = jax.tree.leaves(rows_aval(self.call.xs, rows))
        k = self._stacked(rows)
        stacked = [jax.ShapeDtypeStruct((k, *a.shape), a.dtype) for a in x_avals]

        def chunks(cargs: list, xstack: list, m: Any) -> list:
            """``m`` chunks one after another, their outputs summed."""

            def body(i: Any, acc: list) -> list:
                xleaves = [jax.lax.dynamic_index_in_dim(x, i % k, keepdims=False) for x in xstack]
                out = pick(jax.tree.leaves(program(cargs, xleaves)), summed)
                pairs = zip(acc, out, strict=True)
                return [a | o if a.dtype == bool else a + o for a, o in pairs]

            zeros = [jnp.zeros(o.shape, o.dtype) for o in pick(out_avals, summed)]
            return jax.lax.fori_loop(0, m, body, zeros)

        # program's outputs: the chunk's, then the cotangents of the differentiated values;
        # numbers are summed over the chunks, booleans or-ed (other dtypes are dropped)
        out_avals = [*closed.out_avals, *pick(const_avals, cdiff), *pick(x_avals, xdiff)]
        summed = [o.dtype == bool or jnp.issubdtype(o.dtype, jnp.number) for o in out_avals]
        m_aval = jax.ShapeDtypeStruct((), jnp.int32)
        with jax.ensure_compile_time_eval():
            compiled = jax.jit(chunks).lower(const_avals, stacked, m_aval).compile()
        return compiled, consts, [out_shape, x_avals]

    def chunks(self, rows: int) -> int:
        """Chunks of the call at ``rows`` per chunk."""
        return 1 if rows >= self.n else -(-self.n // rows)

    def long_chunks(self, rows: int) -> int:
        """Chunks of a timed run: about ``TIMING_ROWS`` rows, at least one chunk, at
        most the call's."""
        return max(1, min(self.chunks(rows), TIMING_ROWS // rows))

    def _stacked(self, rows: int) -> int:
        """Distinct chunks of rows the program's input holds (a run cycles through
        them): every chunk of a run, as the call streams through its rows, up to
        ``STACK_BYTES`` of inputs (at least two: the same chunk every time could be
        hoisted out of the loop). Cycling through two chunks only, small chunks ran
        from the L1 cache and won where the call, streaming, loses (MLP per-example
        norms, 16 rows: chosen, 1.37x the fastest size)."""
        long = self.long_chunks(rows)
        if long == 1:
            return 1
        row_bytes = sum(
            math.prod(x.shape[1:]) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(self.call.xs)
        )
        return max(2, min(long, STACK_BYTES // max(1, rows * row_bytes)))

    def compiled(self, rows: int) -> tuple[Any, list, list]:
        if rows not in self._compiled:
            self._compiled[rows] = self._build(rows)
        return self._compiled[rows]

    def bytes(self, rows: int) -> int:
        """Whole-call bytes at ``rows`` per chunk: the chunk program's temporaries,
        outputs and rows, plus what the call holds for all ``n`` rows besides
        (:meth:`held`)."""
        compiled, _, (_, x_avals) = self.compiled(rows)
        ma = compiled.memory_analysis()
        chunk = ma.temp_size_in_bytes + ma.output_size_in_bytes
        chunk += sum(a.size * a.dtype.itemsize for a in x_avals)
        return int(self.factor * chunk) + self.held()

    def held(self) -> int:
        """Bytes the call holds for all ``n`` rows whatever the chunk size: in reverse
        mode, a map's outputs' cotangents twice (carried through the loop over chunks:
        measured 1108 KiB for 512 KiB of outputs). Not counted: a map's outputs (the
        call's results: each chunk is written in place, no copy) and the cotangents of
        differentiated inputs (the gradient's results)."""
        if self.call.reduction is not None or not self.differentiated:
            return 0
        _, out_shape = self._trace(self.probe_rows)
        rows = self.probe_rows
        per_row = sum(
            s.size * s.dtype.itemsize / rows
            for s in jax.tree.leaves(out_shape)
            if s.shape[:1] == (rows,)
        )
        return int(self.factor * 2 * per_row * self.n)

    def _inputs(self, rows: int) -> tuple[list, list]:
        """The program's arguments at ``rows``, on the device: concrete closed-over
        values as they are, synthetic values for the rest (kept, so that timing a
        size again runs on the same inputs)."""
        if rows not in self._args:
            _, consts, (_, x_avals) = self.compiled(rows)
            rng = np.random.default_rng(0)
            with jax.ensure_compile_time_eval():
                cargs = [
                    c
                    if not isinstance(c, jax.core.Tracer)
                    else _synthetic(tuple(c.shape), c.dtype, rng)
                    for c in consts
                ]
                k = self._stacked(rows)
                xargs = [_synthetic((k, *a.shape), a.dtype, rng) for a in x_avals]
                self._args[rows] = jax.device_put((cargs, xargs))
        return self._args[rows]

    def run(self, rows: int, m: int) -> float:
        """Seconds of one run of the program through ``m`` chunks of ``rows``."""
        compiled = self.compiled(rows)[0]
        cargs, xargs = self._inputs(rows)
        with jax.ensure_compile_time_eval():
            count = jax.device_put(np.int32(m))
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(cargs, xargs, count))
            return time.perf_counter() - t0

    def seconds(self, rows: int, spend: float = TIMING_SECONDS, runs: int = 2) -> float:
        """The call's seconds at ``rows`` per chunk, estimated as ``chunks`` times the
        seconds per chunk of the fastest run through ``long_chunks`` chunks: at least
        ``runs`` runs, and more for about ``spend`` seconds; the fastest run of each
        size is kept across calls."""
        long = self.long_chunks(rows)
        spent, done = 0.0, 0
        while done < runs or (spent < spend and done < 50):
            t = self.run(rows, long)
            self._best[rows] = min(self._best.get(rows, t), t)
            spent, done = spent + t, done + 1
        return self.chunks(rows) * self._best[rows] / long
