"""Compile adv_jax_math calls for real GPUs/TPUs on a CPU-only host (DESIGN.md §6).

Run by ``make test-accel`` inside a compile-only venv (``bench/accel/setup_venvs.sh``)
with the working tree's library on ``PYTHONPATH``::

    JAX_PLATFORMS=cpu PYTHONPATH=src .venv-accel-gpu/bin/python \
        bench/accel/compile_targets.py --target h100 [--json F] [--quick] [--case NAME] [--check]
        [--batch-size B]

Each case runs the way users compile: first thing in a fresh process (a
subprocess per case; ``--same-process`` runs them all in this one), on a
one-device mesh made from ``jax.experimental.topologies`` directly (not
``adv_jax_math.target_mesh``, whose devices the library caches), ``with
jax.set_mesh(mesh): jax.jit(f).lower(*avals).compile()`` with no ``explain()``
before it: the kernel's compile probe runs inside that trace. Then it records what
``adv_jax_math.explain`` plans (engine, reason, block), whether the compile
succeeded (else the compiler's first lines), whether the program holds the kernel's
custom call, the compiled temp bytes, and for GPU the ptxas register/spill/smem
figures of the kernel (nvJitLink's verbose info log, which XLA prints at
``TF_CPP_VMODULE=nvjitlink=3``; captured from file descriptor 2).

On v4 and a100 it also compiles one ``jax.jit``-ed function for two device kinds in
one fresh process (``PAIRS``: v5e then v4 then v5e; h100 then a100 then h100): each
compile must be planned for its own kind. ``--check`` exits 1 when a case fails
:func:`check` (or the two-kind check fails). The block sweeps behind FINDINGS.md
used the internal API of commit d09b8e5.
"""

from __future__ import annotations

import os

# Before jax/jaxlib load: XLA logs nvJitLink's "ptxas info" lines at VLOG 3 of
# nvjitlink.cc; keep the rest of the C++ logging at warnings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
os.environ.setdefault("TF_CPP_VMODULE", "nvjitlink=3")
os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")  # Mosaic GPU's ptxas info, on fd 1
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_WORKER_ID", "0")

import argparse
import contextlib
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hlo
import jax
import jax.numpy as jnp
import numpy as np
from cases import map_reduce as case_lib
from kinds import KINDS

from adv_jax_math.core.devices import DEVICES
from adv_jax_math.core.targets import KERNEL_NAME as FORWARD
from adv_jax_math.kernels.fused_reduce.backward import BACKWARD_NAME as BACKWARD

warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")

# --------------------------------------------------------------------------- #
# Targets
# --------------------------------------------------------------------------- #

_WHILE = re.compile(r"\bwhile\(")
MARKERS = {
    "gpu": ("__gpu$xla.gpu.triton", "triton_kernel_call", "mosaic_gpu"),  # Triton, Mosaic GPU
    "tpu": ("tpu_custom_call",),
}
# One jitted function compiled for two device kinds in one process: target -> (the
# other target, compiled before and after it; the case whose plan differs or not).
PAIRS = {"v4": ("v5e", "issue_mixture_rows"), "a100": ("h100", "issue_field")}
# GPU backend variants of a target, ``h100.triton``: the backend forced by
# ``config(gpu_backend="triton")``, or ``no-triton``, jax.experimental.pallas.triton
# made unimportable as in a jax that no longer ships it (set before the library runs).
VARIANTS = ("triton", "no-triton")


def split_target(target: str) -> tuple[str, str]:
    """``"h100.no-triton"`` -> ``("h100", "no-triton")``; ``"h100"`` -> ``("h100", "")``."""
    base, _, variant = target.partition(".")
    return base, variant


def target_name(target: str) -> str:
    base, variant = split_target(target)
    if base in KINDS and (not variant or (variant in VARIANTS and platform_of(base) == "gpu")):
        return target
    gpus = [g for g in KINDS if platform_of(g) == "gpu"]
    known = ", ".join([*KINDS, *(f"{g}.{v}" for g in gpus for v in VARIANTS)])
    raise argparse.ArgumentTypeError(f"unknown target {target!r}; known: {known}")


@contextlib.contextmanager
def backend_variant(target: str):
    """The GPU backend variant of ``target`` around a case (see ``VARIANTS``)."""
    import adv_jax_math as ajm

    name = split_target(target)[1]
    if name == "no-triton":
        module = "jax.experimental.pallas.triton"
        if sys.modules.get(module) is not None:
            raise RuntimeError(f"{module} was imported before the no-triton variant took effect")
        sys.modules[module] = None  # import raises ImportError, as a missing module would
    with ajm.config(gpu_backend="triton") if name == "triton" else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def on_target(mesh, platform: str):
    """``jax.set_mesh(mesh)``; on a GPU its device the default too: Mosaic GPU compiles
    for the default device's architecture (sm_90 for every GPU else, DESIGN.md §10)."""
    gpu = (
        jax.default_device(mesh.devices.flat[0]) if platform == "gpu" else contextlib.nullcontext()
    )
    with jax.set_mesh(mesh), gpu:
        yield


def platform_of(target: str) -> str:
    return "tpu" if target.startswith("v") else "gpu"


def make_mesh(target: str):
    """(platform, one-device mesh of a compile-only device) made from JAX's topologies
    as a user would, not through ``adv_jax_math.target_mesh``: its devices are not
    the ones the library caches for its own compiles."""
    from jax.experimental import topologies

    from adv_jax_math.core import targets

    kind = KINDS[split_target(target)[0]]
    if platform_of(target) == "tpu":
        desc = topologies.get_topology_desc(targets.TPU_TOPOLOGIES[kind], platform="tpu")
    else:
        config = targets.gpu_target_config(kind)
        desc = topologies.get_topology_desc("aot", "cuda", target_config=config, topology="1x1x1")
    return platform_of(target), jax.sharding.Mesh(np.array(desc.devices[:1]), ("x",))


# --------------------------------------------------------------------------- #
# Capturing the C++ log (fd 2) around a compile
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def capture_logs():
    """Redirect file descriptors 1 and 2 (XLA's C++ log; Mosaic GPU's ptxas dump) to a
    temp file; yields a dict filled with 'text'."""
    box = {"text": ""}
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        for fd in saved:
            os.dup2(tmp.fileno(), fd)
        try:
            yield box
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            tmp.seek(0)
            box["text"] = tmp.read().decode("utf-8", "replace")


_PTXAS_FN = re.compile(r"Function properties for '?([\w$.]+)'?:?")
_PTXAS_SPILL = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_INFO_USED = re.compile(
    r"used (\d+) registers, .*?(\d+) stack, (\d+) bytes smem.*?(\d+) bytes lmem"
)


def parse_ptxas(text: str, kernel: str = FORWARD) -> list[dict]:
    """ptxas figures of every compiled copy of ``kernel`` in nvJitLink's info log (and
    Mosaic GPU's ptxas dump, where it is ``{kernel}_mosaic_gpu_kernel``).

    The log has, per function, a ptxas block (``Function properties for K`` /
    ``N bytes stack frame, S bytes spill stores, L bytes spill loads`` / ``Used R
    registers``) and then nvJitLink's own summary (``Function properties for 'K':`` /
    ``used R registers, ..., X bytes smem, ..., Y bytes lmem``).
    """
    found, mode = [], None
    for line in text.splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            mode = None
            if m.group(1) in (kernel, f"{kernel}_mosaic_gpu_kernel"):
                mode = "ptxas" if line.lstrip().startswith("ptxas") else "info"
                if mode == "ptxas":
                    found.append({})
            continue
        if mode == "ptxas" and found:
            if (m := _PTXAS_SPILL.search(line)) is not None:
                found[-1].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
            elif (m := _PTXAS_USED.search(line)) is not None:
                found[-1]["registers"] = int(m[1])
                mode = None
        elif mode == "info" and (m := _INFO_USED.search(line)) is not None:
            if not found or "smem" in found[-1]:
                found.append({"registers": int(m[1])})
            found[-1].update(smem=int(m[3]), lmem=int(m[4]))
            mode = None
    return found


_VMEM = [
    re.compile(r"[Uu]sed\s+([\d.]+[KMG]?)\s+of\s+([\d.]+[KMG]?)\s+vmem"),
    re.compile(r"scoped allocation with size\s+([\d.]+[KMG]?)\s+and limit\s+([\d.]+[KMG]?)"),
    re.compile(r"([\d.]+[KMG]) and limit ([\d.]+[KMG])"),
]


def parse_vmem(text: str) -> dict | None:
    for rx in _VMEM:
        m = rx.search(text)
        if m:
            return {"used": m.group(1), "limit": m.group(2)}
    return None


def first_lines(text: str, n: int = 6, width: int = 400) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith(("File ", "Traceback"))]
    return "\n".join(ln[:width] for ln in keep[:n])


def error_summary(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    # The interesting Mosaic/Triton line is often deep in a long message.
    keys = (
        "Scoped allocation with size",
        " vmem",
        "Sublane gather",
        "failed to legalize",
        "Shared memory",
        "unsupported",
        "not supported",
        "not implemented",
        "E1001",
    )
    lines = text.splitlines()
    for key in keys:
        for ln in lines[1:] if key == " vmem" else lines:
            if key.lower() in ln.lower():
                if key.startswith(("Scoped", "Sublane", "failed to legalize")):
                    ln = ln[ln.lower().index(key.lower()) :]  # may share a line with others
                elif "Ran out of memory" in ln:
                    continue
                return first_lines(text, 1) + "\n  ...\n" + ln.strip()[:600]
    return first_lines(text)


# --------------------------------------------------------------------------- #
# One case
# --------------------------------------------------------------------------- #


def _zeros_like_tree(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def explain_case(case: case_lib.Case) -> dict:
    """adv_jax_math.explain on abstract inputs (traced inside eval_shape, under the mesh)."""
    import adv_jax_math as ajm

    box = {}

    def probe(params, xs):
        box["plan"] = ajm.explain(case.bind(params), xs, case.batch_size, **case.reduction_kwargs)
        return jnp.zeros(())

    try:
        jax.eval_shape(probe, case.params, case.inputs)
    except Exception:
        probe(_zeros_like_tree(case.params), _zeros_like_tree(case.inputs))
    plan = box["plan"]

    def get(*names, default=None):  # field names differ between library versions
        for name in names:
            if hasattr(plan, name):
                return getattr(plan, name)
        return default

    rec = {
        "backend": get("backend", "engine", default="?"),
        "reason": get("reason", default=""),
        "platform": get("platform", default=""),
        "policy": str(get("policy", default="")),
        "rows": get("rows", "rows_per_chunk"),
        "chunks": get("chunks"),
        "block_rows": get("block_rows"),
        "error": get("error", default=""),
    }
    rejected = get("rejected")
    if rejected:
        rec["rejected"] = [list(r) for r in rejected]
    if get("backward"):
        rec["backward"] = get("backward")
    rec["roofline"] = [verdict_record(v) for v in get("roofline", default=())]
    return rec


def verdict_record(v) -> dict:
    """One roofline verdict (``kernels.fused_reduce.model.Verdict``) as JSON: each
    side's modelled cost and the device figures it was priced with."""
    d = v.device

    def cost(c) -> dict:
        fields = ("bytes", "flops", "launches", "parallel")
        return {f: getattr(c, f) for f in fields} | {
            "seconds": c.seconds(d),
            "launch": d.launch,
            "bandwidth": d.bandwidth,
            "peak": d.peak,
        }

    return {"name": v.name, "device": d.name, "kernel": cost(v.kernel), "scan": cost(v.scan)}


def compile_fn(fn, args, platform: str, jitted=None, kernel: str = FORWARD) -> dict:
    """Lower and compile ``jax.jit(fn)(*args)`` on the active mesh (``jax.set_mesh``),
    as the README's recipe does; ``jitted``: an existing ``jax.jit`` of ``fn``;
    ``kernel``: the kernel whose ptxas figures are recorded (GPU)."""
    rec: dict = {}
    jitted = jitted or jax.jit(fn)
    t0 = time.perf_counter()
    with capture_logs() as log:
        try:
            lowered = jitted.lower(*args)
            lowered_text = lowered.as_text()
            rec["kernel_in_lowered"] = any(m in lowered_text for m in MARKERS[platform])
            rec["lowered"] = True
            compiled = lowered.compile()
            rec["compiled"] = True
            try:
                text = compiled.as_text() or ""
            except Exception:
                text = ""
            rec["kernel_in_compiled"] = any(m in text for m in MARKERS[platform])
            rec["while_loops"] = len(_WHILE.findall(text))
            rec["backward_kernel"] = any(
                BACKWARD in line and any(m in line for m in MARKERS[platform])
                for line in text.splitlines()
            )
            try:
                rec["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
            except Exception as e:
                rec["temp_bytes"] = None
                rec["memory_analysis_error"] = first_lines(str(e), 1)
        except Exception as e:
            rec.setdefault("lowered", False)
            rec["compiled"] = False
            rec["error"] = error_summary(e)
            rec["error_type"] = type(e).__name__
            vmem = parse_vmem(str(e))
            if vmem:
                rec["vmem"] = vmem
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    if platform == "gpu":
        backward = [dict(e, backward=True) for e in parse_ptxas(log["text"], BACKWARD)]
        rec["ptxas"] = parse_ptxas(log["text"], kernel) + backward
        if not rec.get("compiled"):
            legal = [ln for ln in log["text"].splitlines() if "error:" in ln]
            if legal:
                rec["error"] += "\n  triton: " + legal[0].split("error:", 1)[1].strip()[:400]
    else:
        vm = parse_vmem(log["text"])
        if vm and "vmem" not in rec:
            rec["vmem"] = vm
    return rec


def scan_programs(case: case_lib.Case) -> dict:
    """What the scan engine's compiled programs for ``case`` launch and move
    (``hlo.launches``; forward and ``value_and_grad``) and XLA's own cost analysis of
    them: the other side of the roofline table, counted from the programs."""
    import adv_jax_math as ajm

    out: dict = {"scan_hlo": {}, "scan_cost_analysis": {}}
    with ajm.config(backend="scan"):
        for program, grad in (("forward", False), ("value_and_grad", True)):
            try:
                compiled = jax.jit(case.program(grad)).lower(case.params, case.inputs).compile()
                out["scan_hlo"][program] = hlo.launches(compiled.as_text() or "")
                cost = compiled.cost_analysis()
                out["scan_cost_analysis"][program] = (
                    None
                    if not cost
                    else {k: cost[k] for k in ("flops", "bytes accessed") if k in cost}
                )
            except Exception as e:
                out["scan_hlo"][program] = {"launches": None, "error": error_summary(e)}
    return out


def run_case(case: case_lib.Case, target: str, mesh, platform: str) -> dict:
    """Compile first (the kernel's probe runs inside that jit trace), then explain()."""
    rec: dict = {"case": case.name, "grad": case.grad, "expect": case.expect}
    ctx = jax.enable_x64(True) if case.x64 else contextlib.nullcontext()
    try:
        with ctx, backend_variant(target), on_target(mesh, platform):
            rec.update(compile_fn(case.program(), (case.params, case.inputs), platform))
            try:
                rec["explain"] = explain_case(case)
            except Exception as e:
                rec["explain"] = {"backend": "?", "reason": f"explain failed: {error_summary(e)}"}
            if case.roofline:
                rec.update(scan_programs(case))
    except Exception as e:
        rec["compiled"] = False
        rec["error"] = "harness: " + error_summary(e)
        rec["traceback"] = traceback.format_exc()[-2000:]
    return rec


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def _ptx(rec: dict) -> str:
    p = rec.get("ptxas") or []
    if not p:
        return ""
    return ";".join(
        ("b:" if e.get("backward") else "")
        + f"{e.get('registers')}r/{e.get('spill_stores', 0)}+{e.get('spill_loads', 0)}sp"
        + (f"/{e['smem']}sm" if "smem" in e else "")
        for e in p
    )


def _result(rec: dict) -> str:
    if rec.get("compiled"):
        k = (
            "kernel"
            if rec.get("kernel_in_compiled") or rec.get("kernel_in_lowered")
            else "no-kernel"
        )
        return f"OK {k}"
    err = (rec.get("error") or "").splitlines()
    last = err[-1] if err else ""
    return "FAIL " + last[:110]


def _row(rec: dict) -> str:
    ex = rec.get("explain", {})
    tb = rec.get("temp_bytes")
    vm = rec.get("vmem")
    extra = _ptx(rec) or (f"vmem {vm['used']}/{vm['limit']}" if vm else "")
    return (
        f"{rec['case']:<24} {ex.get('backend', '?'):<7} {_result(rec):<60.60} "
        f"{'' if tb is None else tb:>11} {extra:<24} {rec.get('seconds', '')}"
    )


def check(rec: dict, target: str) -> list[str]:
    """What is wrong with one record: it must compile; the kernel's custom call must be
    in the program exactly when explain() chose the fused engine; a gradient case
    that takes the forward kernel must hold the backward kernel and no while loop
    (v4 may fall back); a case may require the kernel, or a fallback with the
    compiler's message, on given targets, or Mosaic GPU's kernel on GPUs that have it."""
    case = case_lib.BY_NAME[rec["case"]]
    base, variant = split_target(target)
    engine = rec.get("explain", {}).get("backend")
    kernel = bool(rec.get("kernel_in_compiled") or rec.get("kernel_in_lowered"))
    problems = []
    if not rec.get("compiled"):
        problems.append(f"does not compile: {(rec.get('error') or '').splitlines()[-1:]}")
    elif kernel != (engine == "pallas"):
        problems.append(
            f"explain() says {engine!r} but the kernel is {'' if kernel else 'not '}there"
        )
    reason = rec.get("explain", {}).get("reason", "")
    backward = rec.get("explain", {}).get("backward", "")
    if engine == "pallas" and f"compiled for {KINDS[base]}" not in reason:
        problems.append(f"the kernel was not compiled for {KINDS[base]} first: {reason}")
    gpu = DEVICES[KINDS[base]].gpu
    hopper = gpu is not None and gpu.capability >= (9, 0)
    # Without Pallas Triton only Mosaic GPU's cases keep a kernel, and only on Hopper+.
    forward_only = case.mosaic_gpu_forward if hopper else ""
    gone = variant == "no-triton" and not ((case.mosaic_gpu or forward_only) and hopper)
    # (a forward on Mosaic GPU whose backward declines runs it on the scan engine there)
    scan_backward = variant == "no-triton" and forward_only and forward_only in backward
    if base in case.kernel_on and engine != "pallas" and not gone:
        problems.append(f"must take the kernel on {target}: {rec['explain'].get('reason')}")
    if gone and base in case.kernel_on and "Pallas Triton is missing" not in reason:
        problems.append(f"must fall back saying Pallas Triton is missing on {target}: {reason}")
    kernels = rec.get("backward_kernel") and not rec.get("while_loops")
    if case.grad and rec.get("compiled") and backward.startswith("backward kernel") and not kernels:
        problems.append(
            f"explain() says {backward!r} but the program has "
            f"{'a' if rec.get('backward_kernel') else 'no'} backward kernel and "
            f"{rec.get('while_loops')} while loops"
        )
    if case.grad and engine == "pallas" and base != "v4" and not kernels and not scan_backward:
        problems.append(  # the goal: every gradient program fused but on v4
            f"value_and_grad must hold the backward kernel and no while loop on {target}: "
            f"{backward or 'no backward kernel'}"
        )
    if gpu is not None and engine == "pallas" and (case.mosaic_gpu or variant):
        mosaic = variant == "no-triton" or (hopper and variant != "triton")
        want = "Pallas Mosaic GPU" if mosaic else "Pallas Triton"
        if f"({want}" not in reason:
            problems.append(f"must take {want}'s kernel on {target}: {reason}")
        if case.grad and f"per program ({want})" not in backward and not scan_backward:
            problems.append(f"must take {want}'s backward kernel on {target}: {backward}")
        spills = [
            e for e in rec.get("ptxas") or [] if e.get("spill_stores") or e.get("spill_loads")
        ]
        if spills and (mosaic or case.mosaic_gpu):  # (the others' spills: in the table)
            problems.append(f"{want}'s kernels must not spill on {target}: {spills}")
    need = case.fallback_on.get(base)
    if need and (engine != "scan" or need not in rec["explain"].get("reason", "")):
        problems.append(f"must fall back with {need!r} on {target}: {rec['explain'].get('reason')}")
    return problems


def run_fresh(target: str, case: case_lib.Case, batch_size: int | None = None) -> dict:
    """``run_case`` first thing in a fresh interpreter (``--one``)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, os.path.abspath(__file__), "--target", target]
        cmd += ["--one", case.name, "--record", out.name]
        cmd += ["--batch-size", str(batch_size)] if batch_size else []
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        try:
            with open(out.name) as f:
                return json.load(f)
        except (OSError, ValueError):
            tail = (proc.stdout + proc.stderr)[-1500:]
            error = f"harness: rc={proc.returncode}\n{tail}"
            return {"case": case.name, "compiled": False, "error": error, "explain": {}}


def run_pair(target: str) -> list[str]:
    """One ``jax.jit``-ed function compiled for ``PAIRS[target]``'s other kind, then
    for ``target``, then the other again, in this (fresh) process: each compile must
    hold the kernel exactly when explain() under that mesh says so, with the block
    planned for that kind, and the second kind must be traced anew (JAX's cache key
    holds the mesh's device kind)."""
    import adv_jax_math as ajm

    other, name = PAIRS[target]
    case = case_lib.BY_NAME[name]
    traces: list[str] = []

    def fun(x):
        traces.append(str(jax.sharding.get_abstract_mesh().abstract_device.device_kind))
        return case.fun(x)

    jitted = jax.jit(lambda xs: ajm.batch_map(fun, xs, case.batch_size, **case.reduction_kwargs))
    problems, kinds = [], []
    meshes = {t: make_mesh(t) for t in (other, target)}  # the same mesh object twice
    for t in (other, target, other):
        platform, mesh = meshes[t]
        before = len(traces)
        with on_target(mesh, platform):
            rec = compile_fn(None, (case.inputs,), platform, jitted=jitted)
            rec.update(case=name, explain=explain_case(case))
        kinds.append(sorted(set(traces[before:])))
        print(f"# pair {t}: {_row(rec)} traced for {kinds[-1] or 'none (cached)'}", flush=True)
        problems += [f"pair {other}/{target}, {t}: {p}" for p in check(rec, t)]
    # JAX may trace the first kind again (it does not always keep a process's first
    # trace), never for another kind.
    if kinds[:2] != [[KINDS[other]], [KINDS[target]]] or kinds[2] not in ([], [KINDS[other]]):
        problems.append(f"pair {other}/{target}: traced for {kinds}, expected one trace per kind")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", required=True, type=target_name, help="h100, ..., h100.triton")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--case", action="append", help="case name or prefix (repeatable)")
    ap.add_argument("--quick", action="store_true", help="the quick subset of cases")
    ap.add_argument("--check", action="store_true", help="exit 1 if any case fails check()")
    ap.add_argument("--same-process", action="store_true", help="all cases in this process")
    ap.add_argument("--batch-size", type=int, help="in place of each case's (block sweeps)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child: run this case, write --record
    ap.add_argument("--record", help=argparse.SUPPRESS)
    ap.add_argument("--pair", action="store_true", help=argparse.SUPPRESS)  # child: run_pair
    args = ap.parse_args(argv)

    sized = lambda c: dataclasses.replace(c, batch_size=args.batch_size) if args.batch_size else c
    if args.one:
        platform, mesh = make_mesh(args.target)
        rec = run_case(sized(case_lib.BY_NAME[args.one]), args.target, mesh, platform)
        with open(args.record, "w") as f:
            json.dump(rec, f, default=str)
        return 0
    if args.pair:
        problems = run_pair(args.target)
        for p in problems:
            print(f"PAIR FAILED {p}", flush=True)
        return 1 if problems else 0

    # The two-kind check runs first, in a fresh process: libtpu admits one process at a
    # time, and with --same-process this one holds it from make_mesh on.
    pair_lines, failures = _pair_check(args) if args.target in PAIRS and not args.case else ([], [])
    platform, mesh = make_mesh(args.target) if args.same_process else (None, None)
    how = "all cases in one process" if args.same_process else "a fresh process per case"
    print(
        f"# target {args.target}: {KINDS[split_target(args.target)[0]]} "
        f"({platform_of(args.target)}), "
        f"jax {jax.__version__}, {how}"
    )
    selected = [sized(c) for c in case_lib.select(args.case, args.quick)]
    print(
        f"{'case':<24} {'plan':<7} {'result':<60} {'temp_bytes':>11} "
        f"{'ptxas regs/spill / vmem':<24} s",
        flush=True,
    )
    records = []
    for case in selected:
        fresh = not args.same_process
        rec = (
            run_fresh(args.target, case, args.batch_size)
            if fresh
            else run_case(case, args.target, mesh, platform)
        )
        rec["target"] = args.target
        rec["same_process"] = args.same_process
        records.append(rec)
        print(_row(rec), flush=True)
        failures += [f"{case.name}: {p}" for p in check(rec, args.target)]
    if pair_lines:
        print("\n".join(pair_lines), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1, default=str)
    for failure in failures:
        print(f"CHECK FAILED [{args.target}] {failure}", flush=True)
    return 1 if args.check and failures else 0


def _pair_check(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The two-kind check of ``args.target`` (``PAIRS``) in a fresh process: the lines
    it prints and its failures."""
    cmd = [sys.executable, os.path.abspath(__file__), "--target", args.target, "--pair"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("# pair", "PAIR"))]
    failures = [ln.removeprefix("PAIR FAILED ") for ln in lines if ln.startswith("PAIR")]
    if proc.returncode and not failures:
        failures.append(f"two-kind check: rc={proc.returncode}: {proc.stderr[-800:]}")
    return lines, failures


if __name__ == "__main__":
    sys.exit(main())
