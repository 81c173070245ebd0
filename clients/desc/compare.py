"""DESC's own chunked computations: DESC's batching helpers vs adv_jax_math's.

Run inside a venv that has desc-opt (whose own ``desc.batching`` must import,
i.e. jax < 0.10) and adv_jax_math. Every workload is computed twice in this
process, once with DESC's helpers and once with ours, in float64; the results
must agree to ``--rtol`` (default 1e-12, relative to the largest magnitude).
Prints compiled temp memory (``memory_analysis().temp_size_in_bytes``), compile
time and run time (min of ``--repeats``) side by side.

Real DESC functions (``biot_savart_general``, ``singular_integral``,
``AutoDiffDerivative``) are run with the helpers swapped in the module globals
DESC bound them to; the rest are DESC-shaped kernels calling the helpers the
way DESC's call sites do.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import adv_jax_math as ajm  # noqa: E402

try:
    import desc.batching as desc_batching  # DESC's own module (not the stand-in)
except ImportError as err:  # jax >= 0.10: DESC's batching imports jax._src.api._vjp
    sys.exit(f"compare.py needs DESC's own desc.batching to import: {err!r}")
assert not getattr(desc_batching, "_ADV_STANDIN", False), "run compare.py without the stand-in"

IMPLS = {
    "desc": {
        "batch_map": desc_batching.batch_map,
        "vmap_chunked": desc_batching.vmap_chunked,
        "batched_vectorize": desc_batching.batched_vectorize,
        "jacfwd_chunked": desc_batching.jacfwd_chunked,
        "jacrev_chunked": desc_batching.jacrev_chunked,
    },
    "ours": {  # the aliases our package is going to export
        "batch_map": ajm.batch_map,
        "vmap_chunked": ajm.batch_vmap,
        "batched_vectorize": ajm.batch_vectorize,
        "jacfwd_chunked": ajm.batch_jacfwd,
        "jacrev_chunked": ajm.batch_jacrev,
    },
}
CALLS = {"desc": 0, "ours": 0}  # proof that a workload really ran each implementation


def _counted(impl, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        CALLS[impl] += 1
        return fn(*args, **kwargs)

    return wrapper


IMPLS = {impl: {k: _counted(impl, f) for k, f in fns.items()} for impl, fns in IMPLS.items()}


@contextlib.contextmanager
def swapped(impl: str, *modules):
    """Rebind the batching names DESC's ``modules`` imported to ``impl``'s."""
    saved = []
    for mod in modules:
        for name, fn in IMPLS[impl].items():
            if hasattr(mod, name):
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, fn)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def measure(make, args, repeats):
    """Trace/compile ``make()`` on ``args``; return (result, temp bytes, compile s, run s)."""
    t0 = time.perf_counter()
    compiled = jax.jit(make()).lower(*args).compile()
    t_compile = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", float("nan")) if mem is not None else float("nan")
    out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return out, temp, t_compile, min(times)


def rel_err(a, b) -> float:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b), "output structures differ"
    worst = 0.0
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, x.dtype, y.shape, y.dtype)
        scale = max(float(np.max(np.abs(y), initial=0.0)), np.finfo(np.float64).tiny)
        worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)) / scale)
    return worst


# --------------------------------------------------------------------------- #
# workloads: name -> (builder(impl) -> fn, args)
# --------------------------------------------------------------------------- #
def wl_biot_savart(n_eval, n_src, chunk):
    """desc.magnetic_fields._core.biot_savart_general (batch_map over eval points)."""
    from desc.magnetic_fields import _core

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    re = jax.random.normal(k[0], (n_eval, 3)) * 2.0
    rs = jax.random.normal(k[1], (n_src, 3))
    J = jax.random.normal(k[2], (n_src, 3))

    def build(impl):
        def f(re, rs, J):
            with swapped(impl, _core):
                return _core.biot_savart_general(re, rs, J, chunk_size=chunk)

        return f

    return build, (re, rs, J)


def wl_biot_savart_grad(n_eval, n_src, chunk):
    """grad of sum |B|^2 w.r.t. source points and currents (reverse mode)."""
    from desc.magnetic_fields import _core

    build_fwd, args = wl_biot_savart(n_eval, n_src, chunk)

    def build(impl):
        f = build_fwd(impl)
        return jax.grad(lambda re, rs, J: jnp.sum(f(re, rs, J) ** 2), argnums=(1, 2))

    del _core
    return build, args


def wl_singular_integral(M, N, chunk):
    """desc.integrals.singular_integral (vmap_chunked with reduction=jnp.add,
    chunk_reduction=lambda x: x.sum(axis=0), and batch_map over eval points)."""
    from desc.equilibrium import Equilibrium
    from desc.grid import LinearGrid
    from desc.integrals import singularities
    from desc.integrals.singularities import FFTInterpolator, _kernel_nr_over_r3

    eq = Equilibrium()
    grid = LinearGrid(M=M, N=N, NFP=eq.NFP)
    interp = FFTInterpolator(grid, grid, 2 * M + 1, 2 * M + 1, 12)
    data = eq.compute([*_kernel_nr_over_r3.keys, "|e_theta x e_zeta|"], grid=grid)
    data = {k: jnp.asarray(v) for k, v in data.items()}

    def build(impl):
        def f(data):
            with swapped(impl, singularities):
                return singularities.singular_integral(
                    data, data, "nr_over_r3", interp, chunk_size=chunk
                )

        return f

    return build, (data,)


def _polar_like(n_eval, n_polar):
    """DESC's _singular_part shape: a sum over polar nodes of (n_eval, 3) kernels."""
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    pts = jax.random.normal(k[0], (n_eval, 3))
    shift = jax.random.normal(k[1], (n_polar, 3)) * 0.1
    w = jax.random.uniform(k[2], (n_polar,))

    def polar_pt(i):
        src = pts + shift[i]
        dr = pts[:, None, :] - src[None, ::7, :]
        r = jnp.linalg.norm(dr, axis=-1, keepdims=True) + 1.0
        return w[i] * jnp.sum(dr / r**3, axis=1)

    return polar_pt, jnp.arange(n_polar)


def wl_vmap_chunked_add_lambda(n_eval, n_polar, chunk):
    """vmap_chunked(polar_pt, chunk_size, reduction=jnp.add,
    chunk_reduction=lambda x: x.sum(axis=0))(jnp.arange(n)) as in _singular_part."""
    polar_pt, idx = _polar_like(n_eval, n_polar)

    def build(impl):
        vc = IMPLS[impl]["vmap_chunked"]
        return vc(
            polar_pt, chunk_size=chunk, reduction=jnp.add, chunk_reduction=lambda x: x.sum(axis=0)
        )

    return build, (idx,)


def wl_batch_map_add_lambda(n_eval, n_polar, chunk):
    """batch_map(vectorized fun, x, chunk, reduction=jnp.add,
    chunk_reduction=lambda x: x.sum(axis=0))."""
    polar_pt, idx = _polar_like(n_eval, n_polar)
    vfun = jax.vmap(polar_pt)

    def build(impl):
        bm = IMPLS[impl]["batch_map"]
        return lambda idx: bm(
            vfun, idx, chunk, reduction=jnp.add, chunk_reduction=lambda x: x.sum(axis=0)
        )

    return build, (idx,)


def _desc_like_residual(n_modes, n_nodes):
    """A DESC-shaped residual R^p -> R^m: Fourier surface, metric, nonlinear force."""
    rng = np.random.default_rng(2)
    theta = jnp.asarray(rng.uniform(0, 2 * np.pi, n_nodes))
    zeta = jnp.asarray(rng.uniform(0, 2 * np.pi, n_nodes))
    m = jnp.arange(n_modes) % 7
    n = jnp.arange(n_modes) // 7 - 3
    basis = jnp.cos(m[None, :] * theta[:, None] - n[None, :] * zeta[:, None])
    x0 = jnp.asarray(rng.normal(size=2 * n_modes)) / (1 + jnp.tile(m + abs(n), 2)) ** 2
    x0 = x0.at[0].add(10.0)

    def residual(x):
        R = basis @ x[:n_modes]
        Z = basis @ x[n_modes:]
        g = R**2 + Z**2 + 1.0
        return jnp.concatenate([jnp.sin(R) * Z / g, jnp.log(g) * R, jnp.tanh(Z) * R**2])

    return residual, x0


def wl_jacfwd(n_modes, n_nodes, chunk):
    """desc.derivatives.AutoDiffDerivative(mode='fwd', chunk_size) -> jacfwd_chunked."""
    from desc import derivatives

    residual, x0 = _desc_like_residual(n_modes, n_nodes)

    def build(impl):
        def f(x):
            with swapped(impl, derivatives):
                return derivatives.AutoDiffDerivative(
                    residual, 0, mode="fwd", chunk_size=chunk
                ).compute(x)

        return f

    return build, (x0,)


def wl_jacrev(n_modes, n_nodes, chunk):
    """desc.derivatives.AutoDiffDerivative(mode='rev', chunk_size) -> jacrev_chunked."""
    from desc import derivatives

    residual, x0 = _desc_like_residual(n_modes, n_nodes)

    def build(impl):
        def f(x):
            with swapped(impl, derivatives):
                return derivatives.AutoDiffDerivative(
                    residual, 0, mode="rev", chunk_size=chunk
                ).compute(x)

        return f

    return build, (x0,)


def wl_hess(n_modes, n_nodes, chunk):
    """AutoDiffDerivative(mode='hess'): jacfwd_chunked(jacrev_chunked(f)) nested."""
    from desc import derivatives

    residual, x0 = _desc_like_residual(n_modes, n_nodes)
    scalar = lambda x: jnp.sum(residual(x) ** 2)

    def build(impl):
        def f(x):
            with swapped(impl, derivatives):
                return derivatives.AutoDiffDerivative(
                    scalar, 0, mode="hess", chunk_size=chunk
                ).compute(x)

        return f

    return build, (x0,)


def wl_batched_vectorize_jvp(n_modes, n_nodes, n_tangents, chunk):
    """ObjectiveFunction.jvp: batched_vectorize(jvpfun, signature='(n)->(k)', chunk)(v)."""
    residual, x0 = _desc_like_residual(n_modes, n_nodes)
    v = jnp.asarray(np.random.default_rng(3).normal(size=(n_tangents, x0.size)))

    def build(impl):
        bv = IMPLS[impl]["batched_vectorize"]

        def f(x, v):
            jvpfun = lambda dx: jax.jvp(residual, (x,), (dx,))[1]
            return bv(jvpfun, signature="(n)->(k)", chunk_size=chunk)(v)

        return f

    return build, (x0, v)


def wl_vmap_chunked_none_axes(n_pts, chunk):
    """Field-line-tracing shape: in_axes=(0,) + k*(None,) with non-array objects
    (a dict of params, a Python callable, an int) in the unmapped slots."""
    k = jax.random.split(jax.random.PRNGKey(4), 2)
    x0 = jax.random.normal(k[0], (n_pts, 3))
    params = {"a": jax.random.normal(k[1], (3,)), "s": 0.5}

    def integrate(x, params, rhs, steps):
        def body(_, x):
            return x + 0.01 * rhs(x, params)

        return jax.lax.fori_loop(0, steps, body, x)

    rhs = lambda x, p: jnp.cross(p["a"], x) * p["s"] - 0.1 * x

    def build(impl):
        vc = IMPLS[impl]["vmap_chunked"]
        return lambda x0, params: vc(integrate, in_axes=(0, None, None, None), chunk_size=chunk)(
            x0, params, rhs, 50
        )

    return build, (x0, params)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rtol", type=float, default=1e-12)
    p.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    p.add_argument("--markdown", help="also write the results as a markdown table here")
    a = p.parse_args()
    q = a.quick
    workloads = {
        "biot_savart_general (batch_map)": wl_biot_savart(
            *((512, 256, 64) if q else (4096, 2048, 256))
        ),
        "grad biot_savart_general": wl_biot_savart_grad(
            *((512, 256, 64) if q else (2048, 2048, 256))
        ),
        "singular_integral nr_over_r3": wl_singular_integral(*((4, 8, 50) if q else (6, 15, 50))),
        "vmap_chunked add + lambda x.sum(0)": wl_vmap_chunked_add_lambda(
            *((256, 100, 30) if q else (1024, 400, 50))
        ),
        "batch_map add + lambda x.sum(0)": wl_batch_map_add_lambda(
            *((256, 100, 30) if q else (1024, 400, 50))
        ),
        "jacfwd_chunked (AutoDiffDerivative fwd)": wl_jacfwd(
            *((35, 200, 16) if q else (140, 2000, 50))
        ),
        "jacrev_chunked (AutoDiffDerivative rev)": wl_jacrev(
            *((35, 200, 16) if q else (140, 2000, 50))
        ),
        "hessian jacfwd(jacrev) chunked": wl_hess(*((21, 100, 8) if q else (70, 500, 25))),
        "batched_vectorize (n)->(k) jvp": wl_batched_vectorize_jvp(
            *((35, 200, 10, 4) if q else (140, 2000, 64, 16))
        ),
        "vmap_chunked in_axes=(0,None,None,None)": wl_vmap_chunked_none_axes(
            *((300, 64) if q else (5000, 512))
        ),
    }
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, x64 on")
    print(f"desc {getattr(sys.modules.get('desc'), '__version__', '?')}, ", end="")
    print(f"adv_jax_math {ajm.__version__} ({ajm.__file__})")
    hdr = (
        f"{'workload':42s} {'rel.err':>9s} | {'temp MiB desc':>13s} {'ours':>8s} | "
        f"{'compile s desc':>14s} {'ours':>6s} | {'run ms desc':>11s} {'ours':>8s} {'ratio':>6s}"
    )
    print(hdr)
    print("-" * len(hdr))
    failures, rows = [], []
    for name, (build, args) in workloads.items():
        res = {}
        for impl in ("desc", "ours"):
            before = CALLS[impl]
            res[impl] = measure(functools.partial(build, impl), args, a.repeats)
            assert CALLS[impl] > before, f"{name}: {impl}'s helpers were never called"
        err = rel_err(res["ours"][0], res["desc"][0])
        d, o = res["desc"], res["ours"]
        flag = "" if err <= a.rtol else "  <-- FAIL"
        print(
            f"{name:42s} {err:9.1e} | {d[1] / 2**20:13.2f} {o[1] / 2**20:8.2f} | "
            f"{d[2]:14.2f} {o[2]:6.2f} | {d[3] * 1e3:11.2f} {o[3] * 1e3:8.2f} "
            f"{o[3] / d[3]:6.2f}{flag}",
            flush=True,
        )
        rows.append(
            f"| {name} | {err:.1e} | {d[1] / 2**20:.1f} → {o[1] / 2**20:.1f} | "
            f"{d[2]:.2f} → {o[2]:.2f} | {d[3] * 1e3:.1f} → {o[3] * 1e3:.1f} |"
        )
        if err > a.rtol:
            failures.append(name)
    if a.markdown:
        head = (
            f"DESC {getattr(sys.modules.get('desc'), '__version__', '?')}, jax {jax.__version__}, "
            f"float64, min of {a.repeats} runs (`clients/desc/compare.py`"
            f"{' --quick' if q else ''}).\n\n"
            "| workload | rel. error | temp MiB, DESC → ours | compile s, DESC → ours "
            "| run ms, DESC → ours |\n|---|---|---|---|---|\n"
        )
        with open(a.markdown, "w") as f:
            f.write(head + "\n".join(rows) + "\n")
    if failures:
        print(f"FAILED (rel.err > {a.rtol:g}): {failures}")
        return 1
    print(f"all {len(workloads)} workloads agree to <= {a.rtol:g} relative")
    return 0


if __name__ == "__main__":
    sys.exit(main())
