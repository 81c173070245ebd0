#!/usr/bin/env bash
# Check the Pallas kernels on a machine with a TPU (the workplace's TPU machines: jax,
# jaxlib and libtpu installed, no package registry), in under 19 minutes:
#   1. the kernel tests on the real device (tests/test_accelerator*.py, test_kernel.py),
#      in one process (one program at a time can hold a TPU);
#   2. bench/device_check.py: fused kernel vs scan engine vs plain XLA, and the pairwise
#      tile kernel on KeOps' Gaussian sum;
#   3. bench/device_check.py --matmul: issue 41's matrix-unit cases (attention forward
#      and value_and_grad against jax.nn.dot_product_attention; k-NN top-8 at D = 128;
#      Sinkhorn at D = 64);
#   4. bench/device_check.py --heads: multi-head attention (softmax_weighted(heads=True)).
# The package is imported from src/ (the native CPU kernels are optional and not built).
#
# Usage (from anywhere): bash bench/device_check_tpu.sh [device_check.py options]
# Environment: PYTHON (default python3), PYTEST_ARGS (extra pytest arguments),
#   OUT (a folder for the logs; default: none).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${PYTHON:-python3}"
STATUS=0
log() { printf '[device_check_tpu %3ds] %s\n' "$SECONDS" "$*"; }
export PYTHONPATH="$ROOT/src:$ROOT/tests:$ROOT/bench${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

"$PY" - <<'PYEOF' || exit 1
import jax
print("jax", jax.__version__, jax.devices())
assert jax.default_backend() == "tpu", "jax does not see a TPU"
PYEOF

log "kernel tests on the device"
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
timeout -k 10 300 "$PY" -m pytest tests/test_accelerator.py tests/test_accelerator_pairwise.py \
    tests/test_kernel.py -q -rs -p no:cacheprovider -o addopts="" \
    -W "ignore:Transparent hugepages:UserWarning" -W "ignore:cloud_tpu_init failed:UserWarning" \
    -W "ignore::pytest.PytestConfigWarning" \
    ${PYTEST_ARGS:-} || STATUS=$?

log "benchmarks"
timeout -k 10 300 "$PY" bench/device_check.py "$@" || STATUS=$?
log "matrix-unit cases (issue 41)"
timeout -k 10 300 "$PY" bench/device_check.py --matmul "$@" || STATUS=$?
log "multi-head attention"
timeout -k 10 300 "$PY" bench/device_check.py --heads "$@" || STATUS=$?
log "done (exit status $STATUS)"
exit "$STATUS"
