"""Library options: which engine runs, rematerialization, native kernels, and how
rows that do not fill a chunk are handled.

Set them for a block of code with :func:`config`, or for a process with the
environment variables ``ADV_JAX_MATH_BACKEND``, ``ADV_JAX_MATH_REMAT``,
``ADV_JAX_MATH_NATIVE`` and ``ADV_JAX_MATH_REMAINDER`` (read when no :func:`config`
block is active).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator

__all__ = ["BACKENDS", "NATIVE_MODES", "REMAINDER_MODES", "Options", "config", "current"]

BACKENDS = ("auto", "scan", "pallas", "interpret")
NATIVE_MODES = ("auto", "off", "require")
REMAINDER_MODES = ("auto", "overlap", "separate")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


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
        gradient memory is O(batch_size) instead of O(n).
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
    """

    backend: str = "auto"
    remat: bool = True
    native: str = "auto"
    remainder: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {BACKENDS}")
        if not isinstance(self.remat, bool):
            raise TypeError(f"remat={self.remat!r} must be a bool")
        if self.native not in NATIVE_MODES:
            raise ValueError(f"native={self.native!r} is not one of {NATIVE_MODES}")
        if self.remainder not in REMAINDER_MODES:
            raise ValueError(f"remainder={self.remainder!r} is not one of {REMAINDER_MODES}")


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
) -> Iterator[Options]:
    """Override options for a block of code; unset ones keep their current value.

    Options are read when a call is traced, so a ``jax.jit``-compiled function keeps
    the engine it was traced with.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import adv_jax_math as ajm
    >>> with ajm.config(backend="scan", remat=False) as opts:
    ...     print(opts.backend, opts.remat)
    scan False
    """
    base = current()
    changes = {"backend": backend, "remat": remat, "native": native, "remainder": remainder}
    opts = dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})
    token = _active.set(opts)
    try:
        yield opts
    finally:
        _active.reset(token)
