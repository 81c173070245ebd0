#!/usr/bin/env bash
# Check the fused Pallas engine on a machine with an NVIDIA GPU, in under 17 minutes
# (each step has its own time limit: 150 + 60 + 150 + 100 + 240 + 150 + 150 s at most):
#   1. a venv with the CUDA build of jax matching the project's jax version,
#   2. this package installed into it,
#   3. the kernel tests on the real device (tests/test_accelerator.py, test_kernel.py),
#   4. bench/device_check.py: fused kernel vs scan engine vs plain XLA,
#   5. bench/device_check.py --matmul: issue 41's matrix-unit cases (attention forward
#      and value_and_grad against jax.nn.dot_product_attention, XLA and cuDNN; k-NN
#      top-8 at D = 128; Sinkhorn at D = 64),
#   6. bench/device_check.py --gpu-backends: the fused kernel and the pairwise tile
#      kernel from Mosaic GPU against Triton's (Hopper and newer; elsewhere Mosaic GPU's
#      rows say why it declined),
#   7. bench/device_check.py --heads: multi-head attention (softmax_weighted(heads=True))
#      against jax.nn.dot_product_attention.
#
# Usage (from anywhere): bash bench/device_check.sh [device_check.py options]
# Environment:
#   JAX_VERSION   jax version to install (default: the repo's .venv, else the machine's jax)
#   JAX_CUDA      cuda12 | cuda13 (default: from the driver; 580+ supports CUDA 13)
#   DEVICE_VENV   where to create the venv (default: /tmp/adv-jax-math-device)
#   PYTHON        interpreter for the venv (default: python3)
#   PYTEST_ARGS   extra pytest arguments (e.g. "-k compiled")
# Without a package registry, wheels in ./.whl (carried) are used; failing that, the
# machine's own jax (with a warning if its version differs).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${PYTHON:-python3}"
VENV="${DEVICE_VENV:-/tmp/adv-jax-math-device}"
STATUS=0
log() { printf '[device_check %3ds] %s\n' "$SECONDS" "$*"; }

command -v nvidia-smi >/dev/null || { log "no nvidia-smi: this needs an NVIDIA GPU"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

if [[ -z "${JAX_VERSION:-}" && -x .venv/bin/python ]]; then
    JAX_VERSION="$(.venv/bin/python -c 'import jax; print(jax.__version__)' 2>/dev/null)"
fi
if [[ -z "${JAX_VERSION:-}" ]]; then
    JAX_VERSION="$("$PY" -c 'import jax; print(jax.__version__)' 2>/dev/null)"
fi
JAX_VERSION="${JAX_VERSION:-0.12.0.1}"
driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n1)"
if [[ -z "${JAX_CUDA:-}" ]]; then
    if (( ${driver%%.*} >= 580 )); then JAX_CUDA=cuda13; else JAX_CUDA=cuda12; fi
fi
log "jax[$JAX_CUDA]==$JAX_VERSION for driver $driver into $VENV"

# The venv sees the interpreter's own packages (pytest, xdist, CUDA libraries) through
# a .pth file: --system-site-packages would skip them when python3 is itself a venv.
"$PY" -m venv "$VENV" 2>/dev/null || "$PY" -m venv --without-pip "$VENV" || exit 1
VPY="$VENV/bin/python"
site_dir="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PY" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' \
    >"$site_dir/_host_site.pth"
pip=("$VPY" -m pip install --disable-pip-version-check --quiet)  # the host's pip if no ensurepip
if ! timeout 150 "${pip[@]}" "jax[$JAX_CUDA]==$JAX_VERSION"; then
    if [[ -d .whl ]] && "${pip[@]}" --no-index --find-links .whl "jax[$JAX_CUDA]==$JAX_VERSION"; then
        log "installed jax from ./.whl"
    else
        log "WARNING: could not install jax[$JAX_CUDA]==$JAX_VERSION; using the machine's jax"
    fi
fi
# No build isolation (the registry may be unreachable); the native CPU kernels are optional.
if ! timeout 60 "${pip[@]}" --no-deps --no-build-isolation -e .; then
    log "editable install failed; importing the package from src/"
    export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
fi
"$VPY" - <<'EOF' || exit 1
import jax
print("jax", jax.__version__, jax.devices())
assert jax.default_backend() == "gpu", "jax does not see the GPU"
EOF

export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several test processes share the GPU
workers=()
if "$VPY" -c 'import xdist' 2>/dev/null; then workers=(-n 6); fi
log "kernel tests on the device"
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
timeout -k 10 150 "$VPY" -m pytest tests/test_accelerator.py tests/test_kernel.py -q -rs -p no:cacheprovider \
    -o addopts="" "${workers[@]}" ${PYTEST_ARGS:-} || STATUS=$?

log "benchmarks"
timeout -k 10 100 "$VPY" bench/device_check.py "$@" || STATUS=$?
log "matrix-unit cases (issue 41)"
timeout -k 10 240 "$VPY" bench/device_check.py --matmul "$@" || STATUS=$?
log "Pallas Mosaic GPU against Pallas Triton (issue 42)"
timeout -k 10 150 "$VPY" bench/device_check.py --gpu-backends "$@" || STATUS=$?
log "multi-head attention"
timeout -k 10 150 "$VPY" bench/device_check.py --heads "$@" || STATUS=$?
log "done (exit status $STATUS)"
exit "$STATUS"
