#!/usr/bin/env bash
# Build the native kernels with AddressSanitizer in a temporary build directory and
# run tests/test_native.py and the top-k fold's own tests (tests/test_native_topk.py)
# against that library (ADV_JAX_MATH_NATIVE_LIB).
# Exits non-zero on any ASan report, test failure, or if the ASan build is not the
# library the tests loaded.
#
#   .ci/asan.sh                  # uses .venv/bin/python
#   PYTHON=.venv-compat/bin/python .ci/asan.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
CXX=${CXX:-g++}
build=$(mktemp -d "${TMPDIR:-/tmp}/adv_jax_math_asan.XXXXXX")
trap 'rm -rf "$build"' EXIT

include=$("$PYTHON" -c 'import jax.ffi; print(jax.ffi.include_dir())')
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$CXX" \
  -DADV_JAX_MATH_ASAN=ON -DADV_JAX_MATH_XLA_INCLUDE_DIR="$include" >"$build/configure.log" \
  || { cat "$build/configure.log"; exit 1; }
cmake --build "$build" -j 2
lib="$build/_native_cpu.so"

# Python is not built with ASan: preload the runtime the library was linked against,
# and libstdc++ with it so that ASan's __cxa_throw interceptor finds the real one
# (jaxlib throws C++ exceptions internally).
libasan=$("$CXX" -print-file-name=libasan.so)
libstdcxx=$("$CXX" -print-file-name=libstdc++.so)
export LD_PRELOAD="$libasan:$libstdcxx${LD_PRELOAD:+:$LD_PRELOAD}"
# Leak checking would report the interpreter's and jaxlib's own allocations.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export ADV_JAX_MATH_NATIVE_LIB="$lib" ADV_JAX_MATH_NATIVE=auto

"$PYTHON" - "$lib" <<'EOF'
import sys
from adv_jax_math.kernels import native as _native

loaded, why = _native.status()
if not loaded or sys.argv[1] not in why:
    sys.exit(f"the ASan library was not loaded: {why}")
print(f"asan: {why}")
EOF
"$PYTHON" -m pytest tests/test_native.py -q -p no:cacheprovider "$@"
"$PYTHON" -m pytest tests/test_native_topk.py -q -p no:cacheprovider -k test_fold
