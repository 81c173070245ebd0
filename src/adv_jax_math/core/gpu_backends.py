"""Which Pallas backend builds kernels for which NVIDIA GPU (DESIGN.md §10), tokamax's
way: Mosaic GPU from compute capability 9.0 (Hopper) on, then Triton (deprecated since
jax 0.11; best effort from 8.0, Ampere), each declined with its reason."""

from __future__ import annotations

import functools

import jax

from .targets import GPU_SPECS, compile_mesh, triton_problem

__all__ = ["gpu_backends", "mosaic_gpu_problem"]


@functools.cache
def mosaic_gpu_problem() -> str | None:
    """Why this jax cannot build Mosaic GPU kernels (None: it can)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        # (what the kernels use: an older jax may lack some)
        plgpu.kernel, plgpu.emit_pipeline, plgpu.InterpretGPUParams  # noqa: B018
        plgpu.LoweringSemantics.Lane, plgpu.load, plgpu.broadcasted_iota  # noqa: B018
        plgpu.layout_cast, plgpu.Layout.WGMMA.reduce, plgpu.Layout.WG_STRIDED  # noqa: B018
    except Exception as e:  # ImportError, or a module without these (older jax)
        return (
            f"Pallas Mosaic GPU is not usable with this jax ({jax.__version__}): "
            f"{type(e).__name__}: {str(e)[:200]}"
        )
    return None


def _capability(kind: str) -> tuple[int, int] | None:
    """The CUDA compute capability of ``kind``: the device table's, or that of the
    device compiled for (a present or compile-only one; None: unknown)."""
    spec = GPU_SPECS.get(kind)
    if spec is not None and spec.gpu is not None:
        return spec.gpu.capability
    mesh = compile_mesh("cuda")
    device = None if mesh is None else mesh.devices.flat[0]
    found = getattr(device, "compute_capability", None)
    if getattr(device, "device_kind", None) != kind or not found:
        return None
    major, minor = str(found).split(".")[:2]
    return int(major), int(minor)


def gpu_backends(kind: str, forced: str = "auto") -> list[tuple[str, str | None]]:
    """The Pallas backends for a CUDA GPU of ``kind`` in the order they are tried,
    each with why it is not (None: it may be): Mosaic GPU from compute capability 9.0
    (Hopper) on, then Triton (deprecated since jax 0.11; best effort from 8.0, Ampere).
    ``forced`` (``config(gpu_backend=...)``) leaves one of them."""
    cc = _capability(kind)
    has = "an unknown compute capability" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
    mosaic = mosaic_gpu_problem()
    if mosaic is None and (cc is None or cc < (9, 0)):
        mosaic = f"Mosaic GPU needs compute capability 9.0 or newer (Hopper); {kind} has {has}"
    chain = [("mosaic_gpu", mosaic), ("triton", triton_problem())]
    if forced != "auto":
        chain = [(b, why) for b, why in chain if b == forced]
    return chain
