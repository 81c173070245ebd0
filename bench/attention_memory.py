"""One-head attention on this CPU: ``ajm.pairwise`` (``SOFTMAX_WEIGHTED`` on the matmul
tiles) against ``jax.nn.dot_product_attention(implementation="xla")`` and the naive
``softmax(q k^T / sqrt(d)) v``; writes ``bench/results/attention_memory.{md,png}``.

* memory: the compiled temporary memory (``memory_analysis().temp_size_in_bytes``) of
  the forward and of ``value_and_grad`` of ``sum(out)`` with respect to ``q``, ``k``,
  ``v``, at ``N = M`` from 1024 to 32768, ``d = 64``, float32 (compiled from shapes:
  nothing runs);
* time: the same six functions at a few sizes, in one process, called in rounds
  interleaved in a shuffled order (``_timing.interleaved``) so that other processes'
  load hits all alike; min, median and max of the rounds.

Run with ``PYTHONPATH=src:bench .venv/bin/python bench/attention_memory.py`` (about
3 minutes on 2 cores); ``--quick`` for a smoke run (writes under ``bench/.cache``).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
from _timing import interleaved, temp_bytes
from publish import markdown_table, tree_state
from report import machine

import adv_jax_math as ajm

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
D = 64


def ours(q, k, v):
    scale = 1.0 / q.shape[-1] ** 0.5
    pair = lambda qi, kv: (jnp.dot(qi, kv[0]) * scale, kv[1])
    return ajm.pairwise(pair, q, (k, v), ajm.SOFTMAX_WEIGHTED)


def xla(q, k, v):
    one = lambda a: a[None, :, None]  # (batch, tokens, heads, features)
    return jax.nn.dot_product_attention(one(q), one(k), one(v), implementation="xla")[0, :, 0]


def naive(q, k, v):
    return jax.nn.softmax(q @ k.T / q.shape[-1] ** 0.5, axis=1) @ v


METHODS = {"ajm.pairwise": ours, "dot_product_attention (xla)": xla, "naive": naive}
STYLES = {"ajm.pairwise": "o-", "dot_product_attention (xla)": "s-", "naive": "^--"}


def grad(fn):
    return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))


def qkv(n: int, seed: int = 0) -> tuple:
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, (n, D), jnp.float32) for key in keys)


def memory(sizes) -> dict:
    """MiB of temporaries per (method, pass) and size: compiled from shapes only."""
    out = {}
    for name, fn in METHODS.items():
        for kind, f in (("forward", fn), ("value_and_grad", grad(fn))):
            row = []
            for n in sizes:
                spec = (jax.ShapeDtypeStruct((n, D), jnp.float32),) * 3
                row.append(temp_bytes(jax.jit(f).lower(*spec).compile()) / 2**20)
            out[name, kind] = row
            print(f"{name:28s} {kind:15s}", " ".join(f"{m:9.1f}" for m in row), flush=True)
    return out


def rss_growth_mib(n: int) -> float:
    """MiB the peak resident memory of a fresh process grows by in one call of the
    naive forward at ``N = M = n`` (compiled and inputs made beforehand): XLA:CPU
    compiles it into one YNNPACK fusion from ``N = 4096``, whose buffers
    ``memory_analysis`` does not count (its temp reads 0)."""
    args = qkv(n)
    compiled = jax.jit(naive).lower(*args).compile()
    jax.block_until_ready(args)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    jax.block_until_ready(compiled(*args))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB on Linux


def rss_in_subprocess(n: int) -> float:
    cmd = [sys.executable, __file__, "--rss", str(n)]
    return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1])


def timings(n: int, rounds: int) -> dict:
    args = qkv(n)
    fs = {}
    for name, fn in METHODS.items():
        fs[name, "forward"] = jax.jit(fn)
        fs[name, "value_and_grad"] = jax.jit(grad(fn))
    want = fs["dot_product_attention (xla)", "forward"](*args)
    for name in METHODS:  # the check: every forward against XLA's attention
        err = float(jnp.max(jnp.abs(fs[name, "forward"](*args) - want)))
        assert err < 1e-4, (name, err)
    t = interleaved(fs, args, rounds=rounds, warmup=2, shuffle=n)
    for key, timing in t.items():
        print(n, *key, timing, flush=True)
    return t


def plot(sizes, mem: dict, rss: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, kind in zip(axes, ("forward", "value_and_grad"), strict=True):
        for (name, k), row in mem.items():
            if k == kind:  # a temp of 0 (a YNNPACK fusion's, not counted) left out
                style = STYLES[name]
                ax.plot(sizes, [m or float("nan") for m in row], style, label=name)
        if kind == "forward" and rss:
            label = "naive: peak RSS growth of a run"
            ax.plot(list(rss), list(rss.values()), "x", color="C2", ms=9, label=label)
        ax.set(xscale="log", yscale="log", xlabel="N = M (d = 64, float32)", title=kind)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("compiled temp memory, MiB")
    axes[0].legend(fontsize=8)
    fig.suptitle("One-head attention on CPU: temporary memory against N")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ms(t) -> str:
    return f"{t.min * 1e3:.1f} / {t.median * 1e3:.1f} ({max(t.samples) * 1e3:.1f})"


def markdown(sizes, mem: dict, rss: dict, times: dict, info: dict, seconds: float) -> str:
    kinds = ("forward", "value_and_grad")
    head = ["N = M"] + [f"{kind}: {name}" for kind in kinds for name in METHODS]
    rows = [head] + [
        [str(n)]
        + [
            f"{mem[name, kind][i]:.1f}" if mem[name, kind][i] else "-"
            for kind in kinds
            for name in METHODS
        ]
        for i, n in enumerate(sizes)
    ]
    lines = [
        "# One-head attention: memory and time on CPU",
        "",
        "Written by `bench/attention_memory.py`; `d = 64`, float32, `N` queries and "
        "`M = N` keys and values. `ajm.pairwise` is "
        "`pairwise(lambda q, kv: (jnp.dot(q, kv[0]) * scale, kv[1]), q, (k, v), "
        "SOFTMAX_WEIGHTED)` (the matmul tiles); `dot_product_attention (xla)` is "
        '`jax.nn.dot_product_attention(..., implementation="xla")` on one batch and one '
        "head; `naive` is `softmax(q @ k.T * scale) @ v`. The gradient is "
        "`value_and_grad` of `sum(out)` with respect to `q`, `k` and `v`.",
        "",
        f"Machine: {info['cpu']}, {info['nproc']} cores (shared), jax {info['jax']}, "
        f"commit {info['commit']}; load average {info['load_average_start'][0]:.2f} at "
        f"the start; {seconds:.0f} s in all.",
        "",
        "## Compiled temporary memory, MiB",
        "",
        "<!-- memory table -->",
        markdown_table(rows, "r" * len(head)),
        "<!-- end memory table -->",
        "",
        "A `-` is no measurement: from `N = 4096` XLA:CPU compiles the whole naive "
        "forward into one YNNPACK fusion, whose buffers `memory_analysis` does not count. "
        "The peak resident memory of a fresh process grew in one such call by "
        + ", ".join(f"{m:.0f} MiB at N = {n}" for n, m in rss.items())
        + f" (its scores alone: {', '.join(f'{n * n * 4 / 2**20:.0f}' for n in rss)} MiB).",
        "",
        "![temp memory against N](attention_memory.png)",
        "",
        "## Time, ms: min / median (max) of interleaved rounds",
        "",
    ]
    for n, t in times.items():
        rounds = len(next(iter(t.values())))
        trows = [["", *kinds]] + [
            [name] + [ms(t[name, kind]) for kind in kinds] for name in METHODS
        ]
        lines += [f"N = M = {n} ({rounds} rounds):", "", markdown_table(trows, "lrr"), ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    p.add_argument("--out", type=Path, default=None, help="folder of the results")
    p.add_argument("--rss", type=int, default=None, help=argparse.SUPPRESS)  # the subprocess
    a = p.parse_args()
    if a.rss:
        print(rss_growth_mib(a.rss))
        return
    out = a.out or (HERE / ".cache" / "quick" if a.quick else HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    sizes = [1024, 2048] if a.quick else [1024, 2048, 4096, 8192, 16384, 32768]
    timed = {1024: 3} if a.quick else {1024: 15, 4096: 7}
    start, info = time.perf_counter(), machine(tree_state())
    mem = memory(sizes)
    rss = {n: rss_in_subprocess(n) for n in ([2048] if a.quick else [8192, 16384])}
    print("naive forward, peak RSS growth (MiB):", rss, flush=True)
    times = {n: timings(n, rounds) for n, rounds in timed.items()}
    plot(sizes, mem, rss, out / "attention_memory.png")
    text = markdown(sizes, mem, rss, times, info, time.perf_counter() - start)
    (out / "attention_memory.md").write_text(text + "\n")
    print(f"wrote {out / 'attention_memory.md'} and .png")


if __name__ == "__main__":
    main()
