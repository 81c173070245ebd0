"""Lowering targets: platforms, block-size defaults, devices to lower for.

Platforms: ``"cpu"`` (interpret mode), ``"cuda"``/``"rocm"`` (Pallas Triton),
``"tpu"`` (Pallas Mosaic). ``"gpu"`` means ``"cuda"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator

import jax

__all__ = ["KERNEL_NAME", "Target", "abstract_mesh", "has_devices", "quiet_triton", "target"]

KERNEL_NAME = "adv_jax_math_fused_reduce"
"""Name of our ``pallas_call`` and of the jitted function around it, so it shows in
jaxprs and in lowered text (``func.func private @adv_jax_math_fused_reduce``)."""

# Pallas Triton (jax 0.12) warns at every lowering that it is deprecated in favour
# of Mosaic GPU; the warning is about JAX's roadmap, not the user's code.
_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"

_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}


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
    try:
        return TARGETS[_PLATFORMS[platform]]
    except (KeyError, TypeError):
        raise ValueError(
            f"platform={platform!r} is not one of {sorted(_PLATFORMS)} "
            "('cpu' runs the kernel in interpret mode)"
        ) from None


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


def abstract_mesh(platform: str) -> jax.sharding.AbstractMesh:
    """A one-device abstract mesh of an NVIDIA H100 or a TPU v5 lite, to lower for
    that platform where no such device is present."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    if platform == "tpu":
        device = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    else:
        device = AbstractDevice(
            device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform=platform
        )
    return AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)
