"""Native CPU kernels as XLA FFI custom calls: a one-pass logsumexp reduction
(``kernels/cpu/logsumexp.cc``) and a top-k fold (``kernels/cpu/topk.cc``).

CMake builds the C++ sources into
``adv_jax_math/_native_cpu.so`` (a plain shared library whose name only looks like
an extension module, so :func:`importlib.util.find_spec` finds it in wheels and
editable installs). It is loaded lazily, once, with :mod:`ctypes`, and registered
with :func:`jax.ffi.register_ffi_target` for the CPU platform.

Whether :func:`logsumexp` uses it follows ``core.config.current().native``:
``"auto"`` (when it loads), ``"off"`` (never) or ``"require"`` (raise when it cannot
be loaded). Whether ``batch_map``'s chunk loop calls it for a chunk is
:func:`decision` (its reason is what ``explain()`` shows): only for chunks large
enough that it was measured faster than XLA's own reduction there
(:data:`MIN_ELEMENTS`). ``ADV_JAX_MATH_NATIVE_LIB=<path>`` loads a specific library
file instead (the AddressSanitizer build, for instance).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import config as _config

__all__ = [
    "ENV_LIB",
    "MIN_ELEMENTS",
    "TARGET",
    "TOPK_TARGET",
    "decision",
    "logsumexp",
    "status",
    "topk_fold",
    "usable",
    "worth_it",
]

TARGET = "adv_jax_math_logsumexp"
"""Name of the logsumexp's FFI target; it appears in the lowered text of a call that
uses it."""
TOPK_TARGET = "adv_jax_math_topk_fold"
"""Name of the top-k fold's FFI target (:func:`topk_fold`)."""
ENV_LIB = "ADV_JAX_MATH_NATIVE_LIB"
_ENV_MODE = "ADV_JAX_MATH_NATIVE"
_SYMBOLS = {TARGET: "AdvJaxMathLogsumexp", TOPK_TARGET: "AdvJaxMathTopkFold"}
_LIB_MODULE = "adv_jax_math._native_cpu"
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

MIN_ELEMENTS = 1 << 12
"""Chunks below this many elements are left to XLA, which fuses a small reduction
into the code that produces the chunk; the custom call costs ~0.3 us more per call.

Measured side by side in one process (a shared 2-core AMD EPYC, jax 0.12), XLA time /
native time (> 1: the kernel is faster), by minimum (medians alike):

* ``batch_map(..., reduction=LOGSUMEXP)`` of a mixture-style ``-(x - mu)**2 / 2``
  (2^16 rows, 1 to 64 columns, float32, the kernel forced on every chunk;
  ``bench/bench_native.py::test_chunk_threshold`` measures the like in a
  ``lax.scan``): 0.09-0.26
  at 64 elements per chunk, 0.40-0.62 at 256, 0.62-1.40 at 1024, 2.9-9.2 at 4096,
  1.5-3.5 above;
* the same with chunks of 2^18 to 2^24 elements (``bench/bench_native_policy.py``):
  1.65-2.93 (medians 1.38-3.19) for a
  materialized chunk and for ``-(v**2) / eps``; 1.33-2.86 (medians 1.38-2.57) for
  Sinkhorn's ``(f + g - C(x, y)) / eps`` and for ``x @ y.T`` (2000 to 20,000 points
  against 1500 to 15,000), float32 and float64: the custom call stops XLA fusing the
  producer into the reduction, and that costs less than XLA's two passes (max, then
  sum of exp) over each chunk;
* the OTT-JAX Sinkhorn solve (200 iterations, d = 16, 2000 x 1500 points, chunks of
  256 rows) with ``batch_map`` as its logsumexp: 0.82x the time with the kernel.
"""

_lock = threading.Lock()
_registered: str | None = None  # path of the library whose handler is registered
_handles: list[ctypes.CDLL] = []  # keep loaded libraries alive


def _find_library() -> tuple[str | None, str]:
    """Locate the library: ``(path, "")`` or ``(None, reason)``."""
    explicit = os.environ.get(ENV_LIB, "").strip()
    if explicit:
        if os.path.isfile(explicit):
            return explicit, ""
        return None, f"{ENV_LIB}={explicit!r} is not a file; unset it or point it at the library"
    try:
        spec = importlib.util.find_spec(_LIB_MODULE)
    except (ImportError, ValueError) as err:
        spec, detail = None, f" ({err})"
    else:
        detail = ""
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None, (
            f"library not found (package built without CMake?){detail}: "
            "reinstall with `pip install -e .` where cmake and a C++17 compiler are available"
        )
    return spec.origin, ""


def _self_test() -> None:
    """Run the kernels once on tiny inputs; raise if one errs or disagrees with numpy."""
    x = np.array([[0.0, -np.inf, 1.0], [np.log(3.0), -np.inf, np.inf]], np.float32)
    with np.errstate(divide="ignore"):
        expected = np.log(np.exp(x.astype(np.float64)).sum(axis=0)).astype(np.float32)
    cpu = jax.devices("cpu")[0]
    # (jax 0.12.1 deprecates jax.sharding.SingleDeviceSharding for this function)
    one = getattr(jax.sharding, "make_single_device_sharding", None)
    sharding = one(cpu) if one is not None else jax.sharding.SingleDeviceSharding(cpu)
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    call = functools.partial(_ffi_logsumexp, axis=0)
    with jax.ensure_compile_time_eval():  # run now, even when first called inside a trace
        got = np.asarray(jax.jit(call).lower(spec).compile()(jax.device_put(x, cpu)))
    if not np.allclose(got, expected, rtol=1e-6, equal_nan=True):
        raise RuntimeError(f"self-test gave {got.tolist()}, expected {expected.tolist()}")
    # top-2 smallest of rows 0..3 folded into a state holding row 7 (value 1.5)
    block = np.array([[3.0], [1.0], [np.nan], [1.0]], np.float32)
    state = np.array([[1.5], [0.0]], np.float32), np.array([[7], [_EMPTY]], np.int32)
    args = (block, np.arange(4, dtype=np.int32), np.ones(4, np.int32), *state)
    with jax.ensure_compile_time_eval():
        vals, rows = jax.jit(functools.partial(topk_fold, smallest=True))(*args)
    if np.asarray(rows).ravel().tolist() != [1, 3] or np.asarray(vals).ravel().tolist() != [1, 1]:
        raise RuntimeError(f"top-k self-test gave rows {np.asarray(rows).ravel().tolist()}")


@functools.cache
def _load() -> tuple[bool, str]:
    """Find, load, register and self-test the library once: ``(loaded, reason)``."""
    global _registered
    path, why = _find_library()
    if path is None:
        return False, why
    with _lock:
        try:
            lib = ctypes.CDLL(path)
            handlers = {target: getattr(lib, symbol) for target, symbol in _SYMBOLS.items()}
        except (OSError, AttributeError) as err:
            return False, f"cannot load {path}: {err}"
        if _registered is None:
            jax.devices("cpu")  # start the backend first: a bad handler then fails here
            for target, handler in handlers.items():
                try:
                    capsule = jax.ffi.pycapsule(handler)
                    jax.ffi.register_ffi_target(target, capsule, platform="cpu")
                except Exception as err:
                    return False, f"cannot register {target} from {path}: {err}"
            _registered = path
            _handles.append(lib)
    try:
        _self_test()
    except Exception as err:
        return False, f"{_registered} failed its self-test: {err}"
    if _registered != path:
        return True, f"loaded from {_registered} (registered first; {path} not used)"
    return True, f"loaded from {path}"


def _mode() -> str:
    return _config.current().native


def status() -> tuple[bool, str]:
    """Whether the native kernel is usable now, and why (never raises):
    ``(True, "loaded from <path>")``, or ``(False, reason)``: disabled by the
    ``native`` option, library not found, a load or self-test error."""
    if _mode() == "off":
        if os.environ.get(_ENV_MODE, "").strip().lower() == "off":
            return False, f"disabled by {_ENV_MODE}=off"
        return False, "disabled by adv_jax_math.config(native='off')"
    return _load()


def _usable(dtype: np.dtype) -> bool:
    mode = _mode()
    if mode == "off":
        return False
    ok, why = _load()
    if not ok and mode == "require":
        raise RuntimeError(
            f"native kernels are required (native='require') but unavailable: {why}. "
            f"Build them (pip install -e .) or set {_ENV_MODE}=auto"
        )
    return ok and np.dtype(dtype) in _DTYPES


def usable() -> bool:
    """Whether the native kernels run now: the ``native`` option allows them and the
    library loads (with ``"require"``, a library that does not load raises)."""
    return _usable(np.dtype(np.float32))


def decision(shape: Sequence[int], dtype: Any) -> tuple[bool, str]:
    """Whether ``batch_map``'s chunk loop reduces a chunk with the native kernel, and why.

    It does for float32/float64 chunks of at least :data:`MIN_ELEMENTS` elements when
    the ``native`` option allows it and the library loads (with ``"require"``, a
    library that does not load raises when the kernel is called). ``shape`` is one
    chunk's, ``(rows, ...)``, ``dtype`` its dtype after widening (16-bit floats are
    reduced as float32); the sentence is ``explain()``'s.
    """
    mode = _mode()
    if mode == "off":
        return False, f"native logsumexp not used: {status()[1]}"
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return False, f"native logsumexp not used: {dtype!r} is not a dtype"
    if dt not in _DTYPES:
        return False, f"native logsumexp not used: it takes float32/float64 chunks, not {dt}"
    size, rows = math.prod(int(d) for d in shape), "x".join(str(int(d)) for d in shape)
    if size < MIN_ELEMENTS:
        return False, (
            f"native logsumexp not used: a chunk of {size} elements ({rows}) is below "
            f"{MIN_ELEMENTS}, where XLA's fused reduction was faster"
        )
    loaded, why = _load() if mode == "auto" else (True, "")
    if not loaded:
        return False, f"native logsumexp not used: {why}"
    return True, (
        f"native logsumexp reduces each chunk ({rows} {dt}): side by side it was 1.3-9x "
        f"faster than XLA's reduction for chunks of >= {MIN_ELEMENTS} elements "
        "(bench/bench_native_policy.py); config(native='off') leaves it to XLA"
    )


def worth_it(shape: Sequence[int], dtype: Any) -> bool:
    """Whether ``batch_map``'s chunk loop uses the native kernel: :func:`decision`'s
    first element, without its reason."""
    return decision(shape, dtype)[0]


def _ffi_logsumexp(x: jax.Array, axis: int | None) -> jax.Array:
    # The kernel sees x as (*batch, *reduced, *rest) -> (*batch, *rest): no reshape, so
    # XLA keeps the producer's natural shape, and vmap's leading dims are more batch.
    out_shape: tuple[int, ...]
    if axis is None:
        reduced, rest, out_shape = x.ndim, 0, ()
    else:
        reduced, rest, out_shape = 1, x.ndim - axis - 1, x.shape[:axis] + x.shape[axis + 1 :]
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct(out_shape, x.dtype), vmap_method="expand_dims"
    )
    return call(x, reduced_rank=np.int64(reduced), rest_rank=np.int64(rest))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _logsumexp(x: jax.Array, axis: int | None) -> jax.Array:
    return jax.lax.platform_dependent(
        x,
        cpu=functools.partial(_ffi_logsumexp, axis=axis),
        default=functools.partial(jax.nn.logsumexp, axis=axis),
    )


@_logsumexp.defjvp
def _logsumexp_jvp(
    axis: int | None, primals: tuple[jax.Array], tangents: tuple[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    (x,), (t,) = primals, tangents
    y = _logsumexp(x, axis)
    weights = jnp.exp(x - (y if axis is None else jnp.expand_dims(y, axis)))  # softmax
    return y, jnp.sum(weights * t, axis=axis)


def logsumexp(x: Any, axis: int | None = 0) -> jax.Array:
    """``jax.nn.logsumexp(x, axis=axis)``, on CPU through the native kernel.

    The native kernel runs for float32/float64 inputs when the ``native`` option
    allows it and the library loads, and only when the computation is lowered for
    CPU; everything else (other dtypes, platforms, or no library) is
    :func:`jax.nn.logsumexp`. Works under ``jit``, ``grad`` and ``vmap``. ``axis``
    may count from the end, or be None for all axes. Raises RuntimeError with
    ``native="require"`` when the library cannot be loaded.
    """
    x = jnp.asarray(x)
    if axis is not None:
        if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
            raise TypeError(f"axis={axis!r} must be an int or None")
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(f"axis={axis} is out of bounds for an array of shape {x.shape}")
        axis = int(axis) % x.ndim
    if not _usable(x.dtype):
        return jax.nn.logsumexp(x, axis=axis)
    return _logsumexp(x, axis)


_EMPTY = np.iinfo(np.int32).max  # the row of an empty top-k slot (monoids.topk)


def topk_fold(
    values: jax.Array,
    idx: jax.Array,
    alive: jax.Array,
    vals: jax.Array,
    rows: jax.Array,
    smallest: bool,
) -> tuple[jax.Array, jax.Array]:
    """The top-k state ``(vals, rows)`` (``(K, T)``: float32 values and int32 rows of
    each item's ``K`` slots, best first, row ``2**31 - 1`` empty) with the block
    ``values`` (``(R, T)`` float32, the rows ``idx``; those where ``alive`` is 0 left
    out) folded in: the ``K`` best by ``top_k``'s order (``monoids.topk``), ties to the
    lower row. The custom call alone (CPU only, no derivative; leading batch
    dimensions under ``vmap``): ``TopK.fold_into`` decides where it runs."""
    out = (jax.ShapeDtypeStruct(vals.shape, np.float32), jax.ShapeDtypeStruct(rows.shape, np.int32))
    call = jax.ffi.ffi_call(TOPK_TARGET, out, vmap_method="broadcast_all")
    new_vals, new_rows = call(values, idx, alive, vals, rows, smallest=np.int64(smallest))
    return new_vals, new_rows
