# Each target creates .venv on first use, so a fresh clone needs nothing else.
#
# VENV= (empty) runs a target in $(PY)'s own environment instead, installing
# nothing: for a machine whose Python already has JAX (a GPU image with a
# CUDA JAX and no network), e.g. `make bench-accel VENV= PY=python3
# ACCEL_REQUIRE=gpu`. liftmods then comes from this checkout; `make env-check
# VENV= PY=python3` says what that environment lacks.
PY ?= python3
VENV ?= .venv
# Extra requirements pip resolves together with the project (a pin).
PINS ?=
ifeq ($(strip $(VENV)),)
PYTHON := $(PY)
STAMP :=
DOCS_STAMP :=
COMPAT_STAMP :=
else
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
COMPAT_STAMP := $(VENV)/.compat-extra-installed
endif

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,bench,demo]' $(PINS)
	$(PYTHON) -m tools.check_env --need=test
	touch $@

$(VENV)/.docs-installed: $(STAMP)
	$(VENV)/bin/pip install -q -e '.[docs]' $(PINS)
	touch $@

# keras and sbx for the integration suite's differential tests (about 900 MB
# with torch's CPU wheel); make test does not need them.
$(VENV)/.compat-extra-installed: $(STAMP)
	$(VENV)/bin/pip install -q -e '.[compat-extra]' $(PINS)
	touch $@

# A separate venv with libtpu, for compiling against TPU slices (tables of
# docs/tpu.md, tests/tpu) without a TPU.
TPU_VENV := .venv-tpu
$(TPU_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/pip install -q --upgrade pip
	$(TPU_VENV)/bin/pip install -q -e '.[test,bench,demo,tpu]'
	touch $(TPU_VENV)/.installed

venv-tpu: $(TPU_VENV)/.installed

test-tpu: $(TPU_VENV)/.installed
	$(TPU_VENV)/bin/python -m pytest tests/tpu

.PHONY: demo demo-spirals test test-integration test-newest test-jax011 \
	env-check bench bench-accel docs clean venv-tpu test-tpu
demo: $(STAMP)
	$(PYTHON) -m examples.lm

demo-spirals: $(STAMP)
	$(PYTHON) -m examples.demo

test: $(STAMP)
	$(PYTHON) -m pytest -n 2 --dist worksteal -m 'not integration' tests

# End-to-end runs kept out of the ten-minute suite; CI runs both.
test-integration: $(STAMP) $(COMPAT_STAMP)
	$(PYTHON) -m pytest -n 2 --dist worksteal -m integration tests

# The newest end of the support window: the newest Python 3.12+ here, in a
# venv of its own, with whatever pip resolves today (the newest jax, jaxlib
# and flax the window admits). CI runs it beside `make test`.
NEWEST_PY ?= $(shell tools/newest_python.sh)
test-newest:
	@test -n "$(NEWEST_PY)" || { echo 'no Python 3.12+ found: set NEWEST_PY'; exit 1; }
	$(MAKE) test VENV=.venv-newest PY=$(NEWEST_PY)

# The JAX line GPU images ship (jax 0.11 on Python 3.12+): the accelerator
# binary's CPU smoke run and the JAX-internals checks, so that
# `make bench-accel VENV=` on such an image is known to work.
JAX011 ?= 0.11.2
test-jax011:
	@test -n "$(NEWEST_PY)" || { echo 'no Python 3.12+ found: set NEWEST_PY'; exit 1; }
	$(MAKE) .venv-jax011/.installed VENV=.venv-jax011 PY=$(NEWEST_PY) \
	  PINS='jax==$(JAX011) jaxlib==$(JAX011)'
	.venv-jax011/bin/python -m pytest -n 2 --dist worksteal \
	  tests/docs/test_accelerator_bench.py tests/docs/test_jax_private.py

# Python, JAX, jaxlib and flax of this environment against the support
# window, and the packages the tests and benchmarks need that it lacks.
env-check: $(STAMP)
	$(PYTHON) -m tools.check_env --need=test

# The docs site (mkdocs-material + mkdocstrings) into site/; warnings fail.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --quiet

bench: $(STAMP)
	$(PYTHON) -m benchmarks.trace_overhead

# liftmods vs flax.linen on the first device of this machine (GPU, TPU, or
# CPU at small sizes): LM step and MFU, stack memory, nn.jit dispatch. Its
# phase budgets add up to 7 minutes (an H100 window of 8). ACCEL_FLAGS adds
# flags, e.g. ACCEL_FLAGS=--stack_search; ACCEL_REQUIRE=gpu (or tpu,
# accelerator) refuses to measure on any other backend.
ACCEL_OUT ?= bench-out/accel
ACCEL_REQUIRE ?=
bench-accel: $(STAMP)
	$(PYTHON) -m tools.check_env --need=bench
	$(PYTHON) -m benchmarks.accelerator --out_dir=$(ACCEL_OUT) \
	  --require_backend=$(ACCEL_REQUIRE) $(ACCEL_FLAGS)

clean:
	rm -rf .venv .venv-newest .venv-jax011 $(TPU_VENV) site
