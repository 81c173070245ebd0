"""Library options: which engine runs, rematerialization, native kernels, how
rows that do not fill a chunk are handled, the memory budget of
``batch_size="auto"`` and progress reporting.

Set them for a block of code with :func:`config`, or for a process with the
environment variables ``ADV_JAX_MATH_BACKEND``, ``ADV_JAX_MATH_REMAT``,
``ADV_JAX_MATH_NATIVE``, ``ADV_JAX_MATH_REMAINDER``, ``ADV_JAX_MATH_MEMORY_BUDGET``,
``ADV_JAX_MATH_AUTOTUNE_CACHE``, ``ADV_JAX_MATH_AUTOTUNE_GRAD``,
``ADV_JAX_MATH_ROOFLINE``, ``ADV_JAX_MATH_PROGRESS`` and ``ADV_JAX_MATH_GPU_BACKEND``
(read when no :func:`config` block is active). A bad
value raises an error naming the option (or the variable), the value given and
what is accepted.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import jax

__all__ = [
    "AUTOTUNE_GRAD_MODES",
    "BACKENDS",
    "GPU_BACKENDS",
    "NATIVE_MODES",
    "REMAINDER_MODES",
    "Options",
    "check_cache_path",
    "config",
    "current",
    "parse_bytes",
]

BACKENDS = ("auto", "scan", "pallas", "interpret")
GPU_BACKENDS = ("auto", "mosaic_gpu", "triton")
NATIVE_MODES = ("auto", "off", "require")
REMAINDER_MODES = ("auto", "overlap", "separate")
AUTOTUNE_GRAD_MODES = ("auto", "always", "never")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | str | None, name: str = "memory_budget") -> int | None:
    """Bytes from an int or a string such as ``"512MiB"``, ``"2GB"``, ``"1.5 GiB"``.

    ``None`` (and ``""``) stays None: the default budget (see :class:`Options`).
    ``name`` (the option or environment variable) is what error messages name.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a number of bytes or a string like '512MiB'")
    number: float
    if isinstance(value, int | float):
        number = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = match and match.group(2).lower()
        if not match or unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size; use bytes (an int) or a string like "
                "'512MiB', '2GB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        number = float(match.group(1)) * _UNITS[unit]
    else:
        raise TypeError(f"{name}={value!r} must be an int or a str, not {type(value).__name__}")
    if not math.isfinite(number) or number < 1:
        need = "be at least 1 byte" if math.isfinite(number) else "be a finite number of bytes"
        raise ValueError(
            f"{name}={value!r} must {need}; use bytes (an int) or a string like '512MiB', "
            "or None for the default budget"
        )
    return int(number)


def check_cache_path(path: str, name: str = "autotune_cache") -> None:
    """Raise unless ``path`` can be a cache file: not a directory, in a directory that
    exists (the file itself is created when the first decision is stored)."""
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"{name}={path!r} is a directory; name a JSON file in it, e.g. "
            f"{os.path.join(path, 'autotune.json')!r} (created when the first decision is stored)"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is not a directory" if os.path.exists(folder) else "does not exist"
        raise FileNotFoundError(
            f"{name}={path!r}: the directory {folder!r} {what}; create it first (the file "
            "is created when the first decision is stored) or name a file in an existing one"
        )


@dataclasses.dataclass(frozen=True)
class Options:
    """The options in force.

    Attributes
    ----------
    backend : str
        ``"auto"`` (fastest engine that supports the call), ``"scan"`` (the
        ``lax.scan`` engine), ``"pallas"`` (force the fused kernel; error if it
        cannot lower) or ``"interpret"`` (the kernel in interpret mode, any platform).
    remat : bool
        Rematerialize each chunk in the backward pass (``jax.checkpoint``) so that
        gradient memory is O(batch_size) instead of O(n). Off, a gradient stores
        ``fun``'s intermediates for every chunk (O(n) memory, no recomputation)
        except slices of the inputs, which are taken again. Off is rarely
        faster: side by side on 2 CPU cores (``bench/bench_native_policy.py``),
        ``jax.value_and_grad`` with it off took 0.95-4.9x the time (by minimum;
        medians 0.88-4.8) with 8.5-131x the compiled temp memory, for
        Sinkhorn-like logsumexps, elementwise sums and ``tanh(x @ W)`` sums;
        recomputing a chunk is cheaper than storing and reloading its
        intermediates. It won (0.88-0.95x) only for a small ``tanh(x @ W)``
        whose stored intermediates stay in cache: measure before turning it off.
    remainder : str
        When ``n`` is not a multiple of the chunk rows (maps and recognized
        reductions): ``"overlap"`` runs equal chunks of at most ``batch_size`` rows,
        balanced so that the last one repeats the fewest rows of the one before
        (one copy of ``fun`` in the compiled program, a few rows computed twice);
        ``"separate"`` runs full chunks of ``batch_size`` rows and the remainder
        apart (no repeated rows, two copies of ``fun``); ``"auto"`` overlaps unless
        more than 1/8 of the rows would be repeated.
    native : str
        The native CPU logsumexp kernel. ``"auto"``: the scan engine reduces
        float32/float64 logsumexp chunks of at least 4096 elements with it when it
        is built (measured 1.3-9x faster than XLA's reduction there, and slower
        below; ``kernels.native.MIN_ELEMENTS``); ``"off"``: never;
        ``"require"``: as ``"auto"``, raising if it cannot be loaded.
    memory_budget : int or None
        Bytes of compiled temporary memory a call with ``batch_size="auto"`` may
        use (per device with ``shard=True``). Set it as bytes or a string
        (``"512MiB"``, ``"2GB"``). None: half of the memory the target device has
        free when the call is traced (``Device.memory_stats()`` on GPU/TPU, the
        available system memory on CPU).
    autotune_cache : str or None
        A JSON file where ``batch_size="auto"`` decisions are kept across
        processes (they are always cached in memory). Its directory must exist; the
        file is created when the first decision is stored. An entry that is not a
        valid decision for its call (edited by hand, corrupt) is recomputed with a
        warning and replaced; a file that is not a JSON object of entries is left as
        it is, with a warning, and decisions are then kept in memory only.
    autotune_grad : str
        Whether ``batch_size="auto"`` measures the backward pass too: ``"auto"``
        when a mapped input or a value ``fun`` closes over is being
        differentiated (a float tracer of ``jax.grad``/``jax.vjp``/``jax.jvp``,
        seen when the call is traced); ``"always"`` (e.g. for ``jax.grad`` of a
        ``jax.jit``-compiled function, where that cannot be seen) or ``"never"``.
    roofline : bool
        Let the roofline model (``explain()``'s ``model`` lines) veto a fused
        kernel: with ``backend="auto"``, where the model says the scan engine is
        faster for a pass (forward, or reverse mode's backward kernels), the scan
        engine runs it. False: the kernel runs wherever it can.
    progress : bool
        Report chunks done, rows per second and time left on stderr while the
        chunk loop runs (adds nothing to compiled programs when off).
    gpu_backend : str
        Which Pallas backend builds the fused kernel and the pairwise tile kernel on
        NVIDIA GPUs: ``"auto"`` (Mosaic GPU on Hopper and newer where it compiles,
        else Triton; ``explain()`` says which and why), ``"mosaic_gpu"`` or
        ``"triton"`` (that one only, for testing; the scan engine runs where it
        cannot). With ``backend="interpret"``, ``"mosaic_gpu"`` runs the Mosaic GPU
        kernels in its CPU interpreter.
    """

    backend: str = "auto"
    remat: bool = True
    native: str = "auto"
    remainder: str = "auto"
    memory_budget: int | None = None
    autotune_cache: str | None = None
    autotune_grad: str = "auto"
    roofline: bool = True
    progress: bool = False
    gpu_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {BACKENDS}")
        if not isinstance(self.remat, bool):
            raise TypeError(f"remat={self.remat!r} must be a bool")
        if self.native not in NATIVE_MODES:
            raise ValueError(f"native={self.native!r} is not one of {NATIVE_MODES}")
        if self.remainder not in REMAINDER_MODES:
            raise ValueError(f"remainder={self.remainder!r} is not one of {REMAINDER_MODES}")
        object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        if self.autotune_cache is not None and not isinstance(
            self.autotune_cache, str | os.PathLike
        ):
            raise TypeError(f"autotune_cache={self.autotune_cache!r} must be a path or None")
        if self.autotune_cache is not None:
            object.__setattr__(self, "autotune_cache", os.fspath(self.autotune_cache))
            check_cache_path(self.autotune_cache)
        if self.autotune_grad not in AUTOTUNE_GRAD_MODES:
            raise ValueError(
                f"autotune_grad={self.autotune_grad!r} is not one of {AUTOTUNE_GRAD_MODES}"
            )
        if not isinstance(self.roofline, bool):
            raise TypeError(f"roofline={self.roofline!r} must be a bool")
        if not isinstance(self.progress, bool):
            raise TypeError(f"progress={self.progress!r} must be a bool")
        if self.gpu_backend not in GPU_BACKENDS:
            raise ValueError(f"gpu_backend={self.gpu_backend!r} is not one of {GPU_BACKENDS}")


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{name}={raw!r} is not a boolean; set it to one of {_TRUE + _FALSE} or unset it"
    )


def _env_choice(name: str, option: str, choices: tuple[str, ...]) -> str:
    """The value of variable ``name`` (lower case; "auto" when unset or empty), which
    must be one of ``choices``."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or "auto"
    if value not in choices:
        raise ValueError(
            f"{name}={raw!r} is not accepted: {option}={value!r} is not one of {choices}; "
            f"set {name} to one of them or unset it"
        )
    return value


def _from_env() -> Options:
    cache = os.environ.get("ADV_JAX_MATH_AUTOTUNE_CACHE") or None
    if cache is not None:
        check_cache_path(cache, "ADV_JAX_MATH_AUTOTUNE_CACHE")
    return Options(
        backend=_env_choice("ADV_JAX_MATH_BACKEND", "backend", BACKENDS),
        remat=_env_bool("ADV_JAX_MATH_REMAT", True),
        native=_env_choice("ADV_JAX_MATH_NATIVE", "native", NATIVE_MODES),
        remainder=_env_choice("ADV_JAX_MATH_REMAINDER", "remainder", REMAINDER_MODES),
        memory_budget=parse_bytes(
            os.environ.get("ADV_JAX_MATH_MEMORY_BUDGET"), "ADV_JAX_MATH_MEMORY_BUDGET"
        ),
        autotune_cache=cache,
        autotune_grad=_env_choice(
            "ADV_JAX_MATH_AUTOTUNE_GRAD", "autotune_grad", AUTOTUNE_GRAD_MODES
        ),
        roofline=_env_bool("ADV_JAX_MATH_ROOFLINE", True),
        progress=_env_bool("ADV_JAX_MATH_PROGRESS", False),
        gpu_backend=_env_choice("ADV_JAX_MATH_GPU_BACKEND", "gpu_backend", GPU_BACKENDS),
    )


_active: contextvars.ContextVar[Options | None] = contextvars.ContextVar(
    "adv_jax_math_options", default=None
)


def current() -> Options:
    """The options in force: the innermost :func:`config` block, else the environment."""
    return _active.get() or _from_env()


@contextlib.contextmanager
def config(
    *,
    backend: str | None = None,
    remat: bool | None = None,
    native: str | None = None,
    remainder: str | None = None,
    memory_budget: int | str | None = None,
    autotune_cache: str | os.PathLike | None = None,
    autotune_grad: str | None = None,
    roofline: bool | None = None,
    progress: bool | None = None,
    gpu_backend: str | None = None,
) -> Iterator[Options]:
    """Override options for a block of code; unset ones keep their current value.

    Options are read when a call is traced. From jax 0.12 on they are part of
    ``jax.jit``'s cache key: a jitted function called under other options is traced
    again. With older jax a ``jax.jit``-compiled function keeps the engine (and the
    ``batch_size="auto"`` choice) it was traced with. See :class:`Options` for each
    option.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> with ajm.config(backend="scan", remat=False) as opts:
    ...     print(opts.backend, opts.remat)
    scan False
    """
    base = current()
    changes: dict[str, Any] = {
        "backend": backend,
        "remat": remat,
        "native": native,
        "remainder": remainder,
        "memory_budget": memory_budget,
        "autotune_cache": autotune_cache,
        "autotune_grad": autotune_grad,
        "roofline": roofline,
        "progress": progress,
        "gpu_backend": gpu_backend,
    }
    opts = dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})
    token = _active.set(opts)
    try:
        with _in_jit_key(opts):
            yield opts
    finally:
        _active.reset(token)


# The options of a config() block are part of JAX's tracing and compilation cache
# key (jax >= 0.12: jax.make_user_context): a jitted function called in blocks with
# other options is traced again, not handed the plan of the first block.
_JIT_KEY = jax.make_user_context(None) if hasattr(jax, "make_user_context") else None


def _in_jit_key(opts: Options) -> contextlib.AbstractContextManager[Any]:
    return _JIT_KEY(opts) if _JIT_KEY is not None else contextlib.nullcontext()
