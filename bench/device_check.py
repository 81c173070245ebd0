"""Time the fused Pallas kernel against the scan engine and plain XLA on one GPU.

Run by ``bench/device_check.sh`` (which also sets up jax for CUDA and runs the
tests). Workloads:

(a) an elementwise ``x + 1`` reduced with add and with logsumexp over 1 GiB of
    float32 (memory bound: achieved bandwidth against the device's peak);
(b) an N-body style pairwise sum: the field of N sources at M targets, summed
    over the sources (compute bound: pair interactions per second).

Engines: ``fused`` (``_pallas.fused_reduce``), ``batch_map[pallas]`` and
``batch_map[scan]`` (the library's dispatch, when ``adv_jax_math.batch_map`` is
there; otherwise a ``lax.scan`` over chunks stands in for the scan engine) and
``xla`` (the unchunked computation). ``--interpret`` runs tiny sizes in Pallas
interpret mode, to check this script without a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import adv_jax_math as ajm
from adv_jax_math import _pallas
from adv_jax_math._monoid import ADD, LOGSUMEXP, MonoidReduction

PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s, datasheets


def peak_bandwidth(default: float) -> tuple[float, str]:
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_BANDWIDTH.items():
        if name in kind:
            return peak, kind
    return default, kind


def timed(f: Callable, *args: Any, reps: int) -> tuple[float, Any]:
    """Median seconds per call after compiling and one warm-up call."""
    out = jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def scan_standin(fun: Callable, x: Any, reduction: MonoidReduction, batch_size: int) -> Any:
    """A ``lax.scan`` over chunks of ``batch_size`` rows (n divisible), seeded by chunk 0."""
    chunks = jax.tree.map(lambda a: a.reshape(-1, batch_size, *a.shape[1:]), x)
    first = reduction.reduce_chunk(fun(jax.tree.map(lambda a: a[0], chunks)))

    def step(carry, chunk):
        return reduction.combine(carry, reduction.reduce_chunk(fun(chunk))), None

    out, _ = lax.scan(step, first, jax.tree.map(lambda a: a[1:], chunks))
    return out


def engines(
    fun: Callable,
    reduction: MonoidReduction,
    combine: Callable,
    chunk_reduction: Callable,
    batch_size: int,
    interpret: bool,
) -> dict[str, Callable]:
    """name -> jitted function of the data, all computing ``reduction`` of ``fun``."""
    out = {
        "fused": lambda x: _pallas.fused_reduce(
            fun, x, reduction, max_rows=None, interpret=interpret
        ),
    }
    if hasattr(ajm, "batch_map") and hasattr(ajm, "config"):

        def via(backend: str) -> Callable:
            def run(x):
                with ajm.config(backend=backend):  # read while tracing
                    return ajm.batch_map(
                        fun, x, batch_size, reduction=combine, chunk_reduction=chunk_reduction
                    )

            return run

        out["batch_map[interpret]" if interpret else "batch_map[pallas]"] = via(
            "interpret" if interpret else "pallas"
        )
        out["batch_map[scan]"] = via("scan")
    else:
        out["lax.scan stand-in"] = lambda x: scan_standin(fun, x, reduction, batch_size)
    out["xla"] = lambda x: reduction.reduce_chunk(fun(x))
    return {name: jax.jit(f) for name, f in out.items()}


def report(
    title: str,
    fns: dict[str, Callable],
    data: Any,
    *,
    nbytes: int,
    peak: float,
    reps: int,
    work: tuple[float, str] | None = None,
) -> None:
    print(f"\n## {title}")
    header = (
        "| engine | ms | GB/s | of peak |" + (f" {work[1]} |" if work else "") + " max rel err |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    reference = None
    for name, f in reversed(list(fns.items())):  # xla first: the reference
        try:
            seconds, out = timed(f, data, reps=reps)
        except Exception as e:  # report and go on: one engine failing is a result too
            print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:200]} |")
            continue
        out = np.asarray(jax.tree.leaves(out)[0], np.float64)
        if reference is None:
            reference = out
        err = np.max(np.abs(out - reference) / np.maximum(np.abs(reference), 1e-30))
        rate = nbytes / seconds
        extra = f" {work[0] / seconds:.3e} |" if work else ""
        print(
            f"| {name} | {seconds * 1e3:.3f} | {rate / 1e9:.1f} | {rate / peak:.1%} |{extra}"
            f" {err:.1e} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true", help="tiny sizes, interpret mode")
    parser.add_argument("--peak", type=float, default=4.8e12, help="peak bytes/s if unknown")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if not args.interpret and jax.default_backend() != "gpu":
        raise SystemExit(f"no GPU: jax.devices() = {jax.devices()}; use --interpret on CPU")
    peak, kind = peak_bandwidth(args.peak)
    print(f"jax {jax.__version__} on {kind}; peak bandwidth {peak / 1e12:.2f} TB/s")

    # (a) elementwise + reduction over 1 GiB of float32
    n = 1 << (12 if args.interpret else 28)
    batch = n >> 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    add_one = lambda v: v + 1.0
    for reduction, combine, chunk_reduction in [
        (MonoidReduction(ADD, None), jnp.add, jnp.sum),
        (MonoidReduction(LOGSUMEXP, None), jnp.logaddexp, jax.nn.logsumexp),
    ]:
        rows = _pallas.kernel_block_rows(add_one, x, reduction, platform="gpu", max_rows=None)
        fns = engines(add_one, reduction, combine, chunk_reduction, batch, args.interpret)
        title = f"x + 1, {reduction} over {x.nbytes / 2**30:.2f} GiB (Triton block {rows} rows)"
        report(title, fns, x, nbytes=x.nbytes, peak=peak, reps=args.reps)

    # (b) N-body: field of N sources (positions padded to 4 coordinates) at M targets
    n_src, n_tgt = (1 << 10, 1 << 6) if args.interpret else (1 << 18, 1 << 11)
    key_t, key_s, key_m = jax.random.split(jax.random.key(1), 3)
    targets = jax.random.normal(key_t, (n_tgt, 4)).at[:, 3].set(0.0)
    sources = {
        "pos": jax.random.normal(key_s, (n_src, 4)).at[:, 3].set(0.0),
        "m": jax.random.uniform(key_m, (n_src,)),
    }

    def field(src):
        d = targets[None, :, :] - src["pos"][:, None, :]
        r2 = jnp.sum(d * d, axis=-1, keepdims=True) + 1e-3
        return d * (src["m"][:, None, None] * lax.rsqrt(r2) / r2)

    reduction = MonoidReduction(ADD, 0)
    problem = _pallas.kernel_problem(field, sources, reduction, platform="gpu", max_rows=None)
    rows = _pallas.kernel_block_rows(field, sources, reduction, platform="gpu", max_rows=None)
    print(f"\nN-body kernel_problem: {problem}; Triton block {rows} rows")
    fns = engines(field, reduction, jnp.add, jnp.add.reduce, 1 << 10, args.interpret)
    nbytes = sum(a.nbytes for a in jax.tree.leaves(sources)) + targets.nbytes
    title = f"N-body field: {n_src} sources x {n_tgt} targets, summed over sources"
    pairs = float(n_src) * n_tgt
    report(title, fns, sources, nbytes=nbytes, peak=peak, reps=args.reps, work=(pairs, "pairs/s"))


if __name__ == "__main__":
    main()
