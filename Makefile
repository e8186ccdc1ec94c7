# Each target creates .venv on first use, so a fresh clone needs nothing else.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,bench,demo]'
	touch $(STAMP)

$(DOCS_STAMP): $(STAMP)
	$(VENV)/bin/pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

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

.PHONY: demo demo-spirals test test-integration bench bench-accel docs clean venv-tpu test-tpu
demo: $(STAMP)
	$(VENV)/bin/python -m examples.lm

demo-spirals: $(STAMP)
	$(VENV)/bin/python -m examples.demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 --dist worksteal -m 'not integration' tests

# End-to-end runs kept out of the ten-minute suite; CI runs both.
test-integration: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 --dist worksteal -m integration tests

# The docs site (mkdocs-material + mkdocstrings) into site/; warnings fail.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks.trace_overhead

# liftmods vs flax.linen on the first device of this machine (GPU, TPU, or
# CPU at small sizes): LM step and MFU, stack memory, nn.jit dispatch. Its
# phase budgets add up to 7 minutes (an H100 window of 8). ACCEL_FLAGS adds
# flags, e.g. ACCEL_FLAGS=--stack_search.
ACCEL_OUT ?= bench-out/accel
bench-accel: $(STAMP)
	$(VENV)/bin/python -m benchmarks.accelerator --out_dir=$(ACCEL_OUT) $(ACCEL_FLAGS)

clean:
	rm -rf $(VENV) $(TPU_VENV) site
