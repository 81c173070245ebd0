"""The device table: every fact about a GPU or TPU kind that the roofline models, the
deviceless compile targets and the benchmarks use, one record per kind, each number
written once (DESIGN.md §13: "one device table").

Read by the roofline models, ``plan.roofline`` and ``bench/accel/pairwise_model.py`` (a
record *is* their ``Device``), ``core/targets.py`` (the ``GpuTargetConfig`` protos, the
TPU topologies, the VMEM limits, the bfloat16 VPUs), ``bench/device_check.py`` (the peak
bandwidth the measurements are put against) and ``bench/accel/kinds.py`` (the targets'
short names).
It imports only the standard library, so any module of the package can import it, and
so can scripts that must not set up devices.

Sources: vendor figures unless a comment says otherwise; "assumed" marks the figures no
vendor publishes (kept until ``bench/device_check.sh`` measures them on the hardware).
"""

from __future__ import annotations

import dataclasses

__all__ = ["DEVICES", "SCOPED_VMEM", "Device", "Gpu", "device"]

SCOPED_VMEM = 16 << 20
"""Bytes: Mosaic's default scoped VMEM limit (32 MiB on v6e), all of a v4's VMEM."""


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What XLA's description of an NVIDIA GPU (``GpuTargetConfig``) needs beyond the
    figures every device has (SMs, L2, clock): for the deviceless GPU compiles."""

    capability: tuple[int, int]  # CUDA compute capability
    fpus: int  # FP32 lanes per SM
    shared: int  # bytes of shared memory per SM
    shared_optin: int  # bytes of shared memory a block may opt into
    memory: int  # bytes of device memory
    # bytes/s in the description; None: the datasheet's ``Device.bandwidth``
    memory_bandwidth: int | None = None


@dataclasses.dataclass(frozen=True)
class Device:
    """The figures of one device kind: what the roofline models (``plan.roofline``: HBM
    bandwidth, matmul peak, cores, launch; the pairwise model: the elementwise
    units, the cache) and the compile targets (``gpu``; ``topology``, VMEM) need."""

    kind: str  # jax's device_kind
    name: str  # short name, as the models print it
    target: str  # the deviceless compiles' name for it (bench/accel)
    platform: str  # "cuda" | "tpu"
    bandwidth: float  # HBM bytes per second
    peak: float  # dense matmul FLOP/s at XLA's default float32 precision
    cores: int  # GPU SMs; TPU TensorCores per chip
    launch: float  # seconds per kernel launch (assumed)
    clock: float  # Hz
    vector: float  # f32 FLOP/s of the elementwise units (GPU CUDA cores, an FMA 2; TPU VPU)
    special: float  # transcendentals per second (GPU SFUs; TPU EUP)
    cache: int  # bytes: GPU L2; TPU VMEM per TensorCore
    cache_bandwidth: float = 0.0  # bytes/s the SMs read from L2 (0: TPU, not modelled)
    step: float = 0.0  # seconds per grid step (TPU; assumed)
    gpu: Gpu | None = None  # GPU: the rest of XLA's description of it
    topology: str = ""  # TPU: the name jax.experimental.topologies knows it by
    bf16_vpu: bool = False  # TPU: a bfloat16 VPU (without one, 16-bit math runs in f32)

    @property
    def vmem_limit(self) -> int:
        """Bytes of VMEM a Mosaic kernel asks for (``vmem_limit_bytes``): 3/4 of the
        VMEM, and at least the default scoped limit (all there is on v4; compiler
        reports: bench/accel/FINDINGS.md)."""
        return max(self.cache * 3 // 4, SCOPED_VMEM)


def _nvidia(kind: str, name: str, target: str, bandwidth: float, peak: float, sms: int,
            clock: float, vector: float, l2: int, gpu: Gpu) -> Device:  # fmt: skip
    """SFUs: 16 per clock per SM (CUDA C++ Programming Guide, arithmetic instruction
    throughput, compute capability 8.0, 9.0). L2 read bandwidth: 5120 bytes per clock
    (A100 whitepaper; assumed the same on Hopper: unpublished). Launch: 4 us (assumed)."""
    return Device(kind, name, target, "cuda", bandwidth, peak, sms, 4e-6, clock, vector,
                  16 * sms * clock, l2, 5120 * clock, gpu=gpu)  # fmt: skip


def _tpu(kind: str, name: str, target: str, bandwidth: float, peak: float, cores: int,
         clock: float, alus: int, vmem: int, topology: str, bf16_vpu: bool) -> Device:  # fmt: skip
    """VPU: (8, 128) lanes of ``alus`` f32 ALUs per core; EUP: one (8, 128) vreg per
    clock per core; 0.35 us per grid step and 2 us per launch: unpublished, assumed."""
    return Device(kind, name, target, "tpu", bandwidth, peak, cores, 2e-6, clock,
                  cores * 1024 * alus * clock, cores * 1024 * clock, vmem, step=0.35e-6,
                  topology=topology, bf16_vpu=bf16_vpu)  # fmt: skip


def _hopper(memory: int, memory_bandwidth: int | None = None) -> Gpu:
    """H100 SXM, H200: compute capability 9.0, 128 FP32 lanes per SM, 228 KiB of shared
    memory per SM, 227 KiB per block opted in (CUDA C++ Programming Guide)."""
    return Gpu((9, 0), 128, 233472, 232448, memory, memory_bandwidth)


# GPUs. bandwidth: HBM (datasheets: H100 SXM 3.35 TB/s, H200 4.8, A100 80GB 2.0 as the
# models round its 2.039, B200 8). peak: dense TF32 matmul (H100/H200 495 TFLOP/s, A100
# 156, B200 1100). vector: f32 CUDA-core peak (H100/H200 67 TFLOP/s, A100 19.5, B200 75),
# an FMA 2 flops, at the clock it implies (128 FP32 lanes per SM on Hopper and Blackwell,
# 64 on Ampere): 1.98, 1.41, 1.98 GHz. L2: 50 MiB (Hopper whitepaper), 40 MiB (A100
# whitepaper); B200's is unpublished (third-party figures differ: 65.5 to 126 MB), 96
# MiB assumed. B200: 148 SMs, compute capability 10.0, 228 KiB of shared memory per SM
# as Hopper (CUDA C++ Programming Guide), 180 GB per GPU (HGX B200 datasheet).
# TPUs. bandwidth: HBM (v5e 819 GB/s, rounded to 0.82e12 by the models; v6e 1640; v5p
# 2765, rounded to 2.76e12; v4 1200). peak: dense bfloat16 matmul (197, 918, 459, 275
# TFLOP/s). clock: what the bf16 peak implies for 4 MXUs of 128^2 MACs per core (256^2
# on v6e): v4 1.05 GHz, v5e 1.5, v5p and v6e 1.75. VPU ALUs per lane: 2 on v4, 4 from
# v5 on ("How to Scale Your Model", TPU chapter, appendix C; 4 on v6e assumed). VMEM
# per TensorCore: jax 0.12's ``pltpu.get_tpu_info_for_chip``. bfloat16 VPU: v5p, v6e.
DEVICES: dict[str, Device] = {
    d.kind: d
    for d in (
        _nvidia("NVIDIA H100 80GB HBM3", "H100", "h100", 3.35e12, 495e12, 132, 1.98e9, 67e12,
                50 << 20,  # memory_bandwidth: 2619 MHz x 5120-bit bus x 2 / 8, as XLA has it
                _hopper(84929347584, memory_bandwidth=3352320000000)),
        _nvidia("NVIDIA H200", "H200", "h200", 4.8e12, 495e12, 132, 1.98e9, 67e12, 50 << 20,
                _hopper(150000000000)),
        _nvidia("NVIDIA A100-SXM4-80GB", "A100", "a100", 2.0e12, 156e12, 108, 1.41e9, 19.5e12,
                40 << 20,  # memory_bandwidth: the datasheet's 2039 GB/s
                Gpu((8, 0), 64, 167936, 166912, memory=85095874560,
                    memory_bandwidth=2039000000000)),
        _nvidia("NVIDIA B200", "B200", "b200", 8.0e12, 1.1e15, 148, 1.98e9, 75e12,
                96 << 20,  # assumed: see above
                Gpu((10, 0), 128, 233472, 232448, memory=180000000000)),
        _tpu("TPU v5 lite", "TPU v5e", "v5e", 0.82e12, 197e12, 1, 1.5e9, 4, 128 << 20,
             "v5e:1x1", bf16_vpu=False),
        _tpu("TPU v6 lite", "TPU v6e", "v6e", 1.64e12, 918e12, 1, 1.75e9, 4, 128 << 20,
             "v6e:1x1", bf16_vpu=True),
        _tpu("TPU v5", "TPU v5p", "v5p", 2.76e12, 459e12, 2, 1.75e9, 4, 64 << 20,
             "v5p:2x2x1", bf16_vpu=True),
        _tpu("TPU v4", "TPU v4", "v4", 1.2e12, 275e12, 2, 1.05e9, 2, 16 << 20,
             "v4:2x2x1", bf16_vpu=False),
    )
}  # fmt: skip


def device(kind: str) -> Device | None:
    """The figures for ``kind`` (None: a device the table does not know)."""
    return DEVICES.get(kind)
