"""Time the fused Pallas kernel against the scan engine and plain XLA on one GPU or TPU.

Run by ``bench/device_check.sh`` (which also sets up jax for CUDA and runs the
tests). Workloads, from ``workloads``:

(a) ``ADD_ONE`` / ``ADD_ONE_LOGSUMEXP``: an elementwise ``x + 1`` reduced with add
    and with logsumexp over 1 GiB of float32 (memory bound: achieved bandwidth
    against the device's peak);
(b) the N-body field (``nbody(law="gravity", dim=4)``: 4 coordinates, the
    power-of-two layout Triton needs) of N sources at M targets, summed over the
    sources (compute bound: pair interactions per second);
(c) ``jax.value_and_grad`` of the roofline cases (``cases/map_reduce.py``,
    ``roofline_*``: a sum differentiated with respect to a closed-over matrix and to
    the mapped inputs, a mixture log-likelihood with respect to its means, a max
    with respect to a closed-over vector), ``batch_map[pallas]`` (the backward
    kernels) against ``batch_map[scan]``, each time printed next to the roofline
    model's (``explain().roofline``);
(d) the pairwise tile kernel on KeOps' Gaussian kernel sum;
(e) ``--matmul`` (alone): issue 41's matrix-unit cases (``pairwise.matmul_grid``):
    attention, forward and ``value_and_grad`` w.r.t. q, k and v, ``ajm.pairwise``
    against ``jax.nn.dot_product_attention`` (XLA; on a GPU also cuDNN's, bfloat16),
    k-NN top-8 at D = 128 and Sinkhorn's logsumexp at D = 64 against the dense XLA
    expression (``--full``: the whole grid, else its quick subset);
(f) ``--gpu-backends`` (alone): the fused kernel built by Pallas Mosaic GPU against
    Pallas Triton's (``config(gpu_backend=...)``) on the workloads of (a) and on two
    of wide rows (a layer ``tanh(x @ w)``, 16 -> 32; ``tanh(x) * x`` over rows of
    8 x 16: Mosaic GPU's element groups), next to the scan engine; then the pairwise
    tile kernel from each, forward and ``value_and_grad``, on a kernel sum, a logsumexp
    and a min-argmin at D = 3 and 16;
(g) ``--heads`` (alone): multi-head attention in ``dot_product_attention``'s
    ``(B, T, N, H)`` layout as the pairwise guide writes it (``jax.vmap`` over B, one
    ``ajm.pairwise`` call with ``softmax_weighted(heads=True)`` for every head, a causal
    mask from the rows' indices) against ``jax.nn.dot_product_attention``, forward
    and the gradient with respect to q, k and v.

Engines: ``fused`` (the kernel alone: ``batch_size = n`` under ``backend="pallas"``,
so the block is the engine's own choice, printed from ``explain``),
``batch_map[pallas]`` and ``batch_map[scan]`` (the library's dispatch) and ``xla``
(the workload's unchunked oracle). Each is compiled once, called twice, then timed
(median of ``--reps``) by ``_timing.measure``. ``--interpret`` runs tiny sizes in
Pallas interpret mode, to check this script without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from _timing import measure
from cases import map_reduce, max_rel_error, pairwise
from cases.workloads import ADD_ONE, ADD_ONE_LOGSUMEXP, LAYER, WIDE, Workload, nbody

import adv_jax_math as ajm
from adv_jax_math.core.devices import DEVICES


def peak_bandwidth(default: float) -> tuple[float, str]:
    """The HBM bandwidth of the device table (``_devices``, the roofline models' own) for
    this device's kind, or of the GPU whose short name it holds ("NVIDIA H100 PCIe")."""
    kind = jax.devices()[0].device_kind
    d = DEVICES.get(kind) or next(
        (d for d in DEVICES.values() if d.platform == "cuda" and d.name in kind), None
    )
    return (default, kind) if d is None else (d.bandwidth, kind)


def engines(w: Workload, params, x, interpret: bool) -> dict[str, Callable]:
    """name -> function of ``(params, x)``, all computing the workload ``w``."""

    def backend(name: str, batch_size: int | None = None) -> Callable:
        def run(fun, x, batch_size, **reduce):
            with ajm.config(backend=name):  # read while tracing
                return ajm.batch_map(fun, x, batch_size, **reduce)

        return w.program(run, batch_size)

    kernel = "interpret" if interpret else "pallas"
    return {
        "fused": backend(kernel, len(jax.tree.leaves(x)[0])),
        f"batch_map[{kernel}]": backend(kernel),
        "batch_map[scan]": backend("scan"),
        "xla": w.oracle(),
    }


def report(
    w: Workload,
    params,
    x,
    *,
    interpret: bool,
    peak: float,
    reps: int,
    work: tuple[float, str] | None = None,
) -> None:
    plan = w.explain(params, x)  # backend "auto": does the library pick the kernel, and why
    rows = plan.block_rows or "-"
    nbytes = sum(a.nbytes for a in jax.tree.leaves((params, x)))
    print(f"\n## {w.name}: {nbytes / 2**30:.3f} GiB of inputs, batch_size {w.batch_size}")
    print(f"auto engine: {plan.engine} ({plan.reason}); kernel block {rows} rows")
    header = (
        "| engine | ms | GB/s | of peak |" + (f" {work[1]} |" if work else "") + " max rel err |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    reference = None
    for name, f in reversed(engines(w, params, x, interpret).items()):  # xla first: the oracle
        try:
            m = measure(f, (params, x), repeats=reps, warmup=2)
        except Exception as e:  # report and go on: one engine failing is a result too
            print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:200]} |")
            continue
        if reference is None:
            reference = m.out
        seconds = m.time.median
        rate = nbytes / seconds
        extra = f" {work[0] / seconds:.3e} |" if work else ""
        print(
            f"| {name} | {seconds * 1e3:.3f} | {rate / 1e9:.1f} | {rate / peak:.1%} |{extra}"
            f" {max_rel_error(m.out, reference):.1e} |",
            flush=True,
        )


def gradients(*, interpret: bool, reps: int) -> None:
    """(c): measured value_and_grad times next to the roofline model's."""
    kernel = "interpret" if interpret else "pallas"
    print("\n## value_and_grad: measured against the roofline model (forward + backward)")
    print("| case | engine | measured ms | model ms (fwd + bwd) |")
    print("|---|---|---|---|")
    for case in [c for c in map_reduce.CASES if c.name.startswith("roofline_")]:
        if interpret:  # tiny: a few blocks
            case = case.at(4 * case.batch_size)
        params, xs = jax.tree.map(jnp.asarray, case.arrays())
        plan = ajm.explain(case.bind(params), xs, case.batch_size, **case.reduction_kwargs)
        model = {"pallas": 0.0, "scan": 0.0}
        for v in plan.roofline:
            model["pallas"] += v.kernel.seconds(v.device)
            model["scan"] += v.scan.seconds(v.device)
        for name in (kernel, "scan"):
            with ajm.config(backend=name):
                f = jax.jit(case.program())
                try:
                    m = measure(f, (params, xs), repeats=reps, warmup=2)
                except Exception as e:  # one engine failing is a result too
                    print(f"| {case.name} | {name} | failed: {type(e).__name__} | |")
                    continue
            modelled = model.get(name)
            shown = f"{modelled * 1e3:.3f}" if plan.roofline and modelled is not None else "-"
            print(f"| {case.name} | {name} | {m.time.median * 1e3:.3f} | {shown} |", flush=True)


def pairwise_sums(*, interpret: bool, reps: int) -> None:
    """(d): KeOps' benchmark, the Gaussian kernel sum ``sum_j exp(-|x_i - y_j|^2 / 0.5) b_j``
    (D = 3, float32): ``ajm.pairwise`` (the tile kernel) against plain XLA over blocks
    of x rows (``lax.map`` of the dense block, about 1 GiB of pairs a block)."""
    f = pairwise.gaussian(p=2.0).f  # y: (points, b)
    print("\n## pairwise Gaussian kernel sum, D = 3, float32")
    print("| N = M | engine | ms | Gpairs/s | max rel err |")
    print("|---|---|---|---|---|")
    for n in (1000,) if interpret else (10**5, 10**6):
        rng = np.random.default_rng(0)
        x, y, b = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((n, 3), (n, 3), (n,)))
        y = (y, b)
        block = max(1, (1 << 28) // n)

        def xla(x, y, block=block):
            row = lambda xi: jnp.sum(jax.vmap(lambda yj: f(xi, yj))(y))
            return jax.lax.map(row, x, batch_size=block)

        def ours(x, y):
            with ajm.config(backend="interpret" if interpret else "auto"):
                return ajm.pairwise(f, x, y, ajm.ADD)

        with ajm.config(backend="interpret" if interpret else "auto"):
            plan = ajm.explain_pairwise(f, x, y, ajm.ADD)
        print(f"<!-- N = {n}: {plan.engine}, tiles {plan.tiles} -->")
        reference = None
        for name, fun in (("xla (blocks of x)", xla), (f"pairwise: {plan.engine}", ours)):
            try:
                slow = name.startswith("xla") and n > 10**5  # about 12 s a call on a v5e
                m = measure(jax.jit(fun), (x, y), repeats=1 if slow else reps, warmup=1)
            except Exception as e:  # one engine failing is a result too
                print(f"| {n} | {name} | failed: {type(e).__name__}: {str(e)[:200]} | | |")
                continue
            reference = m.out if reference is None else reference
            seconds = m.time.median
            print(
                f"| {n} | {name} | {seconds * 1e3:.2f} | {float(n) * n / seconds / 1e9:.1f} |"
                f" {max_rel_error(m.out, reference):.1e} |",
                flush=True,
            )


def _dense(case, x, y):
    """The dense XLA expression of a matrix-unit case (attention: ``dot_product_attention``)."""
    if case.name == "attention":
        k, v = y
        one = lambda a: a[None, :, None, :]  # (batch, rows, heads, d)
        out = jax.nn.dot_product_attention(one(x), one(k), one(v), scale=x.shape[1] ** -0.5)
        return out[0, :, 0, :]
    points = y[0] if case.name == "sinkhorn" else y
    # at full precision, as ajm.pairwise's expanded distances (a TPU's default is one
    # bfloat16 pass: Sinkhorn's exponents then err by ~10 at D = 64)
    xy = jnp.matmul(x, points.T, precision=jax.lax.Precision.HIGHEST)
    d2 = (x * x).sum(1)[:, None] + (points * points).sum(1)[None, :] - 2 * xy
    if case.name == "sinkhorn":
        return jax.nn.logsumexp((y[1][None, :] - d2) / pairwise.EPS, axis=1)
    return -jax.lax.top_k(-d2, 8)[0]  # the 8 smallest distances, ascending


def _arrays(structs):
    """Normal samples of the ``ShapeDtypeStruct``s' shapes and dtypes."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), structs)


def _engines(case, x, y, cudnn: bool) -> dict[str, Callable]:
    """name -> function of ``(x, y)``: dense XLA (first: the reference), ``ajm.pairwise``
    (k-NN: its distances), and (``cudnn``, attention) cuDNN's ``dot_product_attention``."""
    ours = lambda x, y: ajm.pairwise(case.f, x, y, case.reduction)
    mine = (lambda x, y: ours(x, y)[0]) if case.name == "knn_top8" else ours
    plan = ajm.explain_pairwise(case.f, x, y, case.reduction)
    engines = {"xla (dense)": lambda x, y: _dense(case, x, y), f"pairwise: {plan.engine}": mine}
    if cudnn and case.name == "attention":
        scale = x.shape[1] ** -0.5
        one = lambda a: a[None, :, None, :]
        engines["cudnn"] = lambda q, kv: jax.nn.dot_product_attention(
            one(q), one(kv[0]), one(kv[1]), scale=scale, implementation="cudnn"
        )[0, :, 0, :]
    return engines


def matrix_units(*, interpret: bool, reps: int, full: bool) -> None:
    """(e): ``ajm.pairwise`` on issue 41's matrix-unit cases against dense XLA."""
    gpu = jax.default_backend() == "gpu"
    print("\n## matrix-unit cases (issue 41): ajm.pairwise against dense XLA")
    print("| case | dtype | N x M, d | pass | engine | ms | TFLOP/s (attention) | max rel err |")
    print("|---|---|---|---|---|---|---|---|")
    grid = pairwise.matmul_grid(quick=not full)
    if interpret:  # tiny, on the CPU: one of each case
        grid = [dataclasses.replace(p, n=257, m=515) for p in grid[:1] + grid[-2:]]
    for point in grid:
        case, n, m, d = point.case, point.n, point.m, point.d
        x, y = _arrays(case.inputs(n, m, d))
        engines = _engines(case, x, y, cudnn=gpu and point.dtype == "bfloat16")
        passes = {"forward": 1.0}
        if case.name != "knn_top8":
            passes["value_and_grad"] = 2.5  # FlashAttention's count for the backward
        for name_pass, bwd in passes.items():
            reference = None
            for name, fun in engines.items():
                if name_pass == "value_and_grad":
                    fun = jax.value_and_grad(
                        lambda x, y, fun=fun: jnp.sum(fun(x, y).astype(jnp.float32)), (0, 1)
                    )
                try:
                    meas = measure(jax.jit(fun), (x, y), repeats=reps, warmup=1)
                except Exception as e:  # one engine failing is a result too
                    err = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    print(f"| {case.name} | {point.dtype} | {n} x {m}, {d} | {name_pass} | "
                          f"{name} | failed: {err} | | |", flush=True)  # fmt: skip
                    continue
                reference = meas.out if reference is None else reference
                seconds = meas.time.median
                flops = 4.0 * n * m * d * (1 + (bwd if name_pass != "forward" else 0))
                rate = f"{flops / seconds / 1e12:.3g}" if case.name == "attention" else "-"
                print(
                    f"| {case.name} | {point.dtype} | {n} x {m}, {d} | {name_pass} | {name} | "
                    f"{seconds * 1e3:.3f} | {rate} | {max_rel_error(meas.out, reference):.1e} |",
                    flush=True,
                )


def gpu_backends(*, interpret: bool, peak: float, reps: int) -> None:
    """(f): the same fused kernel from Mosaic GPU and from Triton, forced in turn."""
    kernel = "interpret" if interpret else "pallas"
    print("\n## Pallas Mosaic GPU against Pallas Triton (the fused kernel alone)")
    print("| workload | backend | block | ms | GB/s | of peak | max rel err |")
    print("|---|---|---|---|---|---|---|")
    for w in (ADD_ONE, ADD_ONE_LOGSUMEXP, LAYER, WIDE):  # (the last two: element groups)
        n = 1 << 12 if interpret else w.sizes[0]
        params, x = w.inputs(n)
        nbytes = sum(a.nbytes for a in jax.tree.leaves((params, x)))
        reference = measure(w.oracle(), (params, x), repeats=1, warmup=1).out
        for gpu in ("mosaic_gpu", "triton", "scan"):
            options = (
                {"backend": "scan"} if gpu == "scan" else {"backend": kernel, "gpu_backend": gpu}
            )

            def run(fun, x, batch_size, options=options, **reduce):
                with ajm.config(**options):  # read while tracing
                    return ajm.batch_map(fun, x, batch_size, **reduce)

            try:
                with ajm.config(**options):
                    block = w.explain(params, x).block_rows or "-"
                m = measure(w.program(run, n), (params, x), repeats=reps, warmup=2)
            except Exception as e:  # one backend failing is a result too
                print(f"| {w.name} | {gpu} | failed: {type(e).__name__}: {str(e)[:160]} |")
                continue
            rate = nbytes / m.time.median
            print(
                f"| {w.name} | {gpu} | {block} | {m.time.median * 1e3:.3f} | {rate / 1e9:.1f} "
                f"| {rate / peak:.1%} | {max_rel_error(m.out, reference):.1e} |",
                flush=True,
            )


def pairwise_backends(*, interpret: bool, reps: int) -> None:
    """(f), the pairwise tile kernel: forward and ``value_and_grad`` (w.r.t. x and y)
    of KeOps' Gaussian kernel sum, a logsumexp and a min-argmin at N = M = 1e5, D = 3
    and 16, the kernel from Mosaic GPU and from Triton (each row's engine and tiles from
    ``explain_pairwise``); the errors against Mosaic GPU's forward."""
    kernel = "interpret" if interpret else "auto"
    named = {c.name: c for c in pairwise.REDUCTIONS}
    cases = [pairwise.gaussian(p=2.0), named["logsumexp"], named["min_argmin"]]
    print("\n## Pallas Mosaic GPU against Pallas Triton (the pairwise tile kernel)")
    print("| case | N = M, D | pass | backend | engine, tiles | ms | Gpairs/s | max rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for case, d in ((c, d) for c in cases for d in (3, 16)):
        n = 128 if interpret else 100_000
        x, y = _arrays(case.inputs(n, n, d))
        reference = {}
        for gpu in ("mosaic_gpu", "triton"):
            options = {"backend": kernel, "gpu_backend": gpu}

            def forward(x, y, case=case, options=options):
                with ajm.config(**options):  # read while tracing
                    out = ajm.pairwise(case.f, x, y, case.reduction)
                return [v for v in jax.tree.leaves(out) if v.dtype == jnp.float32]

            loss = lambda x, y, forward=forward: sum(jnp.sum(v) for v in forward(x, y))
            with ajm.config(**options):
                plan = ajm.explain_pairwise(case.f, x, y, case.reduction)
            passes = (("forward", forward), ("value_and_grad", jax.value_and_grad(loss, (0, 1))))
            for name, fun in passes:
                try:
                    m = measure(jax.jit(fun), (x, y), repeats=reps, warmup=1)
                except Exception as e:  # one backend failing is a result too
                    print(f"| {case.name} | {n}, {d} | {name} | {gpu} | failed: {e!s:.160} |")
                    continue
                ref = reference.setdefault(name, m.out)
                seconds = m.time.median
                print(
                    f"| {case.name} | {n}, {d} | {name} | {gpu} | {plan.engine}, {plan.tiles} "
                    f"| {seconds * 1e3:.3f} | {float(n) * n / seconds / 1e9:.1f} "
                    f"| {max_rel_error(m.out, ref):.1e} |",
                    flush=True,
                )


def multi_head(q, k, v, causal: bool, explain: bool = False):
    """The pairwise guide's multi-head attention (``tests/test_heads.py``'s);
    ``explain``: ``explain_pairwise`` of its first batch row instead."""
    t, scale = jnp.arange(q.shape[1]), q.shape[-1] ** -0.5

    def f(qi, kvj):
        (qh, i), (kh, vh, j) = qi, kvj
        s = jnp.einsum("nh,nh->n", qh, kh, preferred_element_type=jnp.float32) * scale
        return (jnp.where(j <= i, s, -jnp.inf) if causal else s), vh

    heads = ajm.softmax_weighted(heads=True)
    if explain:
        return ajm.explain_pairwise(f, (q[0], t), (k[0], v[0], t), heads)
    one = lambda q, k, v: ajm.pairwise(f, (q, t), (k, v, t), heads)
    return jax.vmap(one)(q, k, v)


def heads(*, interpret: bool, reps: int) -> None:
    """(g): multi-head attention through one pairwise call against XLA's."""
    print("\n## multi-head attention: ajm.pairwise(heads=True) against dot_product_attention")
    print("| B, T, N, H | dtype | causal | pass | engine | ms | max rel err |")
    print("|---|---|---|---|---|---|---|")
    shapes = [(1, 300, 2, 16)] if interpret else [(1, 8192, 8, 64), (2, 4096, 8, 128)]
    for b, t, n, h in shapes:
        for dtype in (jnp.bfloat16, jnp.float32):
            q, k, v = _arrays([jax.ShapeDtypeStruct((b, t, n, h), dtype)] * 3)
            for causal in (False, True):
                engines = {
                    "xla": lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                        q, k, v, is_causal=c
                    ),
                    "pairwise": lambda q, k, v, c=causal: multi_head(q, k, v, c),
                }
                plan = multi_head(q, k, v, causal, explain=True)
                engines[f"pairwise: {plan.engine}"] = engines.pop("pairwise")
                for name_pass in ("forward", "value_and_grad"):
                    reference = None
                    for name, fun in engines.items():
                        if name_pass == "value_and_grad":
                            fun = jax.value_and_grad(
                                lambda q, k, v, fun=fun: jnp.sum(fun(q, k, v).astype(jnp.float32)),
                                (0, 1, 2),
                            )
                        row = f"| {b}, {t}, {n}, {h} | {jnp.dtype(dtype).name} | {causal} | "
                        row += f"{name_pass} | {name} | "
                        try:
                            meas = measure(jax.jit(fun), (q, k, v), repeats=reps, warmup=1)
                        except Exception as e:  # one engine failing is a result too
                            print(row + f"failed: {type(e).__name__}: {str(e)[:160]} | |")
                            continue
                        reference = meas.out if reference is None else reference
                        err = max_rel_error(meas.out, reference)
                        print(row + f"{meas.time.median * 1e3:.3f} | {err:.1e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true", help="tiny sizes, interpret mode")
    h200 = DEVICES["NVIDIA H200"].bandwidth
    parser.add_argument("--peak", type=float, default=h200, help="peak bytes/s if unknown")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--matmul", action="store_true", help="only (e), the matrix units")
    parser.add_argument("--full", action="store_true", help="(e): the whole grid")
    parser.add_argument("--gpu-backends", action="store_true", help="only (f)")
    parser.add_argument("--heads", action="store_true", help="only (g), multi-head attention")
    args = parser.parse_args()
    if not args.interpret and jax.default_backend() not in ("gpu", "tpu"):
        raise SystemExit(f"no GPU or TPU: jax.devices() = {jax.devices()}; use --interpret")
    peak, kind = peak_bandwidth(args.peak)
    print(f"jax {jax.__version__} on {kind}; peak bandwidth {peak / 1e12:.2f} TB/s")
    common = {"interpret": args.interpret, "peak": peak, "reps": args.reps}
    if args.matmul:  # (e) alone: device_check*.sh run it as a step of its own
        matrix_units(interpret=args.interpret, reps=args.reps, full=args.full)
        return
    if args.heads:  # (g) alone, as (e)
        heads(interpret=args.interpret, reps=args.reps)
        return
    if args.gpu_backends:  # (f) alone, as (e)
        gpu_backends(interpret=args.interpret, peak=peak, reps=args.reps)
        pairwise_backends(interpret=args.interpret, reps=args.reps)
        return

    # (a) x + 1 reduced over 1 GiB of float32, chunks of 1/16 of it
    n = 1 << (12 if args.interpret else 28)
    for w in (ADD_ONE, ADD_ONE_LOGSUMEXP):
        report(w.replace(batch_size=n >> 4), *w.inputs(n), **common)

    # (b) N-body field: N sources at M targets, summed over the sources
    n_src, n_tgt = (1 << 10, 1 << 6) if args.interpret else (1 << 18, 1 << 11)
    w = nbody(law="gravity", dim=4, n_targets=n_tgt, sizes=(n_src,))
    pairs = float(n_src) * n_tgt
    report(w, *w.inputs(), work=(pairs, "pairs/s"), **common)

    # (c) gradients: backward kernels against the scan engine, next to the model
    gradients(interpret=args.interpret, reps=args.reps)

    # (d) the pairwise tile kernel on KeOps' Gaussian kernel sum
    pairwise_sums(interpret=args.interpret, reps=args.reps)


if __name__ == "__main__":
    main()
