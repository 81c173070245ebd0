"""Native CPU kernels: a one-pass logsumexp reduction as an XLA FFI custom call.

The C++ source is ``kernels/cpu/logsumexp.cc``; CMake builds it into
``adv_jax_math/_native_cpu.so`` (a plain shared library whose name only looks like
an extension module, so :func:`importlib.util.find_spec` finds it in wheels and
editable installs). It is loaded lazily, once, with :mod:`ctypes`, and registered
with :func:`jax.ffi.register_ffi_target` for the CPU platform.

Whether it is used follows ``adv_jax_math._config.current().native``: ``"auto"``
(use it when it loads), ``"off"`` (never) or ``"require"`` (raise when it cannot be
loaded). ``ADV_JAX_MATH_NATIVE_LIB=<path>`` loads a specific library file instead
(the AddressSanitizer build, for instance).
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

from .. import _config

__all__ = ["ENV_LIB", "TARGET", "logsumexp", "status", "worth_it"]

TARGET = "adv_jax_math_logsumexp"
"""Name of the FFI target; it appears in the lowered text of a call that uses it."""
ENV_LIB = "ADV_JAX_MATH_NATIVE_LIB"
_ENV_MODE = "ADV_JAX_MATH_NATIVE"
_SYMBOL = "AdvJaxMathLogsumexp"
_LIB_MODULE = "adv_jax_math._native_cpu"
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

# Chunks below this many elements are left to XLA, which fuses a small reduction into
# the code that produces the chunk; the custom call costs ~0.3 us more per call.
# Measured in a lax.scan over 2^16 rows (bench/bench_native.py::test_chunk_threshold,
# a busy 2-core AMD EPYC): XLA/native time ratio 0.3 at 64 elements per chunk, 0.7 at
# 256, 1.1-2.7 at 1024 and 1.2-8 at 4096 and above in float32; float64 alike (0.3-0.5,
# 0.8-1.0, 1.3-2.5).
MIN_ELEMENTS = 1 << 10

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
    """Run the kernel once on a tiny input; raise if it errs or disagrees with numpy."""
    x = np.array([[0.0, -np.inf, 1.0], [np.log(3.0), -np.inf, np.inf]], np.float32)
    with np.errstate(divide="ignore"):
        expected = np.log(np.exp(x.astype(np.float64)).sum(axis=0)).astype(np.float32)
    cpu = jax.devices("cpu")[0]
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(cpu))
    call = functools.partial(_ffi_logsumexp, axis=0)
    with jax.ensure_compile_time_eval():  # run now, even when first called inside a trace
        got = np.asarray(jax.jit(call).lower(spec).compile()(jax.device_put(x, cpu)))
    if not np.allclose(got, expected, rtol=1e-6, equal_nan=True):
        raise RuntimeError(f"self-test gave {got.tolist()}, expected {expected.tolist()}")


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
            handler = getattr(lib, _SYMBOL)
        except (OSError, AttributeError) as err:
            return False, f"cannot load {path}: {err}"
        if _registered is None:
            try:
                jax.devices("cpu")  # start the backend first: a bad handler then fails here
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
            except Exception as err:
                return False, f"cannot register {TARGET} from {path}: {err}"
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
    """Whether the native kernel is usable now, and why (never raises).

    Returns
    -------
    tuple of (bool, str)
        ``(True, "loaded from <path>")``, or ``(False, reason)``: disabled by the
        ``native`` option, library not found, a load or self-test error.
    """
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


def worth_it(shape: Sequence[int], dtype: Any) -> bool:
    """Whether the native kernel is expected to beat XLA for one reduction.

    Only the size and dtype matter: float32/float64 inputs of at least
    ``MIN_ELEMENTS`` elements. This does not check that the library loads; use
    :func:`status` for that.

    Parameters
    ----------
    shape : sequence of int
        Shape of the array to be reduced (e.g. one chunk, ``(rows, ...)``).
    dtype : dtype-like
        Its dtype.
    """
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return False
    return dt in _DTYPES and math.prod(int(d) for d in shape) >= MIN_ELEMENTS


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
    :func:`jax.nn.logsumexp`. Works under ``jit``, ``grad`` and ``vmap``.

    Parameters
    ----------
    x : array_like
        Input.
    axis : int or None
        Axis to reduce (negative counts from the end), or None for all axes.

    Returns
    -------
    jax.Array
        ``x`` with ``axis`` removed (a scalar for ``axis=None``).

    Raises
    ------
    RuntimeError
        With ``native="require"`` when the library cannot be loaded.
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
