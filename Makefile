# octavo: `make serve` and `make test` are the two commands; both set up .venv first
# (`make lint`, run by `make test`, is `ruff check .` alone).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
CRD_SCHEMAS := tests/server/crd_schemas
PACKAGES := . platforms/cpu platforms/triton_common platforms/cuda platforms/rocm platforms/tpu plugins/octavo-example-platform
MODEL ?=
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install bytecode lint test serve clean runtime

install: $(STAMP)

$(STAMP): pyproject.toml platforms/*/pyproject.toml plugins/*/pyproject.toml requirements-test.txt platforms/cpu/setup.py $(wildcard platforms/cpu/csrc/*) $(CRD_SCHEMAS)/package-lock.json
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch is pinned to the CPU wheel; install it first so nothing pulls a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements-test.txt
	$(PIP) install -q --no-build-isolation $(foreach p,$(PACKAGES),-e $(p))
	$(MAKE) --no-print-directory bytecode
	# The Helm chart's custom resources are checked against their operators' schemas, which
	# the npm registry has (tests/server/test_helm_chart.py); without npm those checks skip.
	if command -v npm > /dev/null; then npm ci --prefix $(CRD_SCHEMAS) --no-audit --no-fund --loglevel=error \
		|| echo "WARNING: npm ci failed: the chart's custom resources will not be schema-checked"; \
	else echo "WARNING: no npm: the chart's custom resources will not be schema-checked"; fi
	touch $(STAMP)

# Byte-compile the project's packages, as installing a wheel does: editable installs are not,
# and where PYTHONDONTWRITEBYTECODE is set every start compiles them again (~0.3 s of `octavo
# serve`'s start-up). Python recompiles any module edited since.
bytecode:
	$(PY) -m compileall -q -j 0 core platforms plugins > /dev/null

lint: install
	$(VENV)/bin/ruff check .

# Lint first: a lint error fails `make test` (and so .ci/run) before any leg runs.
test: lint
	$(PY) ci/run_leg.py all

serve: install bytecode
	$(VENV)/bin/octavo serve $(MODEL) --host $(HOST) --port $(PORT)

# One platform's runtime, without the test tools, in a new venv at PREFIX: what the images in
# deploy/docker install (their build stage runs this target; tests/deploy runs it too).
# PLATFORM: cpu | cuda | rocm | tpu. TORCH_INDEX: where torch==2.13.0 comes from (the cpu image:
# PyTorch's CPU index; empty: pip's default). The cpu kernels build for AVX-512 and AVX2 alike.
PLATFORM ?= cpu
PREFIX ?= /opt/octavo
TORCH_INDEX ?=
RUNTIME_PACKAGES_cpu := platforms/cpu
RUNTIME_PACKAGES_cuda := platforms/triton_common platforms/cuda
RUNTIME_PACKAGES_rocm := platforms/triton_common platforms/rocm
RUNTIME_PACKAGES_tpu := platforms/tpu
RUNTIME_EXTRAS_tpu := 'jax[tpu]==0.10.2'

runtime:
	@test -n "$(RUNTIME_PACKAGES_$(PLATFORM))" || { echo "PLATFORM must be cpu, cuda, rocm or tpu; got '$(PLATFORM)'"; exit 2; }
	$(PYTHON) -m venv $(PREFIX)
	$(PREFIX)/bin/pip install -q --upgrade pip setuptools
	$(PREFIX)/bin/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PREFIX)/bin/pip install -q --no-build-isolation '.[serve]' $(RUNTIME_PACKAGES_$(PLATFORM)) $(RUNTIME_EXTRAS_$(PLATFORM))

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis $(CRD_SCHEMAS)/node_modules
