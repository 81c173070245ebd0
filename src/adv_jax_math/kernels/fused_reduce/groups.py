"""Element groups: which of ``fun``'s output elements one Mosaic GPU kernel folds.

The Mosaic GPU kernels (``mosaic_gpu``, ``backward_mosaic_gpu``) hold one row per
thread: every value a program needs of its rows sits in that thread's registers at
once (the features it reads, what ``fun`` makes of them, the states it carries, the
constants' elements it loads before its loop), and past a Hopper thread's 255
registers ptxas spills (compiled for H100: 128 features read and 128 sums carried at
128 rows took 254-255 registers and spilled up to 16 bytes). So ``fun`` is unrolled
once, outside the kernel, into a jaxpr from the constants' elements (scalars) and
the inputs' features (vectors of rows) to every output element
(``Features.grouped``), and its output elements are split, in order, into groups
whose values live at once in that jaxpr's order (each value from where it is made
to its last use; features from the block's load, constants from the kernel's start)
stay within a budget: each group is one kernel that reads only the features its
elements need and evaluates only the equations they need (:func:`run`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend.core import Literal

from ...analysis.jaxpr_graph import bind

__all__ = ["REGISTERS", "Group", "grouped", "run", "words"]

# Values of its rows a thread may hold at once (registers; a Hopper thread has 255,
# some taken by addresses, indices and temporaries).
REGISTERS = 128


def words(dtype: Any) -> int:
    """The 32-bit registers a value of ``dtype`` takes (a float64 two)."""
    return max(1, np.dtype(dtype).itemsize // 4)


@dataclasses.dataclass(frozen=True)
class Group:
    """Output elements one kernel folds, and what they need of the unrolled jaxpr."""

    elements: tuple[int, ...]  # indices of the elements (``Features.elements()``)
    outputs: tuple[int, ...]  # the jaxpr's outputs they read
    eqns: tuple[int, ...]  # the equations those need, in order
    consts: tuple[int, ...]  # constants' elements they read (flat)
    features: tuple[int, ...]  # inputs' features they read (flat)
    peak: int  # values live at once per thread, the states carried included


def _measure(jaxpr: Any, n_consts: int, outputs: set[int], vec: int) -> Group:
    """What ``outputs`` of ``jaxpr`` need (a :class:`Group` without elements), and the
    registers per thread its values take at once: a vector of rows ``vec`` (rows per
    thread), a scalar one; constants live throughout, features until their last use."""
    real = lambda vs: [v for v in vs if not isinstance(v, Literal)]
    outs = set(real(jaxpr.outvars[i] for i in outputs))
    need, keep = set(outs), []
    for i in reversed(range(len(jaxpr.eqns))):
        if need.intersection(jaxpr.eqns[i].outvars):
            keep.append(i)
            need.update(real(jaxpr.eqns[i].invars))
    keep.reverse()
    last = {v: len(keep) for v in outs}  # (outputs: folded after every equation)
    for pos, i in enumerate(keep):
        for v in real(jaxpr.eqns[i].invars):
            last[v] = max(last.get(v, pos), pos)
    cost = lambda v: (vec if v.aval.shape else 1) * words(v.aval.dtype)
    inputs = [j for j, v in enumerate(jaxpr.invars) if v in need]
    live = peak = sum(cost(jaxpr.invars[j]) for j in inputs)
    held = set(jaxpr.invars[:n_consts])
    for pos, i in enumerate(keep):
        eqn = jaxpr.eqns[i]
        live += sum(map(cost, eqn.outvars))
        peak = max(peak, live)
        done = {v for v in (*real(eqn.invars), *eqn.outvars) if last.get(v, pos) <= pos}
        live -= sum(cost(v) for v in done - held)
    return Group(
        (),
        tuple(sorted(outputs)),
        tuple(keep),
        tuple(j for j in inputs if j < n_consts),
        tuple(j - n_consts for j in inputs if j >= n_consts),
        peak,
    )


def grouped(
    jaxpr: Any,
    n_consts: int,
    reads: Sequence[Sequence[int]],
    states: Sequence[int],
    vec: int,
    budget: int,
) -> list[Group] | int:
    """``jaxpr``'s output elements in groups of consecutive elements, as few as the
    budget allows (each as large as fits), or the registers the first element that
    does not fit alone needs. ``reads``: per element, the outputs of ``jaxpr`` it
    folds; ``states``: the state values it carries; ``vec``: rows per thread."""

    def measure(a: int, b: int) -> Group:
        outs = {o for e in range(a, b) for o in reads[e]}
        g = _measure(jaxpr, n_consts, outs, vec)
        return dataclasses.replace(g, elements=tuple(range(a, b)), peak=g.peak + sum(states[a:b]))

    groups, start = [], 0
    while start < len(reads):
        g = measure(start, start + 1)
        if g.peak > budget:
            return g.peak
        lo, hi = start + 1, len(reads)  # the largest end that fits (peaks only grow)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if measure(start, mid).peak <= budget else (lo, mid - 1)
        groups.append(g if lo == start + 1 else measure(start, lo))
        start = lo
    return groups


def run(
    closed: Any, n_consts: int, group: Group, consts: Sequence[Any], features: Sequence[Any]
) -> dict:
    """The outputs ``group`` reads (by index) of ``closed`` (:func:`grouped`'s jaxpr),
    from the constants' elements and the features it reads (in :attr:`Group.consts`
    and :attr:`Group.features` order), evaluating only its equations."""
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update((jaxpr.invars[j], c) for j, c in zip(group.consts, consts, strict=True))
    env.update(
        (jaxpr.invars[n_consts + j], x) for j, x in zip(group.features, features, strict=True)
    )
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    for i in group.eqns:
        eqn = jaxpr.eqns[i]
        env.update(zip(eqn.outvars, bind(eqn, [read(v) for v in eqn.invars]), strict=True))
    return {o: read(jaxpr.outvars[o]) for o in group.outputs}
