"""Lowering targets: platforms, block-size defaults, devices to lower for.

Platforms: ``"cpu"`` (interpret mode), ``"cuda"``/``"rocm"`` (Pallas Triton),
``"tpu"`` (Pallas Mosaic). ``"gpu"`` means ``"cuda"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

__all__ = [
    "KERNEL_NAME",
    "Target",
    "abstract_mesh",
    "compile_mesh",
    "device_kind",
    "has_devices",
    "quiet_triton",
    "target",
    "tpu_scoped_vmem",
]

KERNEL_NAME = "adv_jax_math_fused_reduce"
"""Name of our ``pallas_call`` and of the jitted function around it, so it shows in
jaxprs and in lowered text (``func.func private @adv_jax_math_fused_reduce``)."""

# Pallas Triton (jax 0.12) warns at every lowering that it is deprecated in favour
# of Mosaic GPU; the warning is about JAX's roadmap, not the user's code.
_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"

_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}


# Scoped VMEM a Mosaic kernel may use by default, per TPU generation (device_kind),
# as the compilers report it (E1001 CompileTimeScopedVmemOom; bench/accel/FINDINGS.md).
TPU_SCOPED_VMEM = {"TPU v4": 16 << 20, "TPU v5 lite": 16 << 20, "TPU v5": 16 << 20}
TPU_SCOPED_VMEM_DEFAULT = 16 << 20
# Generations without a bfloat16 VPU hold 16-bit intermediates as float32.
TPU_F32_MATH = ("TPU v4", "TPU v5 lite", "TPU v5e")
DEFAULT_KIND = {"cuda": "NVIDIA H100 80GB HBM3", "rocm": "AMD MI300X", "tpu": "TPU v5 lite"}


def tpu_scoped_vmem(kind: str) -> int:
    if kind.startswith("TPU v6") or kind.startswith("TPU7"):
        return 32 << 20
    return TPU_SCOPED_VMEM.get(kind, TPU_SCOPED_VMEM_DEFAULT)


@dataclasses.dataclass(frozen=True)
class Target:
    """How to pick blocks and lower for one platform.

    ``block_elems`` / ``block_bytes`` aim the largest per-block array; ``max_elems``
    is a hard limit per array (Triton); ``programs`` aims the number of kernel
    programs, each looping over the blocks beyond it (None: one block each).
    """

    platform: str  # "cpu" | "cuda" | "rocm" | "tpu"
    label: str
    block_elems: int
    block_bytes: int
    max_elems: int | None = None
    programs: int | None = None
    probe_rows: int = 8  # small block used to trace fun for the static analysis
    device_kind: str = ""  # the device compiled for, e.g. "TPU v4", "NVIDIA H100 80GB HBM3"

    @property
    def triton(self) -> bool:
        return self.platform in ("cuda", "rocm")

    @property
    def mosaic(self) -> bool:
        return self.platform == "tpu"


_TRITON = dict(block_elems=1 << 13, block_bytes=1 << 62, max_elems=1 << 20, programs=2048)
TARGETS = {
    "cpu": Target("cpu", "Pallas interpret mode", 1 << 20, 1 << 62),
    "cuda": Target("cuda", "Pallas Triton", probe_rows=16, **_TRITON),
    "rocm": Target("rocm", "Pallas Triton", probe_rows=16, **_TRITON),
    # Mosaic runs the grid sequentially on a core; one block per program.
    "tpu": Target("tpu", "Pallas Mosaic TPU", block_elems=1 << 62, block_bytes=1 << 20),
}


def target(platform: str) -> Target:
    """The target for ``platform``, for the device kind being compiled for."""
    try:
        base = TARGETS[_PLATFORMS[platform]]
    except (KeyError, TypeError):
        raise ValueError(
            f"platform={platform!r} is not one of {sorted(_PLATFORMS)} "
            "('cpu' runs the kernel in interpret mode)"
        ) from None
    if base.platform == "cpu":
        return base
    return dataclasses.replace(base, device_kind=device_kind(base.platform))


def _mesh_device(platform: str) -> Any:
    """The first device of the active mesh (``jax.set_mesh``/``use_abstract_mesh``)
    when it is of ``platform``: a real or compile-only device, or an abstract one."""
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    for mesh in (get_mesh() if get_mesh else None, jax.sharding.get_abstract_mesh()):
        try:
            devices = mesh.devices  # a concrete mesh's devices; AbstractMesh raises
        except Exception:
            devices = None
        if devices is not None and getattr(devices, "size", 0):
            device = devices.flat[0]
        else:
            device = getattr(mesh, "abstract_device", None)
        if device is not None and _PLATFORMS.get(getattr(device, "platform", "")) == platform:
            return device
    return None


def device_kind(platform: str) -> str:
    """The device kind compiled for: the active mesh's, a present device's, or a default."""
    device = _mesh_device(platform)
    if device is None and has_devices(platform):
        device = jax.devices(platform)[0]
    return getattr(device, "device_kind", None) or DEFAULT_KIND[platform]


def compile_mesh(platform: str) -> jax.sharding.Mesh | None:
    """A one-device mesh whose device can compile for ``platform`` (a real device,
    or a compile-only topology device set with ``jax.set_mesh``); None if none."""
    device = _mesh_device(platform)
    if device is None or not hasattr(device, "id"):  # abstract devices do not compile
        device = jax.devices(platform)[0] if has_devices(platform) else None
    if device is None:
        return None
    return jax.sharding.Mesh(np.array([device]), ("x",))


@contextlib.contextmanager
def quiet_triton() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _TRITON_DEPRECATION, DeprecationWarning)
        yield


def silence_triton_deprecation() -> None:
    """Our kernel is usually lowered later, by the user's ``jax.jit``, outside any
    context we control, so the filter is installed for the process; it matches only
    the Pallas Triton deprecation message."""
    warnings.filterwarnings("ignore", _TRITON_DEPRECATION, DeprecationWarning)


def has_devices(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))  # backend names: "cuda", "rocm", "tpu"
    except Exception:  # RuntimeError (no such backend) or a failed plugin initialization
        return False


def abstract_mesh(platform: str, kind: str | None = None) -> jax.sharding.AbstractMesh:
    """A one-device abstract mesh (default: an NVIDIA H100 or a TPU v5 lite), to lower
    for that platform where no such device is present."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    kind = kind or DEFAULT_KIND[platform]
    cores = 1 if platform == "tpu" else None
    device = AbstractDevice(device_kind=kind, num_cores=cores, platform=platform)
    return AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)
