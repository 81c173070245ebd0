"""The dispatch probe: compile the kernel alone, at the block it will run, for the
device it will run on, where a compiler for it is present (a real device, or a
compile-only topology device set with ``jax.set_mesh``); otherwise lower it for an
abstract device of that kind. Verdicts are cached by jaxpr, shapes, block and target.

Lowering checks only the Python side; compiling runs Mosaic's layout passes and
VMEM allocation, and Triton to PTX to cubin, which report what lowering cannot
(VMEM overflows, ops a TPU generation lacks, ops Triton cannot legalize).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .kernel import Kernel, kernel_const_aval, pallas_call
from .targets import abstract_mesh, compile_mesh, quiet_triton

__all__ = ["Verdict", "probe"]

_CACHE_SIZE = 256
_PROBES: collections.OrderedDict[Any, Verdict] = collections.OrderedDict()


@dataclasses.dataclass(frozen=True)
class Verdict:
    problem: str | None  # None: the kernel compiles (or lowers)
    compiled: bool  # False: only lowered (no compiler for the target here)


def _build(k: Kernel) -> bool:
    """Compile (True) or lower (False) the kernel alone for ``k.target``."""
    args = [kernel_const_aval(a) for a in k.const_avals] + list(k.in_avals)
    call = pallas_call(k)
    platform = k.target.platform
    if platform == "cpu":
        jax.jit(call).trace(*args).lower(lowering_platforms=("cpu",))
        return False
    mesh = compile_mesh(platform)
    with quiet_triton():
        if mesh is not None:
            try:
                _compile(call, args, mesh)
                return True
            except ValueError as e:  # another instance of the device is in context
                if "incompatible devices" not in str(e):
                    raise
        with jax.sharding.use_abstract_mesh(abstract_mesh(platform, k.target.device_kind)):
            jax.jit(call).trace(*args).lower(lowering_platforms=(platform,))
        return False


def _compile(call: Any, args: list, mesh: jax.sharding.Mesh) -> None:
    """Compile ``call`` on ``mesh``'s device: under ``jax.set_mesh`` outside ``jit``;
    inside, where ``set_mesh`` is refused, under the mesh's abstract mesh."""
    context: contextlib.AbstractContextManager[Any]
    try:
        context = jax.set_mesh(mesh)
        context.__enter__()
    except ValueError:  # "set_mesh can only be used outside of jax.jit"
        context = jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
        context.__enter__()
    try:
        sharding = NamedSharding(mesh, PartitionSpec())
        jax.jit(call, in_shardings=sharding).lower(*args).compile()
    finally:
        context.__exit__(None, None, None)


def probe(k: Kernel) -> Verdict:
    """Whether the kernel builds for its target (cached)."""
    key = (k.target, str(k.jaxpr), k.const_avals, k.in_avals, k.outs, k.n, k.rows, k.steps)
    if key in _PROBES:
        _PROBES.move_to_end(key)
        return _PROBES[key]
    try:
        verdict = Verdict(None, _build(k))
    except Exception as e:  # compilers report problems with many exception types
        message = " ".join(str(e).split())
        message = re.sub(r"\s*(Please file an issue|Traceback|File \").*", "", message)[:400]
        what = f"{k.target.label} for {k.target.device_kind or k.target.platform}"
        verdict = Verdict(f"{what} failed at block {k.rows}: {type(e).__name__}: {message}", False)
    _PROBES[key] = verdict
    while len(_PROBES) > _CACHE_SIZE:
        _PROBES.popitem(last=False)
    return verdict
