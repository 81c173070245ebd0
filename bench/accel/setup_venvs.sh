#!/usr/bin/env bash
# Compile-only venvs for deviceless GPU (XLA:GPU + Triton) and TPU (libtpu / Mosaic)
# compilation on a CPU-only host (DESIGN.md §6). Nothing here needs an accelerator.
#
#   bash bench/accel/setup_venvs.sh [VENV_DIR_GPU [VENV_DIR_TPU]]
#
# Defaults: .venv-accel-gpu and .venv-accel-tpu in the repository root (git-ignore them:
# "/.venv-accel-*/"). The jax version is read from the main venv (.venv) unless
# JAX_VERSION=... is set. Idempotent: a venv whose stamp file records the same jax
# version and package spec is left alone (FORCE=1 rebuilds it).
#
# Per venv, download size (pip download into a cache dir), install time and installed
# size are appended to <venv>/accel-setup.log and printed.
#
# Environment:
#   JAX_VERSION   jax version to pin (default: the main venv's jax.__version__)
#   PYTHON        base interpreter (default: the one the main venv was created from)
#   WHEEL_CACHE   where wheels are downloaded (default: <repo>/bench/.cache/accel-wheels,
#                 git-ignored by the repo's "bench/.cache/" rule)
#   FORCE=1       rebuild even if the stamp matches
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
GPU_DIR="${1:-$ROOT/.venv-accel-gpu}"
TPU_DIR="${2:-$ROOT/.venv-accel-tpu}"
MAIN_PY="$ROOT/.venv/bin/python"

if [[ -z "${JAX_VERSION:-}" ]]; then
  if [[ ! -x "$MAIN_PY" ]]; then
    echo "error: no main venv at $MAIN_PY; set JAX_VERSION=..." >&2
    exit 2
  fi
  # The CUDA plugin comes out after jax (jax 0.12.1 had none on its first day): the
  # newest jax up to the main venv's that has one.
  JAX_VERSION="$("$MAIN_PY" -m pip index versions jax-cuda12-plugin 2>/dev/null \
    | sed -n 's/^Available versions: //p' | "$MAIN_PY" -c '
import sys, jax
key = lambda v: tuple(int(p) for p in v.split("."))
have = [v.strip() for v in sys.stdin.read().split(",") if v.strip()]
print(max((v for v in have if key(v) <= key(jax.__version__)), key=key, default=jax.__version__))')"
fi
V="$JAX_VERSION"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -f "$ROOT/.venv/pyvenv.cfg" ]]; then
    PYTHON="$(sed -n 's/^executable = //p' "$ROOT/.venv/pyvenv.cfg")"
  fi
  PYTHON="${PYTHON:-python3}"
fi
WHEEL_CACHE="${WHEEL_CACHE:-$ROOT/bench/.cache/accel-wheels}"

# nvidia-cuda-nvcc-cu12: libdevice and ptxas for Mosaic GPU's compiles (DESIGN.md §10).
GPU_SPEC=("jax==$V" "jaxlib==$V" "jax-cuda12-plugin==$V" "jax-cuda12-pjrt==$V" "nvidia-nvjitlink-cu12"
  "nvidia-cuda-nvcc-cu12")
TPU_SPEC=("jax[tpu]==$V")

# The host's pip config may point at a local mirror with older jax only; PyPI is
# still reachable and pip merges both. Extra index/find-links settings are kept.
make_venv() {
  local dir="$1" name="$2"
  shift 2
  local spec=("$@")
  local stamp="$dir/.accel-stamp"
  local want="jax=$V python=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])') spec=${spec[*]}"
  if [[ -z "${FORCE:-}" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "[$name] up to date: $dir ($want)"
    return 0
  fi
  local dl="$WHEEL_CACHE/$name-$V"
  mkdir -p "$dl"
  local t0 t1 t2
  t0=$(date +%s)
  echo "[$name] downloading ${spec[*]} -> $dl"
  "$PYTHON" -m pip download --quiet --dest "$dl" "${spec[@]}"
  t1=$(date +%s)
  rm -rf "$dir"
  "$PYTHON" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  "$dir/bin/python" -m pip install --quiet --no-index --find-links "$dl" "${spec[@]}"
  t2=$(date +%s)
  local dl_size inst_size
  dl_size=$(du -sh "$dl" | cut -f1)
  inst_size=$(du -sh "$dir" | cut -f1)
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "spec: ${spec[*]}"
    echo "download: $dl_size in $((t1 - t0)) s ($dl)"
    echo "install: $((t2 - t1)) s; venv size $inst_size"
    echo "resolved:"
    "$dir/bin/python" -m pip list --format=freeze 2>/dev/null \
      | grep -iE '^(jax|jaxlib|libtpu|jax-cuda|nvidia|ml.dtypes|numpy|scipy|opt.einsum)' | sed 's/^/  /'
  } | tee "$dir/accel-setup.log"
  echo "$want" >"$stamp"
}

make_venv "$GPU_DIR" gpu "${GPU_SPEC[@]}"
make_venv "$TPU_DIR" tpu "${TPU_SPEC[@]}"
echo "done: GPU venv $GPU_DIR, TPU venv $TPU_DIR (jax $V)"
