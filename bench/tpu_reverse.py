"""Attention's reverse pass on a TPU: the matmul tile kernels against XLA's loops and
jax's own Pallas flash attention (``jax.experimental.pallas.ops.tpu.flash_attention``).

    python bench/tpu_reverse.py [--n 16384] [--d 64] [--tiles 512,1024 256,512]

For each dtype: ``ajm.pairwise``'s forward; ``jax.value_and_grad`` w.r.t. q, k, v with
the library's choice of reverse pass, with XLA's loops forced, and with the reverse
kernels forced at each ``--tiles`` (also w.r.t. q alone: the kernel over the x tiles;
k and v: over the y tiles); jax's flash attention forward and ``value_and_grad``.
Medians (and mins) of ``--reps`` calls, ms, interleaved round by round; each result
checked against XLA's attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import traceback

import jax
import jax.numpy as jnp
from _timing import compile_fn, interleaved

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
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--tiles", nargs="*", default=["512,1024", "256,512"])
    p.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    p.add_argument("--no-flash", action="store_true", help="without jax's flash attention")
    args = p.parse_args()
    n, d = args.n, args.d
    scale = 1.0 / d**0.5
    f = lambda q, kv: (jnp.dot(q, kv[0]) * scale, kv[1])
    ours = lambda q, k, v: ajm.pairwise(f, q, (k, v), ajm.SOFTMAX_WEIGHTED)
    xla = lambda q, k, v: jax.nn.dot_product_attention(
        q[None, :, None], k[None, :, None], v[None, :, None], scale=scale
    )[0, :, 0]
    flash = None
    try:
        if args.no_flash:
            raise ImportError("--no-flash")
        from jax.experimental.pallas.ops.tpu import flash_attention as fa

        flash = lambda q, k, v: fa.flash_attention(
            q[None, None], k[None, None], v[None, None], sm_scale=scale
        )[0, 0]
    except Exception as e:
        print("no flash attention:", e)
    loss = lambda fn, argnums: jax.value_and_grad(
        lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2), argnums=argnums
    )
    print("jax", jax.__version__, jax.devices()[0].device_kind, f"N = M = {n}, d = {d}")
    print(
        ajm.explain_pairwise(f, jnp.zeros((n, d)), (jnp.zeros((n, d)),) * 2, ajm.SOFTMAX_WEIGHTED)
    )
    for dtype in args.dtypes:
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(kk, (n, d), jnp.float32).astype(dtype) for kk in keys)
        fns = {"xla forward": (xla, None), "ours forward": (ours, None)}
        fns["xla v&g"] = (loss(xla, (0, 1, 2)), None)
        fns["ours v&g (default)"] = (loss(ours, (0, 1, 2)), None)
        fns["ours v&g loops"] = (loss(ours, (0, 1, 2)), "loops")
        if flash is not None:
            fns["flash forward"] = (flash, None)
            fns["flash v&g"] = (loss(flash, (0, 1, 2)), None)
        for t in args.tiles:
            tiles = tuple(int(a) for a in t.split(","))
            for name, nums in (("v&g", (0, 1, 2)), ("dq", (0,)), ("dk dv", (1, 2))):
                fns[f"ours {name} kernels {tiles}"] = (loss(ours, nums), tiles)
        compiled, ref = {}, {}
        for name, (fn, tiles) in fns.items():
            if tiles is not None:
                matmul._reverse_layout = forced(None if tiles == "loops" else tiles)
            try:
                c = compile_fn(fn, (q, k, v))
            except Exception as e:
                where = traceback.extract_tb(e.__traceback__)[-3:]
                print(f"{dtype} {name}: failed: {str(e).splitlines()[0][:300]} at {where}")
                continue
            finally:
                matmul._reverse_layout = KEEP
            out = jax.block_until_ready(c.executable(q, k, v))
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
        t = interleaved(compiled, (q, k, v), rounds=args.reps, warmup=1)
        for name, timing in t.items():
            ms = f"{timing.median * 1e3:.2f} | {timing.min * 1e3:.2f}"
            print(f"| {n} | {d} | {dtype} | {name} | {ms} |")


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
