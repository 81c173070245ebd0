#!/usr/bin/env bash
# Downstream check: DESC (PyPI desc-opt) against adv_jax_math from this checkout.
#
#   clients/desc/run.sh            # compare.py + DESC tests with our batching
#   QUICK=1 clients/desc/run.sh    # small compare sizes, fewer DESC tests
#
# 1. a venv (DESC_VENV, default clients/desc/.venv, git-ignored) with the latest
#    desc-opt (or DESC_VERSION) and adv_jax_math installed by pip from the
#    checkout (ADV_ROOT, default the repository root). pip first tries both in
#    one resolve; while our pyproject requires a jax newer than desc-opt allows,
#    that fails and ours is installed with --no-deps (reported, not hidden).
# 2. the desc-opt sdist, downloaded at run time into DESC_WORK (a temp dir),
#    for DESC's tests (never committed here). tests/utils.py is absent from
#    the sdist; our own desc_test_utils.py stands in for it.
# 3. compare.py: DESC's computations with DESC's helpers and with ours, same
#    process, float64: agreement, temp memory, compile and run times.
# 4. DESC's own tests that go through desc.batching, with desc.batching
#    replaced by adv_jax_math (desc_standin_plugin.py; test harness only), and
#    the call forms DESC used, recorded during that run.
# BASELINE=1 also runs the same DESC tests with DESC's own batching.
# DESC_SETUP_ONLY=1 stops after 1 and 2 (CI prepares them while other work runs;
# pass the same DESC_WORK to the run that follows).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ADV_ROOT=${ADV_ROOT:-$(cd "$HERE/../.." && pwd)}
DESC_VENV=${DESC_VENV:-$HERE/.venv}
PYTHON=${PYTHON:-python3.11}
QUICK=${QUICK:-0}
BASELINE=${BASELINE:-0}
PIP_FLAGS=(--quiet --disable-pip-version-check)
WORK=${DESC_WORK:-$(mktemp -d /tmp/desc-downstream.XXXXXX)}
mkdir -p "$WORK"
T0=$SECONDS
log() { printf '\n=== [%3ds] %s\n' $((SECONDS - T0)) "$*"; }

# ---------------------------------------------------------------- 1. venv ----
if [[ -z "${DESC_VERSION:-}" ]]; then
  DESC_VERSION=$("$PYTHON" -m pip index versions desc-opt 2>/dev/null |
    sed -n 's/^desc-opt (\(.*\))$/\1/p' | head -1)
  [[ -n "$DESC_VERSION" ]] || { echo "cannot find the latest desc-opt (set DESC_VERSION)"; exit 1; }
fi
STAMP="$DESC_VENV/.installed-desc-$DESC_VERSION"
if [[ ! -f "$STAMP" ]]; then
  log "venv $DESC_VENV: desc-opt==$DESC_VERSION + adv_jax_math from $ADV_ROOT"
  "$PYTHON" -m venv "$DESC_VENV"
  "$DESC_VENV/bin/pip" install "${PIP_FLAGS[@]}" --upgrade pip
  # Build ours out of the checkout's build/ (the editable install lives there).
  BUILD=(-C "build-dir=$WORK/adv-build")
  if "$DESC_VENV/bin/pip" install --disable-pip-version-check "${BUILD[@]}" \
      "desc-opt==$DESC_VERSION" "$ADV_ROOT" pytest pytest-timeout >"$WORK/co-install.log" 2>&1; then
    echo "co-install OK: pip install desc-opt==$DESC_VERSION $ADV_ROOT" >"$DESC_VENV/.co-install"
  else  # the point of the check: ours must install next to DESC as pip resolves it
    echo "co-install FAILED: pip install desc-opt==$DESC_VERSION $ADV_ROOT:"
    grep -A3 "conflict is caused by" "$WORK/co-install.log" || grep "^ERROR" "$WORK/co-install.log"
    exit 1
  fi
  touch "$STAMP"
else
  log "reusing $DESC_VENV (delete $STAMP to rebuild; reinstall ours with" \
    "$DESC_VENV/bin/pip install --no-deps --force-reinstall $ADV_ROOT)"
fi
PY="$DESC_VENV/bin/python"
cat "$DESC_VENV/.co-install"
"$PY" - <<'EOF'
import importlib.metadata as md
print("  ".join(f"{p} {md.version(p)}" for p in ("jax", "jaxlib", "desc-opt", "adv-jax-math")))
EOF

# ------------------------------------------------------------ 2. the sdist ---
log "desc-opt==$DESC_VERSION sdist -> $WORK"
SRC="$WORK/desc_opt-$DESC_VERSION"
if [[ ! -d "$SRC/tests" ]]; then
  "$PY" -m pip download "${PIP_FLAGS[@]}" --no-deps --no-binary :all: \
    "desc-opt==$DESC_VERSION" -d "$WORK/sdist"
  tar -xzf "$WORK"/sdist/desc[-_]opt-"$DESC_VERSION".tar.gz -C "$WORK"
  rm -rf "$SRC/desc"                       # tests must import the installed desc
  touch "$SRC/tests/__init__.py"           # tests use relative / tests.* imports
  cp "$HERE/desc_test_utils.py" "$SRC/tests/utils.py"
fi

[[ "${DESC_SETUP_ONLY:-0}" == 1 ]] && { log "setup only (DESC_SETUP_ONLY=1): venv and sdist ready"; exit 0; }

# ------------------------------------------------------------ 3. compare ------
log "compare.py (DESC's helpers vs ours)"
COMPARE_ARGS=(--markdown "${DESC_TABLE:-$ADV_ROOT/bench/results/desc.md}")
[[ "$QUICK" == 1 ]] && COMPARE_ARGS+=(--quick)
rc_compare=0
"$PY" "$HERE/compare.py" "${COMPARE_ARGS[@]}" || rc_compare=$?

# ------------------------------------------------------- 4. DESC's tests -----
# Tests that reach desc.batching: jacfwd/jacrev_chunked (derivatives),
# vmap_chunked with reduction + lambda chunk_reduction and batch_map over dicts
# (singular integrals), batch_map Biot-Savart (field line tracing, bs_chunk_size),
# vmap_chunked with in_axes=(0,)+14*(None,) objects (field lines; particles in the full run).
TESTS=(
  "tests/test_derivatives.py::TestDerivative::test_auto_diff"
  "tests/test_derivatives.py::TestDerivative::test_compare_AD_FD"
  "tests/test_derivatives.py::TestDerivative::test_block_jacobian"
  "tests/test_derivatives.py::TestJVP::test_autodiff_jvp"
  "tests/test_derivatives.py::TestJVP::test_autodiff_jvp2"
  "tests/test_derivatives.py::TestJVP::test_autodiff_jvp3"
  "tests/test_derivatives.py::TestJVP::test_vjp"
  "tests/test_integrals.py::TestSingularities::test_singular_integral_vac_estell[FFTInterpolator]"
  "tests/test_magnetic_fields.py::TestMagneticFields::test_field_line_integrate_coil_bs_chunk"
  "tests/test_magnetic_fields.py::TestMagneticFields::test_field_line_integrate_jax_transforms"
)
# (the [DFTInterpolator] variant takes ~5 min on 2 cores: FULL=1 adds it)
[[ "${FULL:-0}" == 1 ]] && TESTS+=(
  "tests/test_integrals.py::TestSingularities::test_singular_integral_vac_estell[DFTInterpolator]"
)
# QUICK=1 (CI) leaves these out: the particle tracing takes 90 of the quick run's 140 s
# and its vmap_chunked call form (in_axes=(0, 0)+13*(None,), diffrax inside) differs from
# the field lines' above only in a second mapped argument.
[[ "$QUICK" == 1 ]] || TESTS+=(
  "tests/test_particles.py::test_tracing_vacuum_tokamak"
  "tests/test_integrals.py::TestSingularities::test_vanilla_params"
  "tests/test_magnetic_fields.py::TestMagneticFields::test_field_line_integrate"
  "tests/test_particles.py::test_constant_field_cases"
)
PYTEST=("$PY" -m pytest -p desc_standin_plugin -p no:cacheprovider -q -rfE
  --timeout 600 --durations 5 "${TESTS[@]}")
FORMS="$WORK/call_forms.json"
rm -f "$FORMS"
log "DESC's tests with desc.batching -> adv_jax_math"
rc_tests=0
(cd "$SRC" && PYTHONPATH="$HERE" ADV_DESC_RECORD="$FORMS" "${PYTEST[@]}") || rc_tests=$?
if [[ "$BASELINE" == 1 ]]; then
  log "baseline: the same tests with DESC's own batching"
  (cd "$SRC" && PYTHONPATH="$HERE" ADV_DESC_STANDIN=0 "${PYTEST[@]}") || true
fi

log "call forms DESC used (recorded in the stand-in)"
"$PY" - "$FORMS" <<'EOF'
import json, sys
try:
    forms = json.load(open(sys.argv[1]))
except FileNotFoundError:
    sys.exit("  (nothing recorded)")
merged = {}
for f in forms:
    n = f.pop("count")
    key = json.dumps(f, sort_keys=True)
    merged[key] = merged.get(key, 0) + n
for key, n in sorted(merged.items()):
    f = json.loads(key)
    fn, site = f.pop("fn"), f.pop("site")
    print(f"  {fn:18s} {site:42s} x{n:<4d} " + ", ".join(f"{k}={v}" for k, v in f.items()))
EOF

log "done in $((SECONDS - T0)) s: compare rc=$rc_compare, DESC tests rc=$rc_tests (work dir $WORK)"
exit $((rc_compare || rc_tests))
