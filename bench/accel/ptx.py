"""The PTX of a deviceless XLA:GPU compile, and the tensor-core instructions in it.

Neither ``compiled.as_text()`` (HLO) nor the serialized executable (a compressed
cubin, no PTX) shows what a kernel's code does, and XLA writes no ``.ptx`` under
``--xla_dump_to`` in this flow (jax 0.12.0.1: ``--xla_gpu_dump_llvmir``,
``--xla_gpu_force_compilation_parallelism=1`` and
``--xla_gpu_experimental_dump_gpu_executable`` all wrote none). What works: make XLA
compile PTX with a ``ptxas`` subprocess instead of nvJitLink
(``--xla_gpu_enable_libnvjitlink=false --xla_gpu_enable_libnvptxcompiler=false``) and
point ``--xla_gpu_cuda_data_dir`` and ``$CUDA_ROOT`` (which jax prefers) at a folder
whose ``bin/ptxas`` is a wrapper: it keeps a copy of every PTX file it is handed and
of ``ptxas -v``'s report, then runs the real ``ptxas`` (``nvvm/`` links to the CUDA
install's libdevice). Needs a ``ptxas`` binary (``$PTXAS``, else the nvidia-cuda-nvcc
package's, else ``PATH``, else ``/usr/local/cuda/bin``) and libdevice;
:func:`install` says why not where they are missing.

Each PTX ``.entry`` is one kernel: XLA's fusions keep their HLO names
(``gemm_fusion_dot``: XLA's own Triton matmul), a Pallas kernel its ``pallas_call``
name (``name = "..."`` in the Triton custom call's backend config).
:func:`mma_counts` counts per entry the tensor-core instructions: ``mma.sync`` (Ampere
and later), ``wgmma.mma_async`` (Hopper), ``tcgen05.mma`` (Blackwell), and names
their shapes and types. Standard library only.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import stat

__all__ = ["collect", "install", "kernel_names", "mma_counts", "ptxas_report"]

_WRAPPER = """#!/bin/sh
# bench/accel/ptx.py: keep the PTX and ptxas' report, then run the real ptxas
out="{dump}"
n="$out/$(date +%s%N)-$$"
for a in "$@"; do
  if [ -f "$a" ] && head -c 8192 "$a" | grep -q '^\\.version'; then cp "$a" "$n.ptx"; fi
done
"{ptxas}" "$@" -v 2>"$n.log"; rc=$?
cat "$n.log" >&2
exit $rc
"""


def _pip_ptxas() -> str | None:
    """The ``ptxas`` of the venv's nvidia-cuda-nvcc package (the one jax hands XLA), if
    installed; found without importing it."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except ModuleNotFoundError:
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (pathlib.Path(folder) / "bin" / "ptxas").exists():
            return str(pathlib.Path(folder) / "bin" / "ptxas")
    return None


def _find_ptxas() -> str | None:
    candidates = (os.environ.get("PTXAS"), _pip_ptxas(), shutil.which("ptxas"))
    for candidate in (*candidates, "/usr/local/cuda/bin/ptxas"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def install(root: pathlib.Path) -> tuple[str, pathlib.Path] | str:
    """Set up the wrapper under ``root``: ``(XLA_FLAGS to add, folder the PTX lands in)``,
    or why it cannot be (no ptxas, no libdevice). Call before jax is imported."""
    ptxas = _find_ptxas()
    if ptxas is None:
        return "no ptxas binary ($PTXAS, PATH, /usr/local/cuda/bin): PTX not captured"
    homes = [pathlib.Path(ptxas).resolve().parent.parent, pathlib.Path("/usr/local/cuda")]
    homes[1:1] = [pathlib.Path(os.environ["CUDA_HOME"])] if os.environ.get("CUDA_HOME") else []
    cuda = next((h for h in homes if list(h.glob("nvvm/libdevice/libdevice*.bc"))), None)
    if cuda is None:
        return f"no nvvm/libdevice in {', '.join(map(str, homes))}: PTX not captured"
    dump = root / "ptx"
    (root / "bin").mkdir(parents=True, exist_ok=True)
    dump.mkdir(exist_ok=True)
    link = root / "nvvm"
    if not link.exists():
        link.symlink_to(cuda / "nvvm")
    wrapper = root / "bin" / "ptxas"
    wrapper.write_text(_WRAPPER.format(dump=dump, ptxas=ptxas))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    flags = (
        "--xla_gpu_enable_libnvjitlink=false --xla_gpu_enable_libnvptxcompiler=false "
        f"--xla_gpu_cuda_data_dir={root}"
    )
    # jax sets each compile's CUDA data dir itself, over XLA_FLAGS: $CUDA_ROOT if set,
    # else the nvidia-cuda-nvcc package's folder, whose ptxas then ran unwrapped
    # (jax 0.12.0.1 with that package installed: no PTX captured)
    os.environ["CUDA_ROOT"] = str(root)
    return flags, dump


def collect(dump: pathlib.Path) -> tuple[str, str]:
    """The PTX and the ptxas reports written since the last call (then removed)."""
    ptx, logs = [], []
    for path in sorted(dump.iterdir()):
        (ptx if path.suffix == ".ptx" else logs).append(path.read_text(errors="replace"))
        path.unlink()
    return "\n".join(ptx), "\n".join(logs)


_ENTRY = re.compile(r"^\s*(?:\.visible\s+)?\.entry\s+([\w$.]+)\s*\(", re.M)
_MMA = re.compile(r"^\s*(?:@!?%\w+\s+)?((?:wgmma\.mma_async|tcgen05\.mma|mma)\.[\w.]+)", re.M)


def mma_counts(ptx: str) -> dict[str, dict[str, int]]:
    """Per ``.entry`` name: ``{instruction: count}`` of its tensor-core instructions (an
    entry compiled twice, as XLA may, counts once: the largest)."""
    out: dict[str, dict[str, int]] = {}
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)]
    for i, (start, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(ptx)
        found: dict[str, int] = {}
        for m in _MMA.finditer(ptx, start, end):
            found[m.group(1)] = found.get(m.group(1), 0) + 1
        if sum(found.values()) >= sum(out.get(name, {}).values()):
            out[name] = found
    return out


_FUNCTION = re.compile(r"Function properties for ([\w$.]+)")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """``ptxas -v``'s figures per function: registers, spill stores/loads, smem bytes."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _FUNCTION.search(line):
            current = out.setdefault(m.group(1), {})
        elif current is not None and (m := _SPILL.search(line)):
            current.update(spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif current is not None and (m := _USED.search(line)):
            current["registers"] = int(m[1])
            if m[2] is not None:
                current["smem"] = int(m[2])
            current = None
    return out


_TRITON_NAME = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?\bname = "([^"]+)"')


def kernel_names(hlo_text: str) -> list[str]:
    """The Pallas (Triton) kernels' names in a compiled program's HLO."""
    return sorted(set(_TRITON_NAME.findall(hlo_text)))
