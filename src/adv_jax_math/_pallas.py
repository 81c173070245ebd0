"""Pallas engine: a chunk's ``fun`` and a monoid reduction fused into one kernel.

``fun`` is traced once, on a block of ``Bk`` rows, to a jaxpr whose constants
(concrete arrays, integer constants, tracers of enclosing transformations) become
whole-array kernel inputs. Each of the ``cdiv(n, T)`` kernel programs takes a tile
of ``T = steps * Bk`` rows of every input leaf and loops over its blocks: evaluate
the jaxpr on ``Bk`` rows, replace rows past ``n`` with the monoid identity, reduce
the rows, combine into one partial per output leaf. The partials are combined by
the monoid in XLA; ``axis=None`` reductions then reduce the remaining axes. ``Bk``
and ``steps`` are chosen per platform, dtype and ``fun`` (``max_rows`` bounds
``Bk``); ``steps > 1`` keeps the number of partials small on GPUs.

``pallas_call`` has no transpose rule, so the engine is a :func:`jax.custom_jvp`
whose tangent is a checkpointed ``lax.scan`` over chunks of ``jax.jvp(fun)``, each
row weighted by the monoid (add: 1; logsumexp: ``exp(y - total)``; max/min:
``(y == top) / ties``). Forward mode uses it as is; reverse mode transposes it,
recomputing every chunk, so gradient memory is O(rows per chunk) and the backward
pass is a scan of ``jax.vjp(fun)``. ``vmap`` batches the kernel itself.

Lowering platforms: ``"cpu"`` (interpret mode), ``"cuda"``/``"rocm"`` (Pallas
Triton), ``"tpu"`` (Pallas Mosaic). ``"gpu"`` means ``"cuda"``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.experimental import pallas as pl
from jax.extend.core import jaxprs_in_params

from ._monoid import ADD, LOGSUMEXP, MONOIDS, Monoid, MonoidReduction

__all__ = [
    "KERNEL_MARKERS",
    "KERNEL_NAME",
    "contains_kernel",
    "fused_reduce",
    "kernel_block_rows",
    "kernel_problem",
    "reference_reduce",
]

KERNEL_NAME = "adv_jax_math_fused_reduce"
"""Name of our ``pallas_call`` and of the jitted function around it, so it shows in
jaxprs and in lowered text (``func.func private @adv_jax_math_fused_reduce``)."""

KERNEL_MARKERS = {
    "cuda": ("__gpu$xla.gpu.triton", "triton_kernel_call"),
    "rocm": ("__gpu$xla.gpu.triton", "triton_kernel_call"),
    "tpu": ("tpu_custom_call",),
    "cpu": (KERNEL_NAME,),
}
"""Per lowering platform, text that marks the kernel in lowered StableHLO."""

# Pallas Triton (jax 0.12) warns at every lowering that it is deprecated in favour
# of Mosaic GPU; the warning is about JAX's roadmap, not the user's code.
_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"

_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}


@dataclasses.dataclass(frozen=True)
class _Target:
    """How to pick blocks and lower for one platform."""

    platform: str  # "cpu" | "cuda" | "rocm" | "tpu"
    label: str
    block_elems: int  # aim: elements of the largest per-block array
    block_bytes: int  # aim: bytes of the largest per-block array (TPU VMEM)
    max_elems: int | None = None  # hard limit per array (Triton)
    programs: int | None = None  # aim: kernel programs; each loops over blocks beyond it

    @property
    def triton(self) -> bool:
        return self.platform in ("cuda", "rocm")

    @property
    def mosaic(self) -> bool:
        return self.platform == "tpu"


_TARGETS = {
    # Interpret mode loops over blocks in pairs, so the CPU tests cover that path.
    "cpu": _Target("cpu", "Pallas interpret mode", 1 << 20, 1 << 62, programs=2),
    "cuda": _Target("cuda", "Pallas Triton", 1 << 13, 1 << 62, max_elems=1 << 20, programs=2048),
    "rocm": _Target("rocm", "Pallas Triton", 1 << 13, 1 << 62, max_elems=1 << 20, programs=2048),
    # Mosaic runs the grid sequentially on a core; one block per program.
    "tpu": _Target("tpu", "Pallas Mosaic TPU", block_elems=1 << 62, block_bytes=1 << 20),
}

# Small blocks used to trace ``fun`` for kernel_problem's analysis and probe.
_PROBE_ROWS = {"cpu": 8, "cuda": 16, "rocm": 16, "tpu": 8}


def _target(platform: str) -> _Target:
    try:
        return _TARGETS[_PLATFORMS[platform]]
    except (KeyError, TypeError):
        raise ValueError(
            f"platform={platform!r} is not one of {sorted(_PLATFORMS)} "
            "('cpu' runs the kernel in interpret mode)"
        ) from None


# --------------------------------------------------------------------------- #
# Helpers shared by the planner, the kernel and the tests
# --------------------------------------------------------------------------- #


def contains_kernel(text: str, platform: str | None = None) -> bool:
    """Whether lowered StableHLO (or a printed jaxpr) contains our fused kernel.

    Parameters
    ----------
    text : str
        ``jax.jit(f).lower(...).as_text()``, or ``str(jax.make_jaxpr(f)(...))`` with
        ``platform=None``.
    platform : str, optional
        The lowering platform: ``"gpu"``/``"cuda"``/``"rocm"`` look for the Triton
        custom call, ``"tpu"`` for the Mosaic custom call, ``"cpu"`` for the
        interpret-mode kernel (our named function, no compiled custom call). None
        accepts any of them.
    """
    compiled = {m for p in ("cuda", "tpu") for m in KERNEL_MARKERS[p]}
    if platform is None:
        return KERNEL_NAME in text or any(m in text for m in compiled)
    platform = _target(platform).platform
    if platform == "cpu":
        return KERNEL_NAME in text and not any(m in text for m in compiled)
    return any(m in text for m in KERNEL_MARKERS[platform])


def reference_reduce(fun: Callable, xs: Any, reduction: MonoidReduction) -> Any:
    """What :func:`fused_reduce` computes, in plain JAX (unchunked)."""
    return reduction.reduce_chunk(fun(xs))


@contextlib.contextmanager
def _quiet_triton() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _TRITON_DEPRECATION, DeprecationWarning)
        yield


def _silence_triton_deprecation() -> None:
    # Our kernel is usually lowered later, by the user's jax.jit, outside any
    # context we control, so the filter is installed for the process; it matches
    # only the Pallas Triton deprecation message.
    warnings.filterwarnings("ignore", _TRITON_DEPRECATION, DeprecationWarning)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _is_pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def _fmt_shape(shape: Sequence[int], dtype: Any, rows: int | None = None) -> str:
    dims = ", ".join("Bk" if d == rows else str(d) for d in shape)
    return f"{np.dtype(dtype).name}[{dims}]"


# --------------------------------------------------------------------------- #
# Inputs, tracing and analysis
# --------------------------------------------------------------------------- #


def _input_leaves(xs: Any) -> tuple[list[Any], Any, int]:
    """Flatten ``xs``; validate that every leaf has the same leading size n >= 1."""
    leaves, treedef = jax.tree.flatten(xs)
    if not leaves:
        raise ValueError("xs has no array leaves; the fused kernel needs at least one mapped input")
    for i, x in enumerate(leaves):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"xs leaf {i} is {type(x).__name__}, not an array or ShapeDtypeStruct")
        if len(x.shape) == 0:
            raise ValueError(f"xs leaf {i} is 0-d; every leaf needs a leading (mapped) axis")
    sizes = {int(x.shape[0]) for x in leaves}
    if len(sizes) != 1:
        got = [int(x.shape[0]) for x in leaves]
        raise ValueError(f"xs leaves have different leading sizes {got}; they must all match")
    (n,) = sizes
    if n < 1:
        raise ValueError("xs has no rows (n == 0); use the monoid identity instead of the kernel")
    return leaves, treedef, n


def _row_stats(avals: Sequence[Any]) -> tuple[int, int]:
    """Largest elements and bytes per row of row-mapped arrays (trailing sizes)."""
    elems = max((math.prod(a.shape[1:]) for a in avals), default=1)
    nbytes = max((math.prod(a.shape[1:]) * np.dtype(a.dtype).itemsize for a in avals), default=1)
    return max(1, elems), max(1, nbytes)


def _all_avals(jaxpr: Any) -> Iterator[Any]:
    """Every array aval in ``jaxpr`` and its sub-jaxprs (inputs, intermediates, outputs)."""
    for v in (*jaxpr.constvars, *jaxpr.invars):
        yield v.aval
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield v.aval
        for sub in jaxprs_in_params(eqn.params):
            yield from _all_avals(sub)


@dataclasses.dataclass(frozen=True)
class _Analysis:
    """What the kernel needs to know about ``fun`` traced on a block of ``rows``."""

    row_elems: int  # elements per row of the largest row-mapped array
    row_bytes: int  # bytes per row of the largest row-mapped array
    fixed_elems: int  # elements of the largest array without a row axis
    avals: tuple[Any, ...]  # every (shape, dtype) in the kernel body


def _analyze(jaxpr: Any, rows: int) -> _Analysis:
    row_elems = row_bytes = fixed = 1
    avals = []
    for a in _all_avals(jaxpr):
        shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
        if shape is None or dtype is None:
            continue
        shape = tuple(int(d) for d in shape)
        avals.append((shape, np.dtype(dtype)))
        size = math.prod(shape)
        if rows in shape:
            per_row = max(1, size // rows)
            row_elems = max(row_elems, per_row)
            row_bytes = max(row_bytes, per_row * np.dtype(dtype).itemsize)
        else:
            fixed = max(fixed, size)
    return _Analysis(row_elems, row_bytes, fixed, tuple(avals))


def _trace(fun: Callable, leaves: Sequence[Any], treedef: Any, rows: int) -> tuple[Any, Any]:
    """``fun`` traced on blocks of ``rows`` rows: (closed jaxpr, output shape pytree)."""
    blocks = [jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype) for x in leaves]
    return jax.make_jaxpr(lambda *ls: fun(jax.tree.unflatten(treedef, ls)), return_shape=True)(
        *blocks
    )


def _output_problem(out_shape: Any, rows: int) -> str | None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(out_shape)[0]:
        if leaf.shape[:1] != (rows,):
            return (
                f"fun's output{jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)} for a "
                f"block of {rows} rows; the kernel needs one output row per input row"
            )
    return None


def _acc_dtype(monoid: Monoid, out_dtype: Any) -> np.dtype:
    """Partials of add/logsumexp over 16-bit floats are kept in float32."""
    out_dtype = np.dtype(out_dtype)
    low = jnp.issubdtype(out_dtype, jnp.floating) and out_dtype.itemsize < 4
    return np.dtype(np.float32) if low and monoid in (ADD, LOGSUMEXP) else out_dtype


def _dtype_problem(target: _Target, dtypes: Sequence[np.dtype], where: str) -> str | None:
    if target.platform == "cpu":
        return None
    for dt in dtypes:
        if jnp.issubdtype(dt, jnp.complexfloating):
            return f"{target.label} kernels do not support complex types ({dt.name} in {where})"
        if target.mosaic and dt.itemsize == 8:
            return (
                f"TPU kernels do not support 64-bit types ({dt.name} in {where}); "
                "use 32-bit inputs or disable jax_enable_x64"
            )
    return None


def _triton_size_problem(target: _Target, analysis: _Analysis, rows: int) -> str | None:
    for shape, dtype in analysis.avals:
        if not _is_pow2(math.prod(shape)):
            return (
                "Triton needs every array in the kernel to have a power-of-two size, but fun "
                f"makes {_fmt_shape(shape, dtype, rows)} for a block of Bk rows; pad trailing "
                "axes to a power of two (e.g. (N, 3) -> (N, 4)) or split them into separate leaves"
            )
    if analysis.fixed_elems > target.max_elems or analysis.row_elems > target.max_elems:
        big = max(analysis.fixed_elems, analysis.row_elems)
        return (
            f"fun makes an array of {big} elements per block row or constant, over Triton's "
            f"limit of {target.max_elems} elements per array"
        )
    return None


def _choose_block(
    target: _Target, n: int, max_rows: int | None, row_elems: int, row_bytes: int, one_d: bool
) -> int | str:
    """Rows per kernel block, or why no block fits."""
    limit = n if max_rows is None else min(max_rows, n)
    budget = max(1, min(target.block_elems // row_elems, target.block_bytes // row_bytes))
    if target.triton:
        # Power-of-two blocks; a block may run past n (masked), but not past max_rows.
        cap = min(budget, max_rows if max_rows is not None else 1 << (n - 1).bit_length())
        if target.max_elems is not None and row_elems > target.max_elems:
            return f"one row of fun needs {row_elems} elements, over Triton's {target.max_elems}"
        return _pow2_floor(cap)
    if target.mosaic:
        cap = min(budget, limit)
        if cap >= n:
            return n  # one block spanning the whole array: no alignment rule applies
        if one_d and cap >= 1024:
            return cap // 1024 * 1024
        if one_d and cap >= 128:
            return _pow2_floor(cap)
        if not one_d and cap >= 8:
            return cap // 8 * 8
        need = 128 if one_d else 8
        kind = "1-D inputs need" if one_d else "inputs need"
        return (
            f"TPU blocks over {kind} at least {need} rows, but only {cap} fit "
            f"(batch_size={max_rows}, {row_bytes} bytes per row of fun)"
        )
    return max(1, min(budget, limit))


def _choose_steps(target: _Target, n: int, rows: int) -> int:
    """Blocks each kernel program reduces in a loop: few enough programs (and partials)."""
    blocks = pl.cdiv(n, rows)
    if target.programs is None or blocks <= target.programs:
        return 1
    steps = pl.cdiv(blocks, target.programs)
    return 1 << (steps - 1).bit_length() if target.triton else steps  # Triton: powers of two


# --------------------------------------------------------------------------- #
# The kernel
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class _Out:
    trailing: tuple[int, ...]  # shape of one row of fun's output leaf
    acc_dtype: np.dtype  # dtype of partials and of the custom_jvp outputs
    out_dtype: np.dtype  # dtype of reduction.reduce_chunk's result


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """Everything static about one fused call."""

    jaxpr: Any  # fun on a block of ``rows`` rows, constants as constvars
    const_avals: tuple[jax.ShapeDtypeStruct, ...]
    in_avals: tuple[jax.ShapeDtypeStruct, ...]  # full (n, ...) inputs
    outs: tuple[_Out, ...]
    reduction: MonoidReduction
    n: int
    rows: int  # Bk: rows of fun evaluated at once
    steps: int  # blocks of Bk rows each kernel program reduces in a loop
    chunk_blocks: int  # blocks per step of the tangent scan
    target: _Target
    interpret: bool

    @property
    def tile(self) -> int:
        """Rows per kernel program."""
        return self.steps * self.rows

    @property
    def grid(self) -> int:
        return pl.cdiv(self.n, self.tile)

    @property
    def monoid(self) -> Monoid:
        return self.reduction.monoid


def _kernel_const_aval(a: Any) -> jax.ShapeDtypeStruct:
    # 0-d constants travel as (1, 1) (no 0-d blocks), bools as int32.
    shape = tuple(a.shape) or (1, 1)
    dtype = np.dtype(np.int32) if a.dtype == np.bool_ else a.dtype
    return jax.ShapeDtypeStruct(shape, dtype)


def _to_kernel_const(c: Any) -> Any:
    c = jnp.asarray(c)
    if c.dtype == np.bool_:
        c = c.astype(jnp.int32)
    return c.reshape(1, 1) if c.ndim == 0 else c


def _load_const(ref: Any, aval: Any) -> Any:
    value = ref[...]
    if not aval.shape:
        value = value.reshape(())
    if aval.dtype == np.bool_:
        value = value != 0
    return value


def _identity_scalar(monoid: Monoid, dtype: np.dtype) -> Any:
    # A NumPy scalar (a literal in the kernel), not a jax array (a captured constant).
    return np.asarray(monoid._identity(np.dtype(dtype)), dtype)[()]


def _block_partial(k: _Kernel, y: Any, out: _Out, first_row: Any) -> Any:
    """Reduce the rows of one block's output leaf, masking rows >= n."""
    valid = None
    if k.n % k.tile:
        valid = first_row + lax.broadcasted_iota(jnp.int32, y.shape, 0) < k.n
    y = y.astype(out.acc_dtype)
    if k.monoid is LOGSUMEXP:
        if valid is not None:
            y = jnp.where(valid, y, -jnp.inf)
        top = jnp.max(y, axis=0)
        top = jnp.where(jnp.abs(top) < jnp.inf, top, 0)  # all -inf, or +inf: shift by 0
        return jnp.log(jnp.sum(jnp.exp(y - top), axis=0)) + top
    if valid is not None:
        y = jnp.where(valid, y, _identity_scalar(k.monoid, out.acc_dtype))
    return k.monoid.reduce(y, axis=0)


def _combine_partials(monoid: Monoid, a: Any, b: Any) -> Any:
    if monoid is LOGSUMEXP:  # logaddexp from ops every backend lowers; inf-safe
        top = jnp.maximum(a, b)
        top = jnp.where(jnp.abs(top) < jnp.inf, top, 0)
        return jnp.log(jnp.exp(a - top) + jnp.exp(b - top)) + top
    return monoid.combine(a, b)


def _partial_shape(out: _Out) -> tuple[int, ...]:
    return (1, *(out.trailing or (1,)))


def _compiler_params(k: _Kernel) -> Any:
    if k.interpret or not k.target.triton:
        return None
    from jax.experimental.pallas import triton as pltriton

    biggest = k.rows * max(1, *(math.prod(o.trailing) for o in k.outs))
    biggest = max(biggest, k.rows * max(math.prod(a.shape[1:]) for a in k.in_avals))
    return pltriton.CompilerParams(num_warps=8 if biggest >= 1 << 13 else 4)


def _pallas_call(k: _Kernel) -> Callable[..., Any]:
    nc, nx = len(k.const_avals), len(k.in_avals)

    def kernel(*refs):
        c_refs, x_refs, o_refs = refs[:nc], refs[nc : nc + nx], refs[nc + nx :]
        consts = [_load_const(r, a) for r, a in zip(c_refs, k.const_avals, strict=True)]
        tile_start = pl.program_id(0) * k.tile  # outside the loop: interpret mode needs that

        def block(j):
            if k.steps == 1:
                start, xs = 0, [r[...] for r in x_refs]
            else:
                start = j * k.rows if isinstance(j, int) else pl.multiple_of(j * k.rows, k.rows)
                xs = [
                    r[(pl.ds(start, k.rows),) + (slice(None),) * (a.ndim - 1)]
                    for r, a in zip(x_refs, k.in_avals, strict=True)
                ]
            ys = jax.core.eval_jaxpr(k.jaxpr, consts, *xs)
            first_row = tile_start + start
            return [_block_partial(k, y, o, first_row) for y, o in zip(ys, k.outs, strict=True)]

        def step(j, acc):
            return [_combine_partials(k.monoid, a, b) for a, b in zip(acc, block(j), strict=True)]

        parts = block(0)
        if k.steps > 1:
            parts = lax.fori_loop(1, k.steps, step, parts)
        for part, o_ref in zip(parts, o_refs, strict=True):
            o_ref[...] = part.reshape(o_ref.shape)

    def index_map(first, ndim):
        return lambda i: (i if first else 0,) + (0,) * (ndim - 1)

    def whole(shape):
        return pl.BlockSpec(shape, index_map(False, len(shape)))

    def rows(shape):
        return pl.BlockSpec((k.tile, *shape[1:]), index_map(True, len(shape)))

    def partial(out):
        shape = _partial_shape(out)
        return pl.BlockSpec((None, *shape), index_map(True, len(shape) + 1))

    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((k.grid, *_partial_shape(o)), o.acc_dtype) for o in k.outs],
        grid=(k.grid,),
        in_specs=[whole(_kernel_const_aval(a).shape) for a in k.const_avals]
        + [rows(a.shape) for a in k.in_avals],
        out_specs=[partial(o) for o in k.outs],
        interpret=k.interpret,
        compiler_params=_compiler_params(k),
        name=KERNEL_NAME,
    )


def _forward(k: _Kernel, consts: Sequence[Any], leaves: Sequence[Any]) -> list[Any]:
    """The fused kernel plus the XLA combine of its partials (in the acc dtypes)."""
    call = _pallas_call(k)

    def kernel_call(*args):
        return call(*args)

    # A named jit makes the kernel visible in lowered text on every platform
    # (``func.func private @adv_jax_math_fused_reduce``), interpret mode included.
    kernel_call.__name__ = kernel_call.__qualname__ = KERNEL_NAME
    partials = jax.jit(kernel_call)(*map(_to_kernel_const, consts), *leaves)
    totals = []
    for p, out in zip(partials, k.outs, strict=True):
        total = k.monoid.reduce(p.reshape(k.grid, *out.trailing), axis=0)
        if k.reduction.axis is None and total.ndim:
            total = k.monoid.reduce(total)
        totals.append(total)
    return totals


# --------------------------------------------------------------------------- #
# Differentiation: a checkpointed scan over chunks of jax.jvp(fun)
# --------------------------------------------------------------------------- #


def _nonzero(t: Any) -> bool:
    return not isinstance(t, SymbolicZero) and t.dtype != jax.dtypes.float0


def _pad_rows(x: Any, rows: int) -> Any:
    """Pad the leading axis to ``rows`` by repeating the last row (no NaNs from padding)."""
    extra = rows - x.shape[0]
    if not extra:
        return x
    return jnp.concatenate([x, jnp.broadcast_to(x[-1:], (extra, *x.shape[1:]))])


def _pad_zeros(t: Any, rows: int) -> Any:
    extra = rows - t.shape[0]
    return t if not extra else jnp.pad(t, [(0, extra)] + [(0, 0)] * (t.ndim - 1))


def _leaf_tangent(k: _Kernel, out: _Out, y: Any, dy: Any, valid: Any, total: Any) -> tuple:
    """One chunk's contribution to one output leaf's tangent (see :func:`_merge_tangents`).

    add: ``(sum dy,)``; logsumexp: ``(sum exp(y - total) dy,)``; max/min: ``(top, sum of
    dy where y == top, count of ties)`` with ``top`` this chunk's own extremum, so that
    ties are found among values computed the same way (the kernel's ``total`` may
    differ from XLA's recomputation in the last bit).
    """
    if dy.dtype == jax.dtypes.float0:
        return ()
    valid = valid.reshape(valid.shape + (1,) * len(out.trailing))
    axis = 0 if k.reduction.axis == 0 else None
    dy = dy.astype(out.acc_dtype)
    y = y.astype(out.acc_dtype)
    if k.monoid is ADD:
        return (jnp.sum(jnp.where(valid, dy, 0), axis=axis),)
    if k.monoid is LOGSUMEXP:
        return (jnp.sum(jnp.where(valid, jnp.exp(y - total) * dy, 0), axis=axis),)
    top = k.monoid.reduce(jnp.where(valid, y, _identity_scalar(k.monoid, y.dtype)), axis=axis)
    hit = valid & (y == top)
    return top, jnp.sum(jnp.where(hit, dy, 0), axis=axis), jnp.sum(hit.astype(dy.dtype), axis=axis)


def _merge_tangents(monoid: Monoid, a: tuple, b: tuple) -> tuple:
    if monoid in (ADD, LOGSUMEXP) or not a:
        return tuple(u + v for u, v in zip(a, b, strict=True))
    (top_a, dy_a, n_a), (top_b, dy_b, n_b) = a, b
    top = monoid.combine(top_a, top_b)
    in_a, in_b = top_a == top, top_b == top  # both when tied across chunks
    return (
        top,
        jnp.where(in_a, dy_a, 0) + jnp.where(in_b, dy_b, 0),
        jnp.where(in_a, n_a, 0) + jnp.where(in_b, n_b, 0),
    )


def _tangent(
    k: _Kernel,
    consts: Sequence[Any],
    leaves: Sequence[Any],
    dconsts: Sequence[Any],
    dleaves: Sequence[Any],
    totals: Sequence[Any],
) -> list[Any]:
    c_idx = [i for i, t in enumerate(dconsts) if _nonzero(t)]
    x_idx = [i for i, t in enumerate(dleaves) if _nonzero(t)]
    zeros = [
        jnp.zeros(t.shape, t.dtype)
        if jnp.issubdtype(t.dtype, jnp.inexact)
        else np.zeros(t.shape, jax.dtypes.float0)
        for t in totals
    ]
    if not c_idx and not x_idx:
        return zeros
    blocks = k.chunk_blocks
    chunk = blocks * k.rows
    steps = pl.cdiv(k.n, chunk)
    padded = steps * chunk

    def chunks(x):
        return x.reshape(steps, blocks, k.rows, *x.shape[1:])

    xs = [chunks(_pad_rows(x, padded)) for x in leaves]
    dxs = [chunks(_pad_zeros(dleaves[i], padded)) for i in x_idx]
    dcs = [dconsts[i] for i in c_idx]

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def contributions(consts, x_chunk, dc, dx, totals, step):
        def fun_chunk(c_nz, x_nz):
            cvals, xvals = list(consts), list(x_chunk)
            for i, v in zip(c_idx, c_nz, strict=True):
                cvals[i] = v
            for i, v in zip(x_idx, x_nz, strict=True):
                xvals[i] = v
            return jax.vmap(lambda *xb: jax.core.eval_jaxpr(k.jaxpr, cvals, *xb))(*xvals)

        primals = ([consts[i] for i in c_idx], [x_chunk[i] for i in x_idx])
        ys, dys = jax.jvp(fun_chunk, primals, (dc, dx))
        valid = step * chunk + lax.iota(jnp.int32, chunk) < k.n
        return [
            _leaf_tangent(
                k, out, y.reshape(chunk, *out.trailing), dy.reshape(chunk, *out.trailing), valid, t
            )
            for y, dy, out, t in zip(ys, dys, k.outs, totals, strict=True)
        ]

    def step_fn(carry, inp):
        x_chunk, dx_chunk, step = inp
        new = contributions(consts, x_chunk, dcs, dx_chunk, list(totals), step)
        merged = [_merge_tangents(k.monoid, a, b) for a, b in zip(carry, new, strict=True)]
        return merged, None

    def start(leaf):  # zeros, and the identity for a max/min leaf's running extremum
        parts = [jnp.zeros(p.shape, p.dtype) for p in leaf]
        if parts and k.monoid not in (ADD, LOGSUMEXP):
            parts[0] = jnp.full(leaf[0].shape, _identity_scalar(k.monoid, leaf[0].dtype))
        return tuple(parts)

    inputs = (xs, dxs, jnp.arange(steps, dtype=jnp.int32))
    first = jax.tree.map(lambda v: v[0], inputs)
    shapes = jax.eval_shape(contributions, consts, first[0], dcs, first[1], list(totals), first[2])
    sums, _ = lax.scan(step_fn, [start(leaf) for leaf in shapes], inputs)
    result = []
    for parts, zero in zip(sums, zeros, strict=True):
        if not parts:
            result.append(zero)
        elif k.monoid in (ADD, LOGSUMEXP):
            result.append(parts[0])
        else:
            result.append(parts[1] / parts[2])
    return result


def _differentiable(k: _Kernel) -> Callable[[list[Any], list[Any]], list[Any]]:
    @jax.custom_jvp
    def run(consts, leaves):
        return _forward(k, consts, leaves)

    def run_jvp(primals, tangents):
        consts, leaves = primals
        dconsts, dleaves = tangents
        totals = run(consts, leaves)
        return totals, _tangent(k, consts, leaves, dconsts, dleaves, totals)

    run.defjvp(run_jvp, symbolic_zeros=True)
    return run


# --------------------------------------------------------------------------- #
# Planning: block sizes, static rules and the lowering probe
# --------------------------------------------------------------------------- #

_ROW_HINTS: collections.OrderedDict[Any, tuple[int, int]] = collections.OrderedDict()
_PROBES: collections.OrderedDict[Any, str | None] = collections.OrderedDict()
_CACHE_SIZE = 256


def _remember(cache: collections.OrderedDict, key: Any, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)


def _hint_key(fun, leaves, treedef, reduction, target, max_rows):
    try:
        hash(fun)
    except TypeError:
        return None
    avals = tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in leaves)
    return (fun, treedef, avals, reduction, target.platform, max_rows)


def _make_kernel(
    jaxpr: Any,
    consts: Sequence[Any],
    out_shape: Any,
    leaves: Sequence[Any],
    reduction: MonoidReduction,
    *,
    n: int,
    rows: int,
    max_rows: int | None,
    target: _Target,
    interpret: bool,
    steps: int | None = None,
) -> tuple[_Kernel, Any]:
    out_leaves, out_tree = jax.tree.flatten(out_shape)
    reduced = jax.tree.leaves(jax.eval_shape(reduction.reduce_chunk, out_leaves))
    outs = tuple(
        _Out(tuple(y.shape[1:]), _acc_dtype(reduction.monoid, r.dtype), np.dtype(r.dtype))
        for y, r in zip(out_leaves, reduced, strict=True)
    )
    grid = pl.cdiv(n, rows)
    chunk_blocks = grid if max_rows is None else max(1, min(grid, max_rows // rows))
    k = _Kernel(
        jaxpr=jaxpr,
        const_avals=tuple(jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c)) for c in consts),
        in_avals=tuple(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) for x in leaves),
        outs=outs,
        reduction=reduction,
        n=n,
        rows=rows,
        steps=_choose_steps(target, n, rows) if steps is None else steps,
        chunk_blocks=chunk_blocks,
        target=target,
        interpret=interpret,
    )
    return k, out_tree


def _static_problem(xs: Any, reduction: Any, target: _Target) -> str | None:
    if not isinstance(reduction, MonoidReduction) or reduction.monoid not in MONOIDS:
        return f"reduction {reduction!r} is not a recognized monoid reduction"
    if reduction.axis not in (None, 0):
        return f"the kernel reduces axis 0 or all axes, not axis={reduction.axis!r}"
    try:
        leaves, _, _ = _input_leaves(xs)
    except (TypeError, ValueError) as e:
        return str(e)
    return _dtype_problem(target, [np.dtype(x.dtype) for x in leaves], "the inputs")


def _lower_kernel(k: _Kernel) -> str:
    """Lower the kernel alone for ``k.target`` (abstract device when none is present)."""
    args = [_kernel_const_aval(a) for a in k.const_avals] + list(k.in_avals)
    call = _pallas_call(k)
    platform = k.target.platform
    if platform == "cpu":
        return jax.jit(call).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    mesh = contextlib.nullcontext()
    if not _has_devices(platform):
        mesh = jax.sharding.use_abstract_mesh(_abstract_mesh(platform))
    with mesh, _quiet_triton():
        lowered = jax.jit(call).trace(*args).lower(lowering_platforms=(platform,))
        if _has_devices(platform):
            lowered.compile()  # catches resource errors only a real compile reports
        return lowered.as_text()


def _has_devices(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))  # backend names: "cuda", "rocm", "tpu"
    except Exception:  # RuntimeError (no such backend) or a failed plugin initialization
        return False


def _abstract_mesh(platform: str) -> jax.sharding.AbstractMesh:
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    if platform == "tpu":
        device = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    else:
        device = AbstractDevice(
            device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform=platform
        )
    return AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)


def _probe(k: _Kernel) -> str | None:
    key = (
        k.target.platform,
        str(k.jaxpr),
        k.const_avals,
        k.in_avals,
        k.outs,
        k.reduction,
        k.rows,
        k.steps,
        k.interpret,
    )
    if key in _PROBES:
        return _PROBES[key]
    try:
        _lower_kernel(k)
        problem = None
    except Exception as e:  # lowering reports unsupported ops with many exception types
        message = " ".join(str(e).split())
        message = re.sub(r"\s*(Please file an issue|Traceback|File \").*", "", message)[:400]
        problem = f"the {k.target.label} lowering failed: {type(e).__name__}: {message}"
    _remember(_PROBES, key, problem)
    return problem


def kernel_problem(
    fun: Callable,
    xs: Any,
    reduction: MonoidReduction,
    *,
    platform: str,
    max_rows: int | None,
) -> str | None:
    """Why the fused kernel cannot run this call on ``platform``, or None if it can.

    Static rules (inputs, dtypes, block sizes, array sizes) come first; then ``fun``
    is traced once on a small block and the kernel alone is lowered for the
    platform (cached by jaxpr and shapes). Without such hardware present, GPU
    lowering targets an abstract NVIDIA H100 and TPU lowering an abstract TPU v5
    lite.

    Parameters
    ----------
    fun : callable
        Batched function of a pytree of ``(rows, ...)`` leaves.
    xs : pytree
        Arrays or ``jax.ShapeDtypeStruct`` sharing a leading size ``n``.
    reduction : MonoidReduction
        The recognized reduction.
    platform : str
        ``"cpu"`` (interpret mode), ``"gpu"``/``"cuda"``/``"rocm"`` (Triton) or
        ``"tpu"`` (Mosaic).
    max_rows : int or None
        The user's ``batch_size``: an upper bound on the kernel block.

    Returns
    -------
    str or None
        A short human-readable reason, or None when the kernel supports the call.
    """
    try:
        target = _target(platform)
    except ValueError as e:
        return str(e)
    problem = _static_problem(xs, reduction, target)
    if problem:
        return problem
    leaves, treedef, n = _input_leaves(xs)
    one_d = any(len(x.shape) == 1 for x in leaves)
    rows = _choose_block(target, n, max_rows, *_row_stats(leaves), one_d)
    if isinstance(rows, str):
        return rows
    probe_rows = rows if target.mosaic and rows == n else min(rows, _PROBE_ROWS[target.platform])
    if target.mosaic and one_d and probe_rows != rows:
        probe_rows = 128
    try:
        closed, out_shape = _trace(fun, leaves, treedef, probe_rows)
    except Exception as e:  # fun may not trace on other row counts; the scan engine will
        return f"fun could not be traced on a block of {probe_rows} rows: {type(e).__name__}: {e}"
    problem = _output_problem(out_shape, probe_rows)
    if problem:
        return problem
    analysis = _analyze(closed.jaxpr, probe_rows)
    reduced = jax.eval_shape(reduction.reduce_chunk, out_shape)
    out_dtypes = [np.dtype(r.dtype) for r in jax.tree.leaves(reduced)]
    acc = [_acc_dtype(reduction.monoid, dt) for dt in out_dtypes]
    problem = _dtype_problem(target, [dt for _, dt in analysis.avals] + out_dtypes + acc, "fun")
    if problem:
        return problem
    if target.triton:
        problem = _triton_size_problem(target, analysis, probe_rows)
        if problem:
            return problem
    rows = _choose_block(target, n, max_rows, analysis.row_elems, analysis.row_bytes, one_d)
    if isinstance(rows, str):
        return rows
    key = _hint_key(fun, leaves, treedef, reduction, target, max_rows)
    if key is not None:
        _remember(_ROW_HINTS, key, (analysis.row_elems, analysis.row_bytes))
    k, _ = _make_kernel(
        closed.jaxpr,
        closed.consts,
        out_shape,
        leaves,
        reduction,
        n=n,
        rows=probe_rows,
        max_rows=max_rows,
        target=target,
        interpret=target.platform == "cpu",
        steps=min(2, _choose_steps(target, n, rows)),  # cover the in-kernel loop if used
    )
    return _probe(k)


def kernel_block_rows(
    fun: Callable, xs: Any, reduction: MonoidReduction, *, platform: str, max_rows: int | None
) -> int | None:
    """The kernel block (rows) :func:`fused_reduce` will start from, without tracing.

    Uses what :func:`kernel_problem` learned about ``fun``; None if no block fits.
    """
    target = _target(platform)
    leaves, treedef, n = _input_leaves(xs)
    rows = _first_block(fun, leaves, treedef, n, reduction, target, max_rows)
    return None if isinstance(rows, str) else rows


def _first_block(fun, leaves, treedef, n, reduction, target, max_rows) -> int | str:
    key = _hint_key(fun, leaves, treedef, reduction, target, max_rows)
    stats = _ROW_HINTS.get(key) if key is not None else None
    if stats is None:
        stats = _row_stats(leaves)
    one_d = any(len(x.shape) == 1 for x in leaves)
    return _choose_block(target, n, max_rows, *stats, one_d)


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #


def fused_reduce(
    fun: Callable,
    xs: Any,
    reduction: MonoidReduction,
    *,
    max_rows: int | None,
    interpret: bool,
    platform: str | None = None,
) -> Any:
    """``reduction.reduce_chunk(fun(xs))`` computed by one Pallas kernel.

    Parameters
    ----------
    fun : callable
        Batched, row-wise function of a pytree of ``(rows, ...)`` leaves returning a
        pytree of ``(rows, ...)`` leaves. It is traced once (on one kernel block),
        twice only when its intermediates turn out too large for the first block
        tried on GPU/TPU and :func:`kernel_problem` did not run first.
    xs : pytree
        Arrays sharing a leading size ``n >= 1`` (the mapped rows).
    reduction : MonoidReduction
        Monoid and axes; the result matches ``reduction.reduce_chunk(fun(xs))``.
    max_rows : int or None
        Most rows processed at once (the user's ``batch_size``): bounds the kernel
        block and the chunks of the differentiation scan.
    interpret : bool
        Run the kernel in Pallas interpret mode (any platform, e.g. CPU).
    platform : str, optional
        Compiled lowering target when ``interpret`` is False; defaults to
        ``jax.default_backend()``.

    Returns
    -------
    pytree
        The reduced outputs, with the shapes and dtypes of ``reduction.reduce_chunk``.
    """
    if max_rows is not None and (isinstance(max_rows, bool) or int(max_rows) != max_rows):
        raise TypeError(f"max_rows={max_rows!r} must be a positive int or None")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows={max_rows} must be a positive int or None")
    problem = _static_problem(xs, reduction, _TARGETS["cpu"])
    if problem:
        raise ValueError(f"fused_reduce cannot run: {problem}")
    if interpret:
        target = _TARGETS["cpu"]
    else:
        target = _target(platform or jax.default_backend())
        if target.platform == "cpu":
            raise ValueError(
                "Pallas has no compiled CPU lowering; call fused_reduce(..., interpret=True) on CPU"
            )
        if target.triton:
            _silence_triton_deprecation()
    leaves, treedef, n = _input_leaves(xs)
    rows = _first_block(fun, leaves, treedef, n, reduction, target, max_rows)
    if isinstance(rows, str):
        raise NotImplementedError(f"fused_reduce cannot run: {rows}")
    closed, out_shape = _trace(fun, leaves, treedef, rows)
    problem = _output_problem(out_shape, rows)
    if problem:
        raise ValueError(problem)
    if target.platform != "cpu":
        analysis = _analyze(closed.jaxpr, rows)
        one_d = any(len(x.shape) == 1 for x in leaves)
        better = _choose_block(target, n, max_rows, analysis.row_elems, analysis.row_bytes, one_d)
        if isinstance(better, int) and better < rows:  # fun's intermediates need smaller blocks
            rows = better
            closed, out_shape = _trace(fun, leaves, treedef, rows)
    k, out_tree = _make_kernel(
        closed.jaxpr,
        closed.consts,
        out_shape,
        leaves,
        reduction,
        n=n,
        rows=rows,
        max_rows=max_rows,
        target=target,
        interpret=bool(interpret),
    )
    totals = _differentiable(k)(list(closed.consts), list(leaves))
    outs = [t.astype(o.out_dtype) for t, o in zip(totals, k.outs, strict=True)]
    return jax.tree.unflatten(out_tree, outs)
