"""Library options: which engine runs, rematerialization, native kernels, how
rows that do not fill a chunk are handled, the memory budget of
``batch_size="auto"`` and progress reporting.

Set them for a block of code with :func:`config`, or for a process with the
environment variables ``ADV_JAX_MATH_BACKEND``, ``ADV_JAX_MATH_REMAT``,
``ADV_JAX_MATH_NATIVE``, ``ADV_JAX_MATH_REMAINDER``, ``ADV_JAX_MATH_MEMORY_BUDGET``,
``ADV_JAX_MATH_AUTOTUNE_CACHE``, ``ADV_JAX_MATH_AUTOTUNE_GRAD`` and
``ADV_JAX_MATH_PROGRESS`` (read when no :func:`config` block is active).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re
from collections.abc import Iterator
from typing import Any

__all__ = [
    "AUTOTUNE_GRAD_MODES",
    "BACKENDS",
    "NATIVE_MODES",
    "REMAINDER_MODES",
    "Options",
    "config",
    "current",
    "parse_bytes",
]

BACKENDS = ("auto", "scan", "pallas", "interpret")
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
    if number <= 0:
        raise ValueError(f"{name}={value!r} must be positive")
    return int(number)


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
        except slices of the inputs, which are taken again.
    remainder : str
        When ``n`` is not a multiple of the chunk rows (maps and recognized
        reductions): ``"overlap"`` runs equal chunks of at most ``batch_size`` rows,
        balanced so that the last one repeats the fewest rows of the one before
        (one copy of ``fun`` in the compiled program, a few rows computed twice);
        ``"separate"`` runs full chunks of ``batch_size`` rows and the remainder
        apart (no repeated rows, two copies of ``fun``); ``"auto"`` overlaps unless
        more than 1/8 of the rows would be repeated.
    native : str
        ``"auto"`` uses native CPU kernels when they are built, ``"off"`` never,
        ``"require"`` raises if they cannot be loaded.
    memory_budget : int or None
        Bytes of compiled temporary memory a call with ``batch_size="auto"`` may
        use (per device with ``shard=True``). Set it as bytes or a string
        (``"512MiB"``, ``"2GB"``). None: half of the memory the target device has
        free when the call is traced (``Device.memory_stats()`` on GPU/TPU, the
        available system memory on CPU).
    autotune_cache : str or None
        A JSON file where ``batch_size="auto"`` decisions are kept across
        processes (they are always cached in memory).
    autotune_grad : str
        Whether ``batch_size="auto"`` measures the backward pass too: ``"auto"``
        when a mapped input or a value ``fun`` closes over is being
        differentiated (a float tracer of ``jax.grad``/``jax.vjp``/``jax.jvp``,
        seen when the call is traced); ``"always"`` (e.g. for ``jax.grad`` of a
        ``jax.jit``-compiled function, where that cannot be seen) or ``"never"``.
    progress : bool
        Report chunks done, rows per second and time left on stderr while the
        chunk loop runs (adds nothing to compiled programs when off).
    """

    backend: str = "auto"
    remat: bool = True
    native: str = "auto"
    remainder: str = "auto"
    memory_budget: int | None = None
    autotune_cache: str | None = None
    autotune_grad: str = "auto"
    progress: bool = False

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
        if self.autotune_grad not in AUTOTUNE_GRAD_MODES:
            raise ValueError(
                f"autotune_grad={self.autotune_grad!r} is not one of {AUTOTUNE_GRAD_MODES}"
            )
        if not isinstance(self.progress, bool):
            raise TypeError(f"progress={self.progress!r} must be a bool")


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: use one of {_TRUE + _FALSE}")


def _from_env() -> Options:
    return Options(
        backend=os.environ.get("ADV_JAX_MATH_BACKEND", "auto").strip().lower() or "auto",
        remat=_env_bool("ADV_JAX_MATH_REMAT", True),
        native=os.environ.get("ADV_JAX_MATH_NATIVE", "auto").strip().lower() or "auto",
        remainder=os.environ.get("ADV_JAX_MATH_REMAINDER", "auto").strip().lower() or "auto",
        memory_budget=parse_bytes(
            os.environ.get("ADV_JAX_MATH_MEMORY_BUDGET"), "ADV_JAX_MATH_MEMORY_BUDGET"
        ),
        autotune_cache=os.environ.get("ADV_JAX_MATH_AUTOTUNE_CACHE") or None,
        autotune_grad=os.environ.get("ADV_JAX_MATH_AUTOTUNE_GRAD", "auto").strip().lower()
        or "auto",
        progress=_env_bool("ADV_JAX_MATH_PROGRESS", False),
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
    progress: bool | None = None,
) -> Iterator[Options]:
    """Override options for a block of code; unset ones keep their current value.

    Options are read when a call is traced, so a ``jax.jit``-compiled function keeps
    the engine (and the ``batch_size="auto"`` choice) it was traced with. See
    :class:`Options` for each option.

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
        "progress": progress,
    }
    opts = dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})
    token = _active.set(opts)
    try:
        yield opts
    finally:
        _active.reset(token)
