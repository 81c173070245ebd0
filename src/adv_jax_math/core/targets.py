"""Lowering targets: platforms, block-size defaults, devices to lower for.

Platforms: ``"cpu"`` (interpret mode), ``"cuda"`` (Pallas Mosaic GPU on Hopper and
newer, else Pallas Triton: ``core.gpu_backends``), ``"rocm"`` (Pallas Triton),
``"tpu"`` (Pallas Mosaic). ``"gpu"`` means ``"cuda"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from .devices import DEVICES, SCOPED_VMEM

__all__ = [
    "KERNEL_NAME",
    "MOSAIC_GPU",
    "MOSAIC_GPU_INTERPRETER",
    "MOSAIC_GPU_ROWS",
    "PLATFORMS",
    "Target",
    "abstract_mesh",
    "compile_mesh",
    "concrete_context_mesh",
    "device_kind",
    "gpu_target_config",
    "has_devices",
    "mesh_device",
    "on_platform",
    "pallas_triton",
    "quiet_triton",
    "target",
    "target_mesh",
    "tpu_vmem_limit",
    "triton_problem",
]

KERNEL_NAME = "adv_jax_math_fused_reduce"
"""Name of our ``pallas_call`` and of the jitted function around it, so it shows in
jaxprs and in lowered text (``func.func private @adv_jax_math_fused_reduce``)."""

# Pallas Triton (jax 0.12) warns at every lowering that it is deprecated in favour
# of Mosaic GPU; the warning is about JAX's roadmap, not the user's code.
_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"

PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}


# The TPUs of the device table (``core.devices``), by device_kind.
_TPUS = {kind: d for kind, d in DEVICES.items() if d.platform == "tpu"}
# Generations without a bfloat16 VPU hold 16-bit intermediates as float32 ("TPU v5e":
# how some runtimes name the v5 lite).
TPU_F32_MATH = (*(kind for kind, d in _TPUS.items() if not d.bf16_vpu), "TPU v5e")
DEFAULT_KIND = {"cuda": "NVIDIA H100 80GB HBM3", "rocm": "AMD MI300X", "tpu": "TPU v5 lite"}


def tpu_vmem_limit(kind: str) -> int:
    """Bytes of VMEM the kernel asks for on a TPU of ``kind`` (``Device.vmem_limit``;
    any v6 as the v6e; the default scoped limit on a TPU the table does not know)."""
    d = _TPUS.get("TPU v6 lite" if kind.startswith("TPU v6") else kind)
    return SCOPED_VMEM if d is None else d.vmem_limit


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
    backend: str = "interpret"  # "interpret" | "triton" | "mosaic_gpu" | "mosaic_tpu"

    @property
    def triton(self) -> bool:
        return self.backend == "triton"

    @property
    def mosaic(self) -> bool:
        """Pallas Mosaic for TPUs."""
        return self.backend == "mosaic_tpu"

    @property
    def mosaic_gpu(self) -> bool:
        return self.backend == "mosaic_gpu"


_TRITON: dict[str, Any] = dict(
    block_elems=1 << 13, block_bytes=1 << 62, max_elems=1 << 20, programs=2048
)
TARGETS = {
    "cpu": Target("cpu", "Pallas interpret mode", 1 << 20, 1 << 62),
    "cuda": Target("cuda", "Pallas Triton", probe_rows=16, backend="triton", **_TRITON),
    "rocm": Target("rocm", "Pallas Triton", probe_rows=16, backend="triton", **_TRITON),
    # Mosaic runs the grid sequentially on a core; one block per program.
    "tpu": Target(
        "tpu", "Pallas Mosaic TPU", block_elems=1 << 62, block_bytes=1 << 20, backend="mosaic_tpu"
    ),
}
# A warpgroup (128 threads) per program, streaming blocks of at most 256 rows (a TMA
# copy's limit per dimension) through shared memory.
MOSAIC_GPU = Target(
    "cuda", "Pallas Mosaic GPU", 1 << 13, 1 << 62, programs=1024, probe_rows=128,
    backend="mosaic_gpu",
)  # fmt: skip
MOSAIC_GPU_ROWS = 256
# The same kernel in Mosaic GPU's interpreter on the CPU (tests; "cpu": interpret mode).
MOSAIC_GPU_INTERPRETER = dataclasses.replace(
    MOSAIC_GPU, platform="cpu", label="Pallas Mosaic GPU interpreter"
)


def target(platform: str, backend: str | None = None) -> Target:
    """The target for ``platform``, for the device kind being compiled for; on
    ``"cuda"``, ``backend`` ``"mosaic_gpu"`` or ``"triton"`` (the default); on
    ``"cpu"`` (interpret mode), ``"mosaic_gpu"`` is Mosaic GPU's interpreter."""
    try:
        base = TARGETS[PLATFORMS[platform]]
    except (KeyError, TypeError):
        raise ValueError(
            f"platform={platform!r} is not one of {sorted(PLATFORMS)} "
            "('cpu' runs the kernel in interpret mode)"
        ) from None
    if base.platform == "cpu":
        return MOSAIC_GPU_INTERPRETER if backend == "mosaic_gpu" else base
    if backend == "mosaic_gpu" and base.platform == "cuda":
        base = MOSAIC_GPU
    return dataclasses.replace(base, device_kind=device_kind(base.platform))


# compiled for the context mesh's devices (JAX caches it)
_PROBE_CONTEXT = jax.jit(lambda: np.int8(0))


def concrete_context_mesh() -> tuple[jax.sharding.Mesh | None, bool]:
    """``(mesh, tracing)``: the concrete mesh set with ``jax.set_mesh`` (None without
    one) and whether this runs inside a ``jax.jit`` trace.

    Inside ``jit``, ``jax.sharding.get_mesh`` is refused and only the abstract mesh
    is visible, yet ``jit`` compiles only for the context mesh's own devices (a
    compile-only device of the same kind from another topology is "incompatible").
    So there the mesh is read from what it assigns to a computation of no arguments:
    the output sharding of that computation, compiled once per context by JAX."""
    mesh: Any
    try:
        mesh, tracing = jax.sharding.get_mesh(), False
    except ValueError:  # "`get_mesh` can only be used outside of `jax.jit`"
        tracing = True
        try:
            mesh = getattr(_PROBE_CONTEXT.lower().compile().output_shardings, "mesh", None)
        except Exception:  # e.g. inside shard_map's manual axes
            mesh = None
    except Exception:  # jax without get_mesh
        return None, False
    if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty:
        return mesh, tracing
    return None, tracing


def _mesh_device(platform: str) -> Any:
    """The first device of the active mesh (``jax.set_mesh``/``use_abstract_mesh``)
    when it is of ``platform``: a real or compile-only device (also inside
    ``jax.jit``, see :func:`concrete_context_mesh`), or an abstract one."""
    concrete, _ = concrete_context_mesh()
    for mesh in (concrete, jax.sharding.get_abstract_mesh()):
        device = None if mesh is None else mesh_device(mesh)
        if on_platform(device, platform):
            return device
    return None


def mesh_device(mesh: Any) -> Any:
    """The first device of a concrete ``mesh``, else its abstract device (or None)."""
    try:
        return mesh.devices.flat[0]
    except Exception:  # an AbstractMesh, or an empty mesh
        return getattr(mesh, "abstract_device", None)


def on_platform(device: Any, platform: str) -> bool:
    """Whether ``device`` (real, compile-only or abstract) is of ``platform``."""
    return PLATFORMS.get(getattr(device, "platform", None) or "") == platform


def device_kind(platform: str) -> str:
    """The device kind compiled for: the active mesh's, a present device's, or a default."""
    device = _mesh_device(platform)
    if device is None and has_devices(platform):
        device = jax.devices(platform)[0]
    return getattr(device, "device_kind", None) or DEFAULT_KIND[platform]


# Compile-only devices for a device kind, from JAX's own topology descriptions
# (jax.experimental.topologies): the GPU entries are GpuTargetConfig protos
# (DESIGN.md §6) filled from the device table, the TPU ones topology names libtpu knows.
# The proto's other fields hold for every CUDA GPU since compute capability 7.0.
_GPU_CONFIG = (
    "gpu_device_info {{ threads_per_block_limit: 1024 threads_per_warp: 32 "
    "shared_memory_per_block: 49152 shared_memory_per_core: {S} threads_per_core_limit: 2048 "
    "core_count: {C} fpus_per_core: {F} block_dim_limit_x: 2147483647 "
    "block_dim_limit_y: 65535 block_dim_limit_z: 65535 memory_bandwidth: {BW} "
    "l2_cache_size: {L2} clock_rate_ghz: {G} device_memory_size: {M} "
    "shared_memory_per_block_optin: {O} cuda_compute_capability {{ major: {X} minor: {Y} }} "
    "registers_per_core_limit: 65536 registers_per_block_limit: 65536 }} "
    'runtime_version: {{ major: 12 minor: 8 patch: 0 }} platform_name: "CUDA" '
    'dnn_version_info {{ major: 9 minor: 7 }} device_description_str: "{kind}"'
)
GPU_SPECS = {kind: d for kind, d in DEVICES.items() if d.gpu is not None}
TPU_TOPOLOGIES = {kind: d.topology for kind, d in _TPUS.items()}


def gpu_target_config(kind: str) -> str:
    """The ``GpuTargetConfig`` text proto of an NVIDIA GPU of ``kind`` (one of
    ``GPU_SPECS``), for ``jax.experimental.topologies.get_topology_desc("aot", "cuda",
    target_config=..., topology="1x1x1")``."""
    d = GPU_SPECS[kind]
    g = d.gpu
    assert g is not None
    (x, y), bw = g.capability, g.memory_bandwidth or int(d.bandwidth)
    return _GPU_CONFIG.format(kind=kind, X=x, Y=y, C=d.cores, F=g.fpus, S=g.shared,
                              O=g.shared_optin, BW=bw, L2=d.cache, G=d.clock / 1e9,
                              M=g.memory)  # fmt: skip


@functools.cache
def _topology(platform: str, kind: str) -> tuple[Any, str]:
    """``(compile-only device of kind, "")`` or ``(None, why not)``."""
    from jax.experimental import topologies

    try:
        if platform == "tpu" and kind in TPU_TOPOLOGIES:
            desc = topologies.get_topology_desc(TPU_TOPOLOGIES[kind], platform="tpu")
        elif platform == "cuda" and kind in GPU_SPECS:
            desc = topologies.get_topology_desc(
                "aot", "cuda", target_config=gpu_target_config(kind), topology="1x1x1"
            )
        else:
            return None, f"no compile-only topology known for {kind!r}"
        return desc.devices[0], ""
    except Exception as e:  # no plugin/libtpu installed, or an initialization error
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def target_mesh(kind: str) -> jax.sharding.Mesh:
    """A one-device mesh of a compile-only device of ``kind``, to plan and compile
    calls for a GPU or TPU on a machine without one.

    ``kind`` is a device kind: ``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA H200"``,
    ``"NVIDIA B200"``, ``"NVIDIA A100-SXM4-80GB"``, ``"TPU v4"``, ``"TPU v5 lite"``
    (v5e), ``"TPU v5"`` (v5p) or ``"TPU v6 lite"`` (v6e). The compiler must be
    installed (the jax CUDA plugin, or libtpu through ``jax[tpu]``); run with
    ``JAX_PLATFORMS=cpu``. Use it with ``jax.set_mesh``: :func:`adv_jax_math.explain`
    then plans for that device, compiling the fused kernel for it, and
    ``jax.jit(...).lower(...).compile()`` compiles the whole call. On a GPU, make its
    device the default too (``jax.default_device(mesh.devices.flat[0])``): Mosaic GPU
    kernels are compiled for the default device's architecture, and for Hopper's when
    it is not a GPU.
    """
    platform = "tpu" if kind in TPU_TOPOLOGIES else "cuda" if kind in GPU_SPECS else None
    if platform is None:
        known = sorted(GPU_SPECS) + sorted(TPU_TOPOLOGIES)
        raise ValueError(f"device kind {kind!r} is not one of {known}")
    device, why = _topology(platform, kind)
    if device is None:
        need = "jax[tpu] (libtpu)" if platform == "tpu" else "jax-cuda12-plugin and -pjrt"
        raise RuntimeError(
            f"cannot make a compile-only {kind} ({why}): install {need} matching jax "
            f"{jax.__version__}, and run with JAX_PLATFORMS=cpu"
        )
    return jax.sharding.Mesh(np.array([device]), ("x",))


def compile_mesh(platform: str) -> jax.sharding.Mesh | None:
    """A one-device mesh that can compile for ``platform`` and the device kind planned
    for: a present or compile-only device set with ``jax.set_mesh``, a present device,
    or a compile-only device from JAX's topologies where the compiler (the CUDA plugin,
    libtpu) is installed. None when nothing here can compile for it."""
    device = _mesh_device(platform)
    if device is None or not hasattr(device, "id"):  # abstract devices do not compile
        kind = device_kind(platform)
        present = jax.devices(platform) if has_devices(platform) else []
        device = next((d for d in present if d.device_kind == kind), None)
        device = device or _topology(platform, kind)[0]  # a compile-only device
    if device is None:
        return None
    return jax.sharding.Mesh(np.array([device]), ("x",))


def pallas_triton() -> Any:
    """``jax.experimental.pallas.triton``, imported when first needed: it is deprecated
    since jax 0.11 and may be missing from a later jax (see :func:`triton_problem`)."""
    return importlib.import_module("jax.experimental.pallas.triton")


def triton_problem() -> str | None:
    """Why the GPU kernel cannot be built with this jax (None: it can)."""
    try:
        pallas_triton()
    except ImportError as e:
        return (
            f"Pallas Triton is missing from this jax ({jax.__version__}): "
            f"jax.experimental.pallas.triton cannot be imported ({type(e).__name__}: {e}); "
            "it is deprecated since jax 0.11, so the GPU kernel is not available"
        )
    return None


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
    try:
        device = AbstractDevice(device_kind=kind, num_cores=cores, platform=platform)
    except TypeError:  # AbstractDevice has a platform from jax 0.10.1 on
        raise RuntimeError(
            f"lowering for an absent {platform} device needs jax >= 0.10.1 "
            f"(this is jax {jax.__version__})"
        ) from None
    return AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)
