"""The dispatch probe: lower (and, where a compiler is present, compile) the kernel
alone for its target, once per jaxpr, shapes, block and target (cached)."""

from __future__ import annotations

import collections
import contextlib
import re
from typing import Any

import jax

from .kernel import Kernel, kernel_const_aval, pallas_call
from .targets import abstract_mesh, has_devices, quiet_triton

__all__ = ["probe"]

_CACHE_SIZE = 256
_PROBES: collections.OrderedDict[Any, str | None] = collections.OrderedDict()


def _lower(k: Kernel) -> None:
    """Lower the kernel alone for ``k.target`` (an abstract device when none is
    present); compile it too where the platform's devices are present."""
    args = [kernel_const_aval(a) for a in k.const_avals] + list(k.in_avals)
    call = pallas_call(k)
    platform = k.target.platform
    if platform == "cpu":
        jax.jit(call).trace(*args).lower(lowering_platforms=("cpu",))
        return
    present = has_devices(platform)
    mesh = (
        contextlib.nullcontext()
        if present
        else jax.sharding.use_abstract_mesh(abstract_mesh(platform))
    )
    with mesh, quiet_triton():
        lowered = jax.jit(call).trace(*args).lower(lowering_platforms=(platform,))
        if present:
            lowered.compile()  # catches resource errors only a real compile reports


def probe(k: Kernel) -> str | None:
    """Why the kernel does not lower for its target, or None (cached)."""
    key = (k.target, str(k.jaxpr), k.const_avals, k.in_avals, k.outs, k.n, k.rows, k.steps)
    if key in _PROBES:
        _PROBES.move_to_end(key)
        return _PROBES[key]
    try:
        _lower(k)
        problem = None
    except Exception as e:  # lowering reports unsupported ops with many exception types
        message = " ".join(str(e).split())
        message = re.sub(r"\s*(Please file an issue|Traceback|File \").*", "", message)[:400]
        problem = f"the {k.target.label} lowering failed: {type(e).__name__}: {message}"
    _PROBES[key] = problem
    while len(_PROBES) > _CACHE_SIZE:
        _PROBES.popitem(last=False)
    return problem
