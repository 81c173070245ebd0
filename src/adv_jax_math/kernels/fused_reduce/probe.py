"""The dispatch probe: compile the kernel alone, at the block it will run, for the
device it will run on, where a compiler for it is present (a real device, or a
compile-only topology device set with ``jax.set_mesh``); otherwise lower it for an
abstract device of that kind. Probes are cached by jaxpr, shapes, block and target.
A kernel may name XLA debug options for its compile (``options``: pairs, e.g.
``xla_gpu_fail_ptx_compilation_on_register_spilling``).

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

from ...core.sharding import mesh_context
from ...core.targets import (
    abstract_mesh,
    compile_mesh,
    concrete_context_mesh,
    mesh_device,
    on_platform,
    quiet_triton,
)
from .kernel import Kernel

__all__ = ["Probed", "probe"]

_CACHE_SIZE = 256
_PROBES: collections.OrderedDict[Any, Probed] = collections.OrderedDict()


@dataclasses.dataclass(frozen=True)
class Probed:
    """What compiling (or lowering) one kernel alone for its target found."""

    problem: str | None  # None: the kernel compiles (or lowers)
    compiled: bool  # False: only lowered (no compiler for the target here)


def _build(k: Any, context: jax.sharding.Mesh | None, tracing: bool) -> bool:
    """Compile (True) or lower (False) the kernel alone for ``k.target``; ``context``
    and ``tracing`` as :func:`concrete_context_mesh` returns them."""
    args, call = k.args(), k.call()
    platform = k.target.platform
    options = dict(getattr(k, "options", ())) or None  # XLA's debug options, if any
    if platform == "cpu":
        jax.jit(call).trace(*args).lower(lowering_platforms=("cpu",))
        return False
    with quiet_triton():
        if context is not None and _of(context, platform):
            # Under jax.set_mesh, inside jax.jit or not: compile as the caller's jit will,
            # for the context mesh's own devices (jit refuses others there, even ones of
            # the same kind from another topology).
            with _architecture(k, context):
                jax.jit(call).lower(*args).compile(compiler_options=options)
            return True
        current = jax.sharding.get_abstract_mesh()
        in_context = _of(current, platform) and current.size > 1  # cannot be swapped in jit
        mesh = None if tracing and in_context else compile_mesh(platform)
        if mesh is not None:
            with _architecture(k, mesh):
                _compile(call, args, mesh, options)
            return True
        if in_context:
            jax.jit(call).trace(*args).lower(lowering_platforms=(platform,))
            return False
        with jax.sharding.use_abstract_mesh(abstract_mesh(platform, k.target.device_kind)):
            jax.jit(call).trace(*args).lower(lowering_platforms=(platform,))
        return False


def _architecture(k: Any, mesh: jax.sharding.Mesh) -> Any:
    """Mosaic GPU compiles for the default device's architecture, not the mesh's (it
    assumed sm_90 for an A100 and a B200: DESIGN.md §10): the mesh's device as default."""
    if not k.target.mosaic_gpu:
        return contextlib.nullcontext()
    return jax.default_device(mesh.devices.flat[0])


def _of(mesh: Any, platform: str) -> bool:
    """Whether ``mesh`` (concrete or abstract) holds devices of ``platform``."""
    return on_platform(mesh_device(mesh), platform)


def _compile(call: Any, args: list, mesh: jax.sharding.Mesh, options: dict | None) -> None:
    """Compile ``call`` on ``mesh``'s device (no concrete mesh is set): under
    ``jax.set_mesh`` outside ``jit``; inside, where ``set_mesh`` is refused, under
    the mesh's abstract mesh."""
    with mesh_context(mesh):
        sharding = NamedSharding(mesh, PartitionSpec())
        jax.jit(call, in_shardings=sharding).lower(*args).compile(compiler_options=options)


def probe(k: Kernel | Any) -> Probed:
    """Whether the kernel builds for its target (cached).

    The verdict depends on the context too: under a mesh of several devices the
    kernel is compiled over all of them, as the caller's jit will; with no concrete
    mesh set, it may only be lowered."""
    context, tracing = concrete_context_mesh() if k.target.platform != "cpu" else (None, False)
    where = (jax.sharding.get_abstract_mesh(), context is not None)
    key = (k.target, where, k.key())
    if key in _PROBES:
        _PROBES.move_to_end(key)
        return _PROBES[key]
    try:
        verdict = Probed(None, _build(k, context, tracing))
    except Exception as e:  # compilers report problems with many exception types
        message = " ".join(str(e).split())
        message = re.sub(r"\s*(Please file an issue|Traceback|File \").*", "", message)[:400]
        what = f"{k.target.label} for {k.target.device_kind or k.target.platform}"
        verdict = Probed(f"{what} failed at block {k.rows}: {type(e).__name__}: {message}", False)
    _PROBES[key] = verdict
    while len(_PROBES) > _CACHE_SIZE:
        _PROBES.popitem(last=False)
    return verdict
