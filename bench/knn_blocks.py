"""k-NN top-10 at ``D = 128``, float32, on this CPU: where the time goes.

Contenders, in one process, timed in rounds interleaved in a shuffled order
(``_timing.interleaved``); min, median and max of the rounds:

* ``ajm.pairwise``: ``pairwise(lambda a, b: jnp.sum((a - b) ** 2), x, y,
  top_k(10, smallest=True))`` (the matmul tiles, distances expanded and centred,
  each tile folded into the top-k by the native kernel, ``kernels/cpu/topk.cc``);
* ``ajm.pairwise, native off``: the same with ``config(native="off")``: each tile's
  ``lax.top_k`` and a merge network (the fold before the native kernel);
* ``dense blocks``: ``lax.map`` over 256-query blocks of the expanded distances
  ``|a|^2 - 2 a.b + |b|^2`` (one matmul per block) and ``lax.top_k``;
* ``direct dense``: the whole ``(N, M)`` expanded distance matrix, then ``lax.top_k``.

and their parts, each timed alone:

* ``blocks: distances + min``: the same blocks reduced by ``min`` (a cheap pass)
  instead of ``top_k``: the matmul's share;
* ``blocks: top_k alone``: ``lax.map`` of ``lax.top_k`` over 256-row blocks of
  distances computed beforehand (at ``N = 1e5``: over the first ``TOPK_ROWS`` rows,
  scaled to ``N``);
* ``ajm.pairwise MIN``: the same pairwise distances reduced by ``ajm.MIN``: the tiles'
  matmul and loops without the top-k;
* ``blocks: x @ y.T + min``: the bare product of each block, reduced by ``min``: the
  matmul alone, at the rate XLA:CPU's dot reaches on these shapes;
* ``ajm.pairwise, tiles=(256, M)``: the same call on one ``y`` tile of 256 queries by
  all ``M`` points, the dense blocks' shape.

GFLOP/s counts ``2 N M D`` flops (the matmul's) over the min time, for every row that
makes the distances.

Run with ``PYTHONPATH=src:bench .venv/bin/python bench/knn_blocks.py`` (about
5 minutes on 2 cores); ``--n`` sets the large case's queries (default 100000);
``--quick`` for a smoke run. Prints a Markdown report (``--out FILE`` writes it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from _timing import Timing, interleaved
from publish import markdown_table, tree_state
from report import machine

import adv_jax_math as ajm

D, K, BLOCK = 128, 10, 256
TOPK_ROWS = 8192


def sqdist(a, b):
    return jnp.sum((a - b) ** 2)


def expanded(xb, y):  # (rows, M) squared distances of a block of queries
    return jnp.sum(xb * xb, 1)[:, None] - 2 * xb @ y.T + jnp.sum(y * y, 1)[None]


def ours(x, y):
    return ajm.pairwise(sqdist, x, y, ajm.top_k(K, smallest=True))


def ours_off(x, y):
    with ajm.config(native="off"):
        return ours(x, y)


def ours_min(x, y):
    return ajm.pairwise(sqdist, x, y, ajm.MIN)


def blocks(x, y):
    top = lambda xb: jax.lax.top_k(-expanded(xb, y), K)
    d, j = jax.lax.map(lambda xi: jax.tree.map(lambda a: a[0], top(xi[None])), x, batch_size=BLOCK)
    return -d, j


def blocks_min(x, y):
    return jax.lax.map(lambda xi: jnp.min(expanded(xi[None], y)), x, batch_size=BLOCK)


def direct(x, y):
    d, j = jax.lax.top_k(-expanded(x, y), K)
    return -d, j


def topk_alone(dist):
    return jax.lax.map(lambda r: jax.lax.top_k(-r, K), dist, batch_size=BLOCK)


def ours_wide(x, y):
    return ajm.pairwise(sqdist, x, y, ajm.top_k(K, smallest=True), tiles=(BLOCK, y.shape[0]))


def matmul_min(x, y):
    return jax.lax.map(lambda xi: jnp.min(y @ xi), x, batch_size=BLOCK)


def points(n: int, m: int, seed: int = 0) -> tuple:
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, D)), jax.random.normal(ky, (m, D))


def case(n: int, m: int, rounds: int, dense: bool) -> dict:
    x, y = points(n, m)
    print(f"-- {n} x {m}:", ajm.explain_pairwise(sqdist, x, y, ajm.top_k(K, smallest=True)))
    fs = {"ajm.pairwise": ours, "dense blocks": blocks, "ajm.pairwise, native off": ours_off}
    if dense:
        fs["direct dense"] = direct
    fs |= {
        "ajm.pairwise, tiles=(256, M)": ours_wide,
        "ajm.pairwise MIN": ours_min,
        "blocks: distances + min": blocks_min,
        "blocks: x @ y.T + min": matmul_min,
    }
    fs = {name: jax.jit(f) for name, f in fs.items()}
    t0 = time.perf_counter()
    got = {name: jax.block_until_ready(f(x, y)) for name, f in fs.items()}
    print(f"compiled and ran once in {time.perf_counter() - t0:.1f} s", flush=True)
    same = float(jnp.mean(jnp.all(got["ajm.pairwise"][1] == got["dense blocks"][1], axis=1)))
    t = interleaved(fs, (x, y), rounds=rounds, warmup=0, shuffle=n)
    # the parts measured on at most TOPK_ROWS queries, scaled to n
    rows = min(n, TOPK_ROWS)
    dist = jax.block_until_ready(jax.jit(expanded)(x[:rows], y))
    scale = n / rows
    part = interleaved({"top_k": jax.jit(topk_alone)}, (dist,), rounds=rounds, warmup=1)
    t["blocks: top_k alone"] = Timing(tuple(s * scale for s in part["top_k"].samples))
    del dist
    for name, timing in t.items():
        print(f"{n} x {m} {name}: {timing}", flush=True)
    return {"times": t, "same_rows": same, "scaled": scale != 1, "rows": rows}


def report(results: dict, info: dict, seconds: float) -> str:
    lines = [
        "# k-NN top-10 at D = 128, float32: where the time goes",
        "",
        f"Written by `bench/knn_blocks.py`. Machine: {info['cpu']}, {info['nproc']} cores "
        f"(shared), jax {info['jax']}, commit {info['commit']}; load average "
        f"{info['load_average_start'][0]:.2f} at the start; {seconds:.0f} s in all.",
        "",
    ]
    for (n, m), r in results.items():
        t = r["times"]
        ref = t["dense blocks"].min
        flops = 2 * n * m * D
        head = ["", "min s", "median s", "max s", "min vs dense blocks", "GFLOP/s"]
        rows = [head] + [
            [
                name,
                f"{v.min:.3f}",
                f"{v.median:.3f}",
                f"{max(v.samples):.3f}",
                f"{v.min / ref:.2f}x",
                "-" if name == "blocks: top_k alone" else f"{flops / v.min / 1e9:.0f}",
            ]
            for name, v in t.items()
        ]
        note = (
            f" The parts marked alone were timed on the first {r['rows']} queries and "
            f"scaled by {n / r['rows']:.2f}."
            if r["scaled"]
            else ""
        )
        lines += [
            f"## {n} queries x {m} points ({len(t['ajm.pairwise'])} rounds)",
            "",
            f"Queries whose 10 indices match dense blocks' exactly: {100 * r['same_rows']:.2f}%."
            + note,
            "",
            markdown_table(rows, "lrrrrr"),
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100_000, help="queries of the large case")
    p.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    p.add_argument("--out", type=Path, default=None, help="write the Markdown report here")
    a = p.parse_args()
    info, start = machine(tree_state()), time.perf_counter()
    sizes = {(1024, 2000): (3, True)} if a.quick else {(4096, 10_000): (9, True)}
    if not a.quick:
        sizes[a.n, 10_000] = (3, a.n * 10_000 * 4 <= 4 * 2**30)  # dense: up to 4 GiB of distances
    results = {nm: case(*nm, rounds, dense) for nm, (rounds, dense) in sizes.items()}
    text = report(results, info, time.perf_counter() - start)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
