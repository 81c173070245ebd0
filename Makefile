# Everything the tests, the demo and the benchmarks need is installed here.
# The primary environment prefers Python 3.12 (jax 0.12); `test-compat` runs
# Python 3.11 with the oldest supported jax (0.9.2).
SHELL := /bin/bash
PYTHON ?= $(shell for c in python3.12 "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 python3; do \
  "$$c" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null && { echo "$$c"; break; }; done)
PYTHON_COMPAT ?= $(shell for c in python3.11 "$$(pyenv root 2>/dev/null)"/versions/3.11*/bin/python3.11; do \
  "$$c" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null && { echo "$$c"; break; }; done)
VENV ?= .venv
VENV_COMPAT ?= .venv-compat
PIP_FLAGS ?= --quiet --disable-pip-version-check
PYTEST_FLAGS ?=

.PHONY: all demo test test-slow test-upstream test-compat test-asan test-accel accel-pairwise accel-pairwise-matmul test-clients lint bench \
  bench-monoids bench-pairwise bench-ott docs clean

all: test

$(VENV)/.installed: pyproject.toml CMakeLists.txt $(wildcard kernels/cpu/*)
	@test -n "$(PYTHON)" || { echo "need python >= 3.11 (python3.12 preferred)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[test,bench]'
	touch $@

$(VENV_COMPAT)/.installed: pyproject.toml CMakeLists.txt $(wildcard kernels/cpu/*)
	@test -n "$(PYTHON_COMPAT)" || { echo "need python3.11 for test-compat"; exit 1; }
	$(PYTHON_COMPAT) -m venv $(VENV_COMPAT)
	$(VENV_COMPAT)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(VENV_COMPAT)/bin/pip install $(PIP_FLAGS) -e '.[test]' 'jax==0.9.2' 'jaxlib==0.9.2'
	touch $@

# $(call install_extra,NAME): pip install the optional dependencies NAME of pyproject.toml
# into $(VENV), without building and installing the package again (.installed did).
install_extra = $(VENV)/bin/python -c 'import sys, tomllib; \
  print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]))' \
  $(1) > $(VENV)/$(1)-requirements.txt && $(VENV)/bin/pip install $(PIP_FLAGS) -r $(VENV)/$(1)-requirements.txt

demo: $(VENV)/.installed
	$(VENV)/bin/python bench/demo.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

# One worker per core, each test file on one worker (module-level caches stay warm).
# `make test` leaves out the tests marked slow: the rest of the large cross products
# (engines x reductions x meshes ...), whose covering subsets it runs (every value of
# every axis at least once); `make test-slow` runs just those, with the same workers
# (at 6ada53b: 2020 tests and 71% of the suite's CPU time by default, 210 and 29% slow).
# PYTEST_MARKERS= (empty) runs everything; PYTEST_FLAGS go to pytest after -m.
PYTEST_WORKERS ?= auto
PYTEST_MARKERS ?= not slow
PYTEST_RUN = $(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=15
test: lint
	$(PYTEST_RUN) $(if $(PYTEST_MARKERS),-m "$(PYTEST_MARKERS)") $(PYTEST_FLAGS)

test-slow: $(VENV)/.installed
	$(PYTEST_RUN) -m slow $(PYTEST_FLAGS)

# The original's own tests/test_batch.py (adv-jax-math 1.3), fetched from its sdist at
# run time into bench/.cache/upstream (never committed) and run against ours, its
# imports adapted (bench/upstream_tests.py: extra arguments to it go to pytest).
test-upstream: $(VENV)/.installed
	$(VENV)/bin/python bench/upstream_tests.py

# COMPAT_TESTS selects a subset (CI runs a smoke subset; default: everything).
COMPAT_TESTS ?=
test-compat: $(VENV_COMPAT)/.installed
	$(VENV_COMPAT)/bin/python -m pytest $(PYTEST_FLAGS) $(COMPAT_TESTS)

# The native kernel tests against an AddressSanitizer build of the library; not the
# fused kernel's interpret-mode cases, which never call the native library.
test-asan: $(VENV)/.installed
	PYTHON=$(VENV)/bin/python bash .ci/asan.sh -k "not interpret"

# Deviceless compiles of the fused kernels for real GPUs and TPUs (bench/accel/):
# two compile-only venvs (CUDA plugin, libtpu) pinned to .venv's jax, every case
# compiled through the public batch_map per target and checked, and the README's
# compile and roofline tables regenerated. ACCEL_FLAGS=--quick compiles the quick subset.
# h100.triton: Pallas Triton forced; GPU.no-triton: jax.experimental.pallas.triton made
# unimportable, as in a jax without it (bench/accel/compile_targets.py, VARIANTS).
ACCEL_TARGETS ?= h100 h200 b200 a100 v5e v6e v5p v4
ACCEL_VARIANTS ?= h100.triton h100.no-triton h200.no-triton b200.no-triton a100.no-triton
ACCEL_FLAGS ?=
ACCEL_OUT ?= bench/results/accel
test-accel: $(VENV)/.installed
	bash bench/accel/setup_venvs.sh
	mkdir -p $(ACCEL_OUT)
	status=0; for t in $(ACCEL_TARGETS) $(ACCEL_VARIANTS); do \
	  case $$t in v*) venv=.venv-accel-tpu;; *) venv=.venv-accel-gpu;; esac; \
	  JAX_PLATFORMS=cpu PYTHONPATH=src $$venv/bin/python \
	    bench/accel/compile_targets.py --target $$t --check --json $(ACCEL_OUT)/$$t.json \
	    $(ACCEL_FLAGS) > $(ACCEL_OUT)/$$t.log 2>&1 || { status=1; tail -n 30 $(ACCEL_OUT)/$$t.log; }; \
	  grep -a -E "^(# target|CHECK FAILED)" $(ACCEL_OUT)/$$t.log; \
	done; \
	$(VENV)/bin/python bench/accel/table.py $(ACCEL_OUT) $(if $(ACCEL_FLAGS),,--readme README.md) > /dev/null; \
	exit $$status

# The pairwise tile kernel (kernels/pairwise_device.py) compiled for the same targets,
# deviceless, at KeOps-like sizes (bench/accel/pairwise_targets.py); the README table
# between the pairwise-accel markers. PAIRWISE_FLAGS=--quick compiles the small size only.
PAIRWISE_FLAGS ?=
PAIRWISE_OUT ?= bench/results/accel-pairwise
accel-pairwise: $(VENV)/.installed
	bash bench/accel/setup_venvs.sh
	mkdir -p $(PAIRWISE_OUT)
	status=0; for t in $(ACCEL_TARGETS); do \
	  case $$t in v*) venv=.venv-accel-tpu;; *) venv=.venv-accel-gpu;; esac; \
	  JAX_PLATFORMS=cpu PYTHONPATH=src $$venv/bin/python bench/accel/pairwise_targets.py \
	    --target $$t --json $(PAIRWISE_OUT)/$$t.json $(PAIRWISE_FLAGS) > $(PAIRWISE_OUT)/$$t.log 2>&1 \
	    || { status=1; tail -n 20 $(PAIRWISE_OUT)/$$t.log; }; \
	done; \
	$(VENV)/bin/python bench/accel/pairwise_targets.py --table $(PAIRWISE_OUT) \
	  $(if $(PAIRWISE_FLAGS),,--readme README.md); \
	exit $$status

# Issue 41's matrix-unit cases (attention d=16/64/128 f32+bf16 fwd and value_and_grad,
# k-NN top-8 D=128, Sinkhorn D=64) compiled for the same targets
# (bench/accel/pairwise_targets.py --matmul): engine, kernel or XLA loops, ptxas figures
# and the PTX's tensor-core instructions (GPU), into bench/results/accel-pairwise-matmul.md.
# MATMUL_FLAGS=--quick compiles the small size, d=64 only.
MATMUL_FLAGS ?=
MATMUL_OUT ?= bench/results/accel-pairwise-matmul
accel-pairwise-matmul: $(VENV)/.installed
	bash bench/accel/setup_venvs.sh
	mkdir -p $(MATMUL_OUT)
	status=0; for t in $(ACCEL_TARGETS); do \
	  case $$t in v*) venv=.venv-accel-tpu;; *) venv=.venv-accel-gpu;; esac; \
	  JAX_PLATFORMS=cpu PYTHONPATH=src $$venv/bin/python bench/accel/pairwise_targets.py --matmul \
	    --target $$t --json $(MATMUL_OUT)/$$t.json $(MATMUL_FLAGS) > $(MATMUL_OUT)/$$t.log 2>&1 \
	    || { status=1; tail -n 20 $(MATMUL_OUT)/$$t.log; }; \
	done; \
	$(VENV)/bin/python bench/accel/pairwise_targets.py --matmul --table $(MATMUL_OUT) \
	  --out $(MATMUL_OUT).md > /dev/null; \
	exit $$status

# Downstream: DESC (desc-opt) installed next to this checkout by pip, DESC's own
# chunked computations compared with DESC's helpers, and DESC tests run with
# desc.batching replaced by ours (clients/desc/). QUICK=1 runs the short version.
test-clients:
	@test -n "$(PYTHON_COMPAT)" || { echo "need python3.11 for test-clients"; exit 1; }
	PYTHON=$(PYTHON_COMPAT) bash clients/desc/run.sh

# The documentation site (docs/): Sphinx, guides and examples executed as notebooks on
# CPU (myst-nb; outputs cached in docs/_build/.jupyter_cache, so a rebuild only runs
# pages that changed), warnings are errors and a cell that raises fails the build.
# DOCS_FLAGS=-E rereads every page; `rm -rf docs/_build` also re-executes them.
DOCS_FLAGS ?=
$(VENV)/.docs-installed: $(VENV)/.installed pyproject.toml
	$(call install_extra,docs)
	touch $@

docs: $(VENV)/.docs-installed
	@start=$$(date +%s); \
	$(VENV)/bin/sphinx-build -b html -W --keep-going -q $(DOCS_FLAGS) docs docs/_build/html \
	  && echo "docs built in $$(( $$(date +%s) - start )) s: docs/_build/html/index.html"

bench: $(VENV)/.installed
	$(VENV)/bin/python -m pytest bench --benchmark-enable -p no:cacheprovider $(PYTEST_FLAGS)

# The top-k/ARGMIN k-NN, softmax-weighted and VAR monoids against plain JAX, in one
# process (about 5 min on 2 cores): bench/results/monoids.{json,md} and the README
# section between the monoids markers (only from a clean tree unless
# MONOIDS_FLAGS=--allow-dirty; MONOIDS_FLAGS=--quick for a smoke run).
MONOIDS_FLAGS ?=
bench-monoids: $(VENV)/.installed
	$(VENV)/bin/python bench/monoids_report.py $(MONOIDS_FLAGS)

# ajm.pairwise against pykeops (CPU), OTT-JAX, dense XLA and nested batch_map, in one
# process (about 15 min on 2 cores): bench/results/pairwise.{json,md} and the README
# section between the pairwise-bench markers (from a clean tree, as bench-monoids).
# BENCH_PAIRWISE_FLAGS=--quick: a smoke run.
BENCH_PAIRWISE_FLAGS ?=
$(VENV)/.bench-pairwise-installed: $(VENV)/.installed pyproject.toml
	$(call install_extra,bench-pairwise)
	touch $@

bench-pairwise: $(VENV)/.bench-pairwise-installed
	$(VENV)/bin/python bench/pairwise_report.py $(BENCH_PAIRWISE_FLAGS)

# OTT-JAX's Sinkhorn through adv_jax_math.ott against OTT's dense and online point
# clouds, in one process (about 10 min on 2 cores): bench/results/ott.{json,md} and the
# table of docs/guides/ott.md (from a clean tree, as bench-monoids; BENCH_OTT_FLAGS=
# --allow-dirty to measure uncommitted changes, --quick for a smoke run).
BENCH_OTT_FLAGS ?=
bench-ott: $(VENV)/.installed
	$(VENV)/bin/python bench/ott_report.py $(BENCH_OTT_FLAGS)

clean:
	rm -rf $(VENV) $(VENV_COMPAT) .venv-accel-gpu .venv-accel-tpu build .pytest_cache
