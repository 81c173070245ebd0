"""A roofline model of one pairwise reduction on a device: the tile kernel's passes
(the README's pairwise roofline table, ``pairwise_roofline.py``; it lives with its
only reader, not in the package).

A model, labelled so wherever it shows; nothing here is measured: :mod:`._roofline`'s,
for the tile kernel (``kernels/pairwise_device.py``: a program per x tile of ``bi`` rows
looping over y tiles of ``bj`` rows). A pass takes ``max(HBM bytes / bandwidth, L2 bytes
/ its bandwidth, ALU flops / peak, transcendentals / rate) / occupancy + launches + grid
steps (TPU) + XLA's copies / HBM bandwidth``, with

* **bytes**: x read once; y once per x tile, through L2 on a GPU (from HBM once if y fills
  at most half the L2, else every time: no reuse between programs assumed), from HBM every
  time on a TPU (the y BlockSpec streams each y tile for each x tile); states written once;
  XLA's copies: x, y laid out as padded feature rows (read, written), states read, result.
* **flops**: ``f``'s jaxpr per pair (``plan.roofline.flops``, plus the max/min/arg reductions,
  ``tanh``, ``pow`` it leaves at 0), the monoid's fold and merges, on the padded pairs;
  transcendentals also on the GPU's SFUs / TPU's EUP, with :data:`SPECIAL_FLOPS` ALU
  flops each. ``f``'s features are unrolled (no dot reaches tensor cores or the MXU):
  the elementwise peaks count (``Device.vector``: the device table, ``core.devices``).
  Programs fill the SMs / TensorCores in whole waves; four launches a pass (the kernel,
  XLA's copies).
* **grad** (``value_and_grad`` w.r.t. x and y, as ``pairs.grad``): forward, a dx pass
  over x tiles streaming y and j, a dy pass over y tiles streaming x and each x row's
  cotangent and state, each pair recomputing ``f``, its VJP for one side and the monoid's
  pair cotangent; max/min first tally their ties (a forward pass).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adv_jax_math.core.trace import sub_jaxprs
from adv_jax_math.monoids import catalog as _monoids
from adv_jax_math.monoids.base import Monoid
from adv_jax_math.pairs import tiles as _tiles
from adv_jax_math.plan.roofline import DEVICES, Device, flops, nbytes

__all__ = ["SPECIAL_FLOPS", "PairwiseCost", "PassCost", "pairwise_cost"]

S, I32, FLOAT0, H100 = jax.ShapeDtypeStruct, jnp.int32, jax.dtypes.float0, "NVIDIA H100 80GB HBM3"
_bytes = lambda tree: nbytes(jax.tree.leaves(tree))
SPECIAL_FLOPS = 4  # ALU flops around each transcendental (assumed: see the module note)
_SPECIAL = {"exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "pow", "sin", "cos",
            "tan", "atan2", "erf", "erfc", "erf_inv", "sqrt", "rsqrt", "cbrt"}  # fmt: skip
_REDUCTIONS = {"reduce_max", "reduce_min", "argmax", "argmin"}  # 0 in jax's roofline
_UNARY = {"tanh", "pow"}  # likewise
_PARTS = ("compute", "memory", "launch")


@dataclasses.dataclass(frozen=True)
class PassCost:
    """One kernel pass and XLA's copies around it (bytes: HBM unless said)."""

    name: str
    programs: int  # the kernel's parallel programs (tiles of its own rows)
    parallel: float  # share of the SMs / TensorCores they keep busy
    kernel: float  # the kernel's bytes: own rows once, streamed side, states written
    streamed: float  # of which the streamed side (once if resident, else per program)
    resident: bool  # the streamed side served from L2 after its first read (GPU)
    xla: float  # XLA's copies: layout (read, written), states read, result written
    flops: float  # ALU flops, SPECIAL_FLOPS per transcendental included
    compute: float  # seconds: the kernel when compute-bound
    memory: float  # seconds: the kernel when memory-bound, and XLA's copies
    launch: float  # seconds: launches and grid steps
    limit: str  # what limits the kernel: HBM, L2, ALU, SFU (GPU) or EUP (TPU)

    bytes = property(lambda self: self.kernel + self.xla)
    seconds = property(lambda self: self.compute + self.memory + self.launch)


@dataclasses.dataclass(frozen=True)
class PairwiseCost:
    """One pairwise call as the model sees it: its passes on ``device``."""

    device: Device
    n: int
    m: int
    tiles: tuple[int, int]
    pair_flops: float  # forward ALU flops per pair (f, fold, transcendentals' extras)
    pair_special: float  # forward transcendentals per pair
    passes: tuple[PassCost, ...]

    bytes = property(lambda self: sum(p.bytes for p in self.passes))
    flops = property(lambda self: sum(p.flops for p in self.passes))
    seconds = property(lambda self: sum(p.seconds for p in self.passes))
    intensity = property(lambda self: self.flops / max(self.bytes, 1.0), doc="flop/byte")

    bound = property(
        lambda self: max((sum(getattr(p, k) for p in self.passes), k) for k in _PARTS)[1],
        doc="``compute``, ``memory`` or ``launch``: where most of the modelled time goes",
    )

    def __str__(self) -> str:
        ms = lambda s: f"{s * 1e3:,.3f} ms"
        return (
            f"pairwise roofline MODEL on {self.device.name} (not measured): {self.n} x "
            f"{self.m} rows, tiles {self.tiles}: {ms(self.seconds)}, {self.bound}-bound, "
            f"{self.intensity:,.1f} flop/byte; per pair forward {self.pair_flops:,.1f} "
            f"ALU flops, {self.pair_special:g} transcendental(s)"
        ) + "".join(
            f"\n  {p.name:<7}: {ms(p.seconds)}, {p.bytes / 1e9:,.3f} GB HBM (streamed "
            f"{p.streamed / 1e9:,.3f} GB, {'resident in L2' if p.resident else 'each time'}"
            f"), {p.flops / 1e12:,.3f} TFLOP, {p.programs} programs at {p.parallel:.0%}, "
            f"kernel {p.limit}-bound"
            for p in self.passes
        )


def _counts(fun: Callable, *avals: Any) -> tuple[float, float]:
    """``(flops, transcendentals)`` of ``fun`` on ``avals``, from its jaxpr."""
    extra, special = _walk(jax.make_jaxpr(fun)(*avals).jaxpr)
    return flops(fun, *avals) + extra, special


def _walk(jaxpr: Any) -> tuple[float, float]:
    """Flops jax's roofline leaves at 0, and transcendentals, of ``jaxpr``'s live
    equations (as jax's roofline, which counts no dead code) and its calls."""
    size = lambda vs: max((math.prod(getattr(v.aval, "shape", ())) for v in vs), default=0)
    extra, special, live = 0.0, 0.0, set(map(id, jaxpr.outvars))
    for e in reversed(jaxpr.eqns):
        if e.effects or not live.isdisjoint(map(id, e.outvars)):
            live.update(map(id, e.invars))
            name, ins, outs = e.primitive.name, size(e.invars), size(e.outvars)
            subs = [_walk(sub) for sub in sub_jaxprs(e.params)]
            extra += sum(s[0] for s in subs) + (ins if name in _REDUCTIONS else 0)
            special += sum(s[1] for s in subs) + (outs if name in _SPECIAL else 0)
            extra += outs if name in _UNARY else 0
    return extra, special


def _rows(tree: Any, name: str) -> tuple[int, Any, int, int]:
    """Rows, one row's avals, bytes and float elements per row of ``tree``."""
    leaves = jax.tree.leaves(tree)
    if not leaves or any(not jnp.shape(a) for a in leaves):
        raise ValueError(f"pairwise_cost: every leaf of {name} needs a leading row axis")
    row = jax.tree.map(lambda a: S(jnp.shape(a)[1:], jnp.result_type(a)), tree)
    floats = sum(a.size for a in jax.tree.leaves(row) if jnp.issubdtype(a.dtype, jnp.inexact))
    return int(jnp.shape(leaves[0])[0]), row, _bytes(row), floats


def _monoid(reduction: Monoid | str | float) -> Monoid | float:
    known = {m.name: m for m in vars(_monoids).values() if isinstance(m, Monoid)}
    if isinstance(reduction, Monoid):
        return reduction
    if isinstance(reduction, int | float) and not isinstance(reduction, bool) and reduction >= 0:
        return float(reduction)
    if not isinstance(reduction, str) or reduction not in known:
        why = f"pass a Monoid, one of {sorted(known)} or the fold's flops per pair (>= 0)"
        raise ValueError(f"pairwise_cost: reduction={reduction!r}; {why}")
    return known[reduction]


def _terms(red: Monoid | float, out: list, bj: int) -> tuple[float, ...]:
    """Fold (flops, transcendentals: per pair), merge flops, state bytes (per x row), pair
    cotangent (flops, transcendentals) of the reduction."""
    if not isinstance(red, Monoid):
        return float(red), 0.0, 0.0, _bytes(out), 0.0, 0.0
    fold = lambda ys, i: red.fold(ys, i, None)
    ys, idx, at = [S((bj, *a.shape), a.dtype) for a in out], S((bj,), I32), S((1,), I32)
    state, (f, s) = jax.eval_shape(fold, ys, idx), _counts(fold, ys, idx)
    try:
        ct = jax.eval_shape(lambda st: red.finalize(st, out), state)
        rule = lambda c, y, i, st: red.cotangent(c, y, i, None, st, out)
        cot = _counts(rule, ct, [S((1, *a.shape), a.dtype) for a in out], at, state)
    except (TypeError, ValueError, IndexError):  # a rule reading a tally: 3 flops assumed
        cot = (3.0, 0.0)  # (compare with the selected value, select, scale)
    return f / bj, s / bj, _counts(red.merge, state, state)[0], _bytes(state), *cot


def _vjp(f: Callable, xr: Any, yr: Any, side: int) -> tuple[float, float]:
    """``f`` and its VJP w.r.t. argument ``side`` (the other closed over), for a pair."""
    zero = lambda c: c if jnp.issubdtype(c.dtype, jnp.inexact) else np.zeros(c.shape, FLOAT0)
    fun = lambda a, b: f(a, b) if side == 0 else f(b, a)
    pull = lambda a, b, g: jax.vjp(lambda s: fun(s, b), a)[1](jax.tree.map(zero, g))
    return _counts(pull, *((xr, yr) if side == 0 else (yr, xr)), jax.eval_shape(f, xr, yr))


def _pass(name: str, d: Device, own: tuple, other: tuple, tiles: tuple, pair: tuple,
          merge: float, state: float, out: float) -> PassCost:  # fmt: skip
    """A kernel over the tiles of ``own = (rows, bytes per row)`` streaming ``other``'s;
    ``merge`` flops, ``state`` and ``out`` (result) bytes per own row."""
    (n, own_b), (m, other_b), (b_own, b_other) = own, other, tiles
    programs, streams, gpu = -(-n // b_own), -(-m // b_other), d.platform == "cuda"
    n_pad, m_pad, once = programs * b_own, streams * b_other, streams * b_other * other_b
    resident = gpu and once <= d.cache / 2  # y served from L2 after one read
    streamed = once if resident else programs * once
    special = n_pad * m_pad * pair[1]
    alu = n_pad * m_pad * pair[0] + SPECIAL_FLOPS * special + n_pad * (streams - 1) * merge
    kernel = n_pad * own_b + streamed + n_pad * state
    xla = (n + n_pad) * own_b + (m + m_pad) * other_b + n_pad * state + n * out
    limits = {"HBM": kernel / d.bandwidth, "ALU": alu / d.vector,
              "SFU" if gpu else "EUP": special / d.special,
              "L2": programs * once / d.cache_bandwidth if gpu else 0.0}  # fmt: skip
    limit = max(limits, key=lambda k: limits[k])
    parallel = programs / (d.cores * -(-programs // d.cores))  # whole waves
    time, memory = limits[limit] / parallel, limit in ("HBM", "L2")
    launch = 4 * d.launch + (0 if gpu else programs * streams * d.step)
    return PassCost(name, programs, parallel, kernel, streamed, resident, xla, alu,
                    0.0 if memory else time, xla / d.bandwidth + (time if memory else 0.0),
                    launch, limit)  # fmt: skip


def pairwise_cost(f: Callable, x: Any, y: Any, reduction: Monoid | str | float,
                  tiles: tuple[int, int] | None = None, device: Device | str = H100,
                  grad: bool = False) -> PairwiseCost:  # fmt: skip
    """The model's cost of ``pairwise(f, x, y, reduction)`` on the tile kernel.

    Parameters
    ----------
    f : callable
        ``f(xi, yj)`` for one pair, as :func:`pairwise` takes it.
    x, y : pytree of arrays or jax.ShapeDtypeStruct
        ``N`` and ``M`` rows along the leading axis of every leaf.
    reduction : Monoid, str or float
        The monoid, its name (``"logsumexp"``), or the fold's flops per pair.
    tiles : (int, int) or None
        ``(bi, bj)``; None: the kernel's on ``device`` (``pairs.tiles.device``).
    device : Device or str
        A :class:`plan.roofline.Device` or its ``device_kind`` (a key of ``core.devices.DEVICES``).
    grad : bool
        ``jax.value_and_grad`` w.r.t. ``x`` and ``y``: forward, dx and dy passes.

    Returns
    -------
    PairwiseCost
        Passes, ``bytes``, ``flops``, ``seconds``, ``bound``, ``intensity``; ``str()``.
    """
    d = DEVICES.get(device) if isinstance(device, str) else device
    if d is None:
        known = list(DEVICES)
        raise ValueError(f"pairwise_cost: device {device!r} is not modelled; known: {known}")
    if tiles is None:  # the kernel's, as pairwise plans them (halved on TPU v4)
        tiles = _tiles.kernel("tpu" if d.platform == "tpu" else "gpu", d.vmem_limit)
    _tiles.check(tiles, "pairwise_cost", auto=False)
    red, (bi, bj) = _monoid(reduction), tuple(tiles)
    (n, xr, xb, xf), (m, yr, yb, yf) = _rows(x, "x"), _rows(y, "y")
    out = [S(a.shape, a.dtype) for a in jax.tree.leaves(jax.eval_shape(f, xr, yr))]
    (f_flops, f_special), t = _counts(f, xr, yr), _terms(red, out, bj)
    pair = (f_flops + t[0], f_special + t[1])
    passes = [_pass("forward", d, (n, xb), (m, yb), (bi, bj), pair, t[2], t[3], _bytes(out))]
    if grad:  # max/min first tally their ties: one more forward pass
        tally = getattr(red, "tally", None) is not None
        passes += [dataclasses.replace(passes[0], name="tally")] if tally else []
        add = _terms(_monoids.ADD, [S((), jnp.float32)], bj)  # the cotangents' sums
        x_side, y_side = (n, xb + _bytes(out) + t[3]), (m, yb + 4)  # 4: j, int32
        for side, (own, other, elems) in enumerate(((x_side, y_side, xf), (y_side, x_side, yf))):
            v, v_special = _vjp(f, xr, yr, side)
            cost = (v + t[4] + elems * add[0], v_special + t[5])
            swap = (bi, bj) if side == 0 else (bj, bi)
            per_row = (elems * add[2], elems * add[3], elems * 4)  # merge, state, result
            passes.append(_pass(("dx", "dy")[side], d, own, other, swap, cost, *per_row))
    alu = pair[0] + SPECIAL_FLOPS * pair[1]
    return PairwiseCost(d, n, m, (bi, bj), alu, pair[1], tuple(passes))


# -- attention on the matrix units (issue 41): a flash-attention-style kernel ------------

# Dense bfloat16 tensor-core peaks (datasheets: H100 SXM 989 TFLOP/s, 1979 with
# sparsity; A100 312); ``Device.peak`` holds TF32's for GPUs. TPUs: ``Device.peak``.
BF16_PEAK = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12,
             "NVIDIA A100-SXM4-80GB": 312e12}  # fmt: skip
ALU_PER_SCORE = {"forward": 4.0, "backward": 6.0}  # vector flops per score (assumed)
BWD_FLOPS = 2.5  # FlashAttention's count: backward = 2.5 x forward's 4 N M d


@dataclasses.dataclass(frozen=True)
class AttentionPass:
    """One pass of attention on ``heads`` heads of N x M scores (``d`` features)."""

    name: str
    flops: float  # FlashAttention's count: 4 N M d (forward), 2.5x that (backward)
    programs: int
    parallel: float  # share of the SMs / cores the programs keep busy (whole waves)
    mma: float  # seconds of the matmuls at the bf16 tensor-core / MXU peak, all units busy
    exp: float  # seconds of the exps on the SFUs / EUP
    alu: float  # seconds of the softmax's other flops on the vector units
    hbm: float  # bytes
    l2: float  # bytes the programs stream through L2 (GPU)
    memory: float  # seconds: HBM or L2, whichever is longer
    launch: float

    @property
    def seconds(self) -> float:
        """Matmuls, exps and the rest overlapped (FlashAttention-3's ping-pong)."""
        return max(max(self.mma, self.exp, self.alu) / self.parallel, self.memory) + self.launch

    @property
    def serial(self) -> float:
        """Matmuls, then the softmax's exps and flops: no overlap (FlashAttention-2)."""
        return max((self.mma + self.exp + self.alu) / self.parallel, self.memory) + self.launch

    @property
    def bound(self) -> str:
        parts = {"MMA": self.mma, "exp": self.exp, "ALU": self.alu}
        name = max(parts, key=lambda k: parts[k])
        return name if parts[name] / self.parallel >= self.memory else "memory"


def attention_cost(n: int, m: int, d: int, device: Device | str = H100, *, heads: int = 1,
                   tiles: tuple[int, int] = (128, 128), itemsize: int = 2,
                   grad: bool = False) -> tuple[AttentionPass, ...]:  # fmt: skip
    """The model's forward (and with ``grad`` backward) pass of softmax attention as a
    flash-attention kernel would run it: a program per ``bi`` query rows per head
    streaming K and V in tiles of ``bj`` rows (backward: a program per ``bj`` key rows
    streaming Q, dO and the row statistics, dQ accumulated in float32 through L2)."""
    dev = DEVICES[device] if isinstance(device, str) else device
    peak = BF16_PEAK.get(dev.kind, dev.peak) if itemsize == 2 else dev.peak
    bi, bj = tiles
    n_pad, m_pad = -(-n // bi) * bi, -(-m // bj) * bj
    scores, gpu = float(n_pad) * m_pad * heads, dev.platform == "cuda"
    passes = []
    for name in ("forward", "backward")[: 1 + grad]:
        fwd = name == "forward"
        tiles_own = -(-n // bi) if fwd else -(-m // bj)
        programs = tiles_own * heads
        parallel = programs / (dev.cores * -(-programs // dev.cores))
        flops = 4.0 * n * m * d * heads * (1 if fwd else BWD_FLOPS)
        mma = 4.0 * scores * d * (1 if fwd else BWD_FLOPS) / peak
        exp, alu = scores / dev.special, scores * ALU_PER_SCORE[name] / dev.vector
        if fwd:  # Q read, O written, row logsumexp written; K, V streamed per program
            own, streamed = n * heads * (2 * d * itemsize + 4), 2 * m * d * itemsize
        else:  # K, V read, dK, dV written; Q, dO, O read, dQ (f32) twice; stats streamed
            own = heads * (4 * m * d * itemsize + n * d * (3 * itemsize + 8) + 8 * n)
            streamed = n * (2 * d * itemsize + 8)
        # the streamed side of the heads in flight served from L2 when it fits in half
        in_flight = max(1, min(heads, dev.cores // max(tiles_own, 1)))
        resident = gpu and streamed * in_flight <= dev.cache / 2
        hbm = own + streamed * heads * (1 if resident else tiles_own)
        l2 = streamed * programs + (0 if fwd else 8.0 * n * d * heads * tiles_own)
        memory = max(hbm / dev.bandwidth, l2 / dev.cache_bandwidth if gpu else 0.0)
        launch = (2 if fwd else 3) * dev.launch + (
            0 if gpu else scores / heads / bi / bj * dev.step
        )
        passes.append(AttentionPass(name, flops, programs, parallel, mma, exp, alu, hbm, l2,
                                    memory, launch))  # fmt: skip
    return tuple(passes)
