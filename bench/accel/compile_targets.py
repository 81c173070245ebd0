"""Compile adv_jax_math calls for real GPUs/TPUs on a CPU-only host (DESIGN.md §6).

Run by ``make test-accel`` inside a compile-only venv (``bench/accel/setup_venvs.sh``)
with the working tree's library on ``PYTHONPATH``::

    JAX_PLATFORMS=cpu PYTHONPATH=src .venv-accel-gpu/bin/python \
        bench/accel/compile_targets.py --target h100 [--json F] [--quick] [--case NAME] [--check]

Compile-only devices come from ``adv_jax_math.target_mesh`` (the library's own
helper). Per case it records what ``adv_jax_math.explain`` plans (engine, reason,
block), whether ``jax.jit(...).lower(...).compile()`` succeeded (else the compiler's
first lines), whether the program holds the kernel's custom call, the compiled temp
bytes, and for GPU the ptxas register/spill/smem figures of the kernel (nvJitLink's
verbose info log, which XLA prints at ``TF_CPP_VMODULE=nvjitlink=3``; captured from
file descriptor 2). ``--check`` exits 1 when a case fails :func:`check`.
The block sweeps behind FINDINGS.md used the internal API of commit d09b8e5.
"""

from __future__ import annotations

import os

# Before jax/jaxlib load: XLA logs nvJitLink's "ptxas info" lines at VLOG 3 of
# nvjitlink.cc; keep the rest of the C++ logging at warnings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
os.environ.setdefault("TF_CPP_VMODULE", "nvjitlink=3")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_WORKER_ID", "0")

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cases as case_lib
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")

# --------------------------------------------------------------------------- #
# Targets
# --------------------------------------------------------------------------- #

KINDS = {
    "h100": "NVIDIA H100 80GB HBM3",
    "h200": "NVIDIA H200",
    "a100": "NVIDIA A100-SXM4-80GB",
    "v5e": "TPU v5 lite",
    "v6e": "TPU v6 lite",
    "v5p": "TPU v5",
    "v4": "TPU v4",
}
MARKERS = {"gpu": ("__gpu$xla.gpu.triton", "triton_kernel_call"), "tpu": ("tpu_custom_call",)}


def make_mesh(target: str):
    """(platform, one-device mesh of a compile-only device) from the library's own helper."""
    import adv_jax_math as ajm

    return ("tpu" if target.startswith("v") else "gpu"), ajm.target_mesh(KINDS[target])


# --------------------------------------------------------------------------- #
# Capturing the C++ log (fd 2) around a compile
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def capture_fd2():
    """Redirect file descriptor 2 to a temp file; yields a dict filled with 'text'."""
    box = {"text": ""}
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
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


def parse_ptxas(text: str, kernel: str = "adv_jax_math_fused_reduce") -> list[dict]:
    """ptxas figures of every compiled copy of ``kernel`` in nvJitLink's info log.

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
            if m.group(1) == kernel:
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


def _build(case: case_lib.Case):
    """(function of (params, xs), argument avals)."""
    import adv_jax_math as ajm

    red, chunk_red = case.reduction

    def call(params, xs):
        fun = case.fun if case.params is None else (lambda x: case.fun(params, x))
        return ajm.batch_map(fun, xs, case.batch_size, reduction=red, chunk_reduction=chunk_red)

    if case.grad is None:
        return call

    argnums = {"inputs": 1, "params": 0, "both": (0, 1)}[case.grad]

    def loss(params, xs):
        out = call(params, xs)
        return sum(jnp.sum(v.astype(jnp.float32)) for v in jax.tree.leaves(out))

    return jax.value_and_grad(loss, argnums=argnums)


def explain_case(case: case_lib.Case) -> dict:
    """adv_jax_math.explain on abstract inputs (traced inside eval_shape, under the mesh)."""
    import adv_jax_math as ajm

    red, chunk_red = case.reduction
    box = {}

    def probe(params, xs):
        fun = case.fun if case.params is None else (lambda x: case.fun(params, x))
        box["plan"] = ajm.explain(
            fun, xs, case.batch_size, reduction=red, chunk_reduction=chunk_red
        )
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
    return rec


def compile_fn(fn, args, mesh, platform: str) -> dict:
    """Lower and compile ``fn(*args)`` replicated on the 1-device mesh."""
    rec: dict = {}
    shard = NamedSharding(mesh, P())
    jitted = jax.jit(fn, in_shardings=tuple(shard for _ in args))
    t0 = time.perf_counter()
    with capture_fd2() as log:
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
        rec["ptxas"] = parse_ptxas(log["text"])
        if not rec.get("compiled"):
            legal = [ln for ln in log["text"].splitlines() if "error:" in ln]
            if legal:
                rec["error"] += "\n  triton: " + legal[0].split("error:", 1)[1].strip()[:400]
    else:
        vm = parse_vmem(log["text"])
        if vm and "vmem" not in rec:
            rec["vmem"] = vm
    return rec


def run_case(case: case_lib.Case, mesh, platform: str) -> dict:
    rec: dict = {"case": case.name, "grad": case.grad, "expect": case.expect}
    ctx = jax.enable_x64(True) if case.x64 else contextlib.nullcontext()
    try:
        with ctx, jax.set_mesh(mesh):
            try:
                rec["explain"] = explain_case(case)
            except Exception as e:
                rec["explain"] = {"backend": "?", "reason": f"explain failed: {error_summary(e)}"}
            rec.update(compile_fn(_build(case), (case.params, case.inputs), mesh, platform))
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
        f"{e.get('registers')}r/{e.get('spill_stores', 0)}+{e.get('spill_loads', 0)}sp"
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
    in the program exactly when explain() chose the fused engine; a case may require
    the kernel, or a fallback with the compiler's message, on given targets."""
    case = case_lib.BY_NAME[rec["case"]]
    engine = rec.get("explain", {}).get("backend")
    kernel = bool(rec.get("kernel_in_compiled") or rec.get("kernel_in_lowered"))
    problems = []
    if not rec.get("compiled"):
        problems.append(f"does not compile: {(rec.get('error') or '').splitlines()[-1:]}")
    elif kernel != (engine == "pallas"):
        problems.append(
            f"explain() says {engine!r} but the kernel is {'' if kernel else 'not '}there"
        )
    if target in case.kernel_on and engine != "pallas":
        problems.append(f"must take the kernel on {target}: {rec['explain'].get('reason')}")
    need = case.fallback_on.get(target)
    if need and (engine != "scan" or need not in rec["explain"].get("reason", "")):
        problems.append(f"must fall back with {need!r} on {target}: {rec['explain'].get('reason')}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", required=True, choices=sorted(KINDS))
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--case", action="append", help="case name or prefix (repeatable)")
    ap.add_argument("--quick", action="store_true", help="the quick subset of cases")
    ap.add_argument("--check", action="store_true", help="exit 1 if any case fails check()")
    args = ap.parse_args(argv)

    platform, mesh = make_mesh(args.target)
    print(f"# target {args.target}: {KINDS[args.target]} ({platform}), jax {jax.__version__}")
    selected = case_lib.select(args.case, args.quick)
    print(
        f"{'case':<24} {'plan':<7} {'result':<60} {'temp_bytes':>11} "
        f"{'ptxas regs/spill / vmem':<24} s",
        flush=True,
    )
    records, failures = [], []
    for case in selected:
        rec = run_case(case, mesh, platform)
        rec["target"] = args.target
        records.append(rec)
        print(_row(rec), flush=True)
        failures += [f"{case.name}: {p}" for p in check(rec, args.target)]
    for rec in records:
        rec["target"] = args.target
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1, default=str)
    for failure in failures:
        print(f"CHECK FAILED [{args.target}] {failure}", flush=True)
    return 1 if args.check and failures else 0


if __name__ == "__main__":
    sys.exit(main())
