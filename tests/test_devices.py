"""The device table (``core.devices``): one record per device kind, each fact written once.

The roofline models' devices are its records, the compile targets (GPU protos, TPU
topologies and VMEM limits) and the benchmarks' kinds and peaks are made from them, and
none of its figures is written again anywhere in ``src/`` or ``bench/`` (the four tables
it replaced held the H100's bandwidth twice, and the v5p's under a kind JAX never
reports)."""

from __future__ import annotations

import ast
import importlib.util
import types
from pathlib import Path

import pytest

from adv_jax_math.core import devices as _devices
from adv_jax_math.core import targets
from adv_jax_math.pairs import roofline as _roofline_pairwise
from adv_jax_math.plan import roofline as _roofline

ROOT = Path(__file__).resolve().parent.parent


def _bench(path: str, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_models_devices_are_the_tables_records():
    assert _roofline.Device is _devices.Device and _roofline.DEVICES is _devices.DEVICES
    assert _roofline.device is _devices.device
    assert _roofline_pairwise.Device is _devices.Device
    assert not hasattr(_roofline_pairwise, "CHIPS")  # its own chip table is gone
    for kind, d in _devices.DEVICES.items():
        assert d.kind == kind and d.platform in ("cuda", "tpu")
        assert (d.gpu is not None) == (d.platform == "cuda") == (not d.topology)


def test_the_compile_targets_are_made_from_the_table():
    gpus = {k for k, d in _devices.DEVICES.items() if d.platform == "cuda"}
    tpus = {k for k, d in _devices.DEVICES.items() if d.platform == "tpu"}
    assert set(targets.GPU_SPECS) == gpus and set(targets.TPU_TOPOLOGIES) == tpus
    assert all(targets.GPU_SPECS[k] is _devices.DEVICES[k] for k in gpus)
    for kind in gpus:
        d = _devices.DEVICES[kind]
        proto = targets.gpu_target_config(kind)
        bandwidth = d.gpu.memory_bandwidth or int(d.bandwidth)
        for field in (f"core_count: {d.cores} ", f"l2_cache_size: {d.cache} ",
                      f"memory_bandwidth: {bandwidth} ", f"device_memory_size: {d.gpu.memory} ",
                      f"clock_rate_ghz: {d.clock / 1e9} ", f'"{kind}"'):  # fmt: skip
            assert field in proto, (field, proto)
    for kind in tpus:
        d = _devices.DEVICES[kind]
        assert targets.TPU_TOPOLOGIES[kind] == d.topology
        assert targets.tpu_vmem_limit(kind) == d.vmem_limit <= d.cache
        assert (kind in targets.TPU_F32_MATH) == (not d.bf16_vpu)
    assert targets.tpu_vmem_limit("NVIDIA H100 80GB HBM3") == _devices.SCOPED_VMEM


def test_the_benchmarks_read_the_table(monkeypatch):
    kinds = _bench("bench/accel/kinds.py", "bench_kinds")
    assert {d.target: d.kind for d in _devices.DEVICES.values()} == kinds.KINDS
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    check = _bench("bench/device_check.py", "bench_device_check")
    present = lambda kind: lambda: [types.SimpleNamespace(device_kind=kind)]
    for kind, d in _devices.DEVICES.items():
        monkeypatch.setattr(check.jax, "devices", present(kind))
        assert check.peak_bandwidth(-1.0) == (d.bandwidth, kind)
    monkeypatch.setattr(check.jax, "devices", present("NVIDIA H100 PCIe"))  # by short name
    assert check.peak_bandwidth(-1.0)[0] == _devices.DEVICES["NVIDIA H100 80GB HBM3"].bandwidth
    monkeypatch.setattr(check.jax, "devices", present("cpu"))
    assert check.peak_bandwidth(-1.0) == (-1.0, "cpu")


def _facts(d: _devices.Device) -> dict[str, float]:
    """The figures distinctive enough that another copy of one is a second table."""
    facts = {"bandwidth": d.bandwidth, "peak": d.peak, "clock": d.clock, "vector": d.vector}
    if d.gpu is not None:
        facts.update(memory=d.gpu.memory, shared=d.gpu.shared, shared_optin=d.gpu.shared_optin)
        facts.update(memory_bandwidth=d.gpu.memory_bandwidth or 0)
    return facts


@pytest.mark.parametrize("folder", ["src", "bench"])
def test_each_figure_is_written_once(folder):
    """No number literal of src/ or bench/ other than in ``core/devices.py`` is one of the
    table's figures."""
    figures = {v: (kind, k) for kind, d in _devices.DEVICES.items() for k, v in _facts(d).items()}
    figures.pop(0, None)
    table = Path(_devices.__file__).resolve()
    copies = [
        (str(path.relative_to(ROOT)), node.lineno, figures[node.value])
        for path in sorted((ROOT / folder).resolve().rglob("*.py"))
        if path != table
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
        and node.value in figures
    ]
    assert not copies, f"device figures written outside the device table: {copies}"
