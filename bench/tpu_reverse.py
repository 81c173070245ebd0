"""The matmul tiles' reverse pass on a TPU: its kernels against XLA's loops and, for
attention, jax's own Pallas flash attention
(``jax.experimental.pallas.ops.tpu.flash_attention``).

    python bench/tpu_reverse.py [--case attention] [--n 16384] [--d 64]
                                [--tiles 512,1024 256,512]

``--case``: attention (``jax.nn.dot_product_attention`` the reference), knn (the 8
nearest y rows' squared distances, expanded) or sinkhorn (a log-domain half-step at
``y = (points, g)``; both against dense XLA: ``device_check._dense``). For each dtype:
``ajm.pairwise``'s forward; ``jax.value_and_grad`` w.r.t. every input with the
library's choice of reverse pass, with XLA's loops forced, and with the reverse kernels
forced at each ``--tiles`` (also w.r.t. x alone and y alone); jax's flash attention
forward and ``value_and_grad``. Medians (and mins) of ``--reps`` calls, ms, interleaved
round by round; each result checked against the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import traceback

import jax
import jax.numpy as jnp
from _timing import compile_fn, interleaved
from cases import pairwise as cases
from device_check import _dense

import adv_jax_math as ajm
from adv_jax_math.pairs import matmul

KEEP = matmul._reverse_layout


def forced(tiles):
    """``pairs.matmul._reverse_layout`` keeping the kernels on a TPU at ``tiles`` (None:
    XLA's loops)."""

    def layout(conv, red, lay, res, cts, pos):
        if lay.on == "tpu" and tiles is None:
            return dataclasses.replace(lay, on="xla")
        if lay.on == "tpu":
            return dataclasses.replace(lay, tiles=tiles)
        return KEEP(conv, red, lay, res, cts, pos)

    return layout


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="attention", choices=["attention", "knn", "sinkhorn"])
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--tiles", nargs="*", default=["512,1024", "256,512"])
    p.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    p.add_argument("--no-flash", action="store_true", help="without jax's flash attention")
    args = p.parse_args()
    n, d = args.n, args.d
    scale = 1.0 / d**0.5
    case = {"attention": cases.attention(d), "knn": cases.KNN_TOP8, "sinkhorn": cases.SINKHORN}
    case = case[args.case]
    # every function takes the leaves of (x, y): attention's (q, k, v)
    tree = lambda *a: (a[0], a[1]) if args.case == "knn" else (a[0], a[1:])
    first = lambda out: out[0] if args.case == "knn" else out  # k-NN: the distances
    ours = lambda *a: first(ajm.pairwise(case.f, *tree(*a), case.reduction))
    xla = lambda *a: _dense(case, *tree(*a))
    flash = None
    try:
        if args.no_flash or args.case != "attention":
            raise ImportError("--no-flash" if args.no_flash else args.case)
        from jax.experimental.pallas.ops.tpu import flash_attention as fa

        flash = lambda q, k, v: fa.flash_attention(
            q[None, None], k[None, None], v[None, None], sm_scale=scale
        )[0, 0]
    except Exception as e:
        print("no flash attention:", e)
    loss = lambda fn, argnums: jax.value_and_grad(
        lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2), argnums=argnums
    )
    print("jax", jax.__version__, jax.devices()[0].device_kind, f"N = M = {n}, d = {d}")
    x, y = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t) for t in case.inputs(n, n, d))
    print(ajm.explain_pairwise(case.f, x, y, case.reduction))
    for dtype in args.dtypes:
        structs = jax.tree.leaves(dataclasses.replace(case, dtype=dtype).inputs(n, n, d))
        keys = jax.random.split(jax.random.key(0), len(structs))
        inputs = tuple(
            jax.random.normal(kk, s.shape, jnp.float32).astype(s.dtype)
            for kk, s in zip(keys, structs, strict=True)
        )
        every, ys = tuple(range(len(inputs))), tuple(range(1, len(inputs)))
        fns = {"xla forward": (xla, None), "ours forward": (ours, None)}
        fns["xla v&g"] = (loss(xla, every), None)
        fns["ours v&g (default)"] = (loss(ours, every), None)
        fns["ours v&g loops"] = (loss(ours, every), "loops")
        if flash is not None:
            fns["flash forward"] = (flash, None)
            fns["flash v&g"] = (loss(flash, every), None)
        for t in args.tiles:
            tiles = tuple(int(a) for a in t.split(","))
            for name, nums in (("v&g", every), ("dx", (0,)), ("dy", ys)):
                fns[f"ours {name} kernels {tiles}"] = (loss(ours, nums), tiles)
        compiled, ref = {}, {}
        for name, (fn, tiles) in fns.items():
            if tiles is not None:
                matmul._reverse_layout = forced(None if tiles == "loops" else tiles)
            try:
                c = compile_fn(fn, inputs)
            except Exception as e:
                where = traceback.extract_tb(e.__traceback__)[-3:]
                print(f"{dtype} {name}: failed: {str(e).splitlines()[0][:300]} at {where}")
                continue
            finally:
                matmul._reverse_layout = KEEP
            out = jax.block_until_ready(c.executable(*inputs))
            text = c.executable.as_text() or ""
            base = "xla forward" if "forward" in name else "xla v&g"
            ref.setdefault(base, out)
            compiled[name] = c.executable
            print(
                f"{dtype} {name}: compiled {c.seconds:.1f} s, {text.count('tpu_custom_call')} "
                f"kernels, {text.count(' while(')} while loops, max rel err "
                f"{_error(out, ref[base]):.1e}",
                flush=True,
            )
        t = interleaved(compiled, inputs, rounds=args.reps, warmup=1)
        for name, timing in t.items():
            ms = f"{timing.median * 1e3:.2f} | {timing.min * 1e3:.2f}"
            print(f"| {args.case} | {n} | {d} | {dtype} | {name} | {ms} |")


def _error(got, want) -> float:
    """The largest error of ``got``'s leaves relative to the largest of ``want``'s (NaN
    where they hold different leaves: a gradient w.r.t. fewer inputs)."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got) != len(want):
        return float("nan")
    f32 = lambda a: a.astype(jnp.float32)
    return max(
        float(jnp.max(jnp.abs(f32(a) - f32(b)))) / (float(jnp.max(jnp.abs(f32(b)))) + 1e-30)
        for a, b in zip(got, want, strict=True)
    )


if __name__ == "__main__":
    main()
