# streamsched: the two commands of the README are `make demo` and `make test`.
# Each creates what it needs on the way: a .venv with PyTorch and the package, and the
# native extension streamsched._C (built in place, about two minutes the first time).

PYTHON ?= python3
# Plain `make` runs the tests (the CUDA environment rules below come first in the file).
.DEFAULT_GOAL := all
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
TORCH_SPEC ?= torch==2.13.0
INSTALLED := $(VENV)/.streamsched-installed
EXT_SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cpp)
EXT_STAMP := streamsched/.ext-built
OUT ?= out

.PHONY: all demo test test-fast lint format bench stress ext clean gpu-check gpu-prep info

# A second environment with the CUDA 13.0 build of PyTorch and torchvision (both on this
# machine's disk; no GPU needed to install or import them). The CUDA extension is compiled
# against it (`make cuda-build`) and the real-model suite runs in it (`make test-models`:
# timm imports torchvision, which needs its matching torch).
CUDA_VENV  ?= .venv-cuda
CUDA_PY    := $(CUDA_VENV)/bin/python
CUDA_PIP   := $(CUDA_PY) -m pip --disable-pip-version-check
CUDA_TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
CUDA_INSTALLED := $(CUDA_VENV)/.streamsched-installed

$(CUDA_PY):
	$(PYTHON) -m venv $(CUDA_VENV)

$(CUDA_INSTALLED): setup.cfg setup.py pyproject.toml Makefile | $(CUDA_PY)
	$(CUDA_PY) -c "import torch, torchvision" 2>/dev/null || $(CUDA_PIP) install -q $(CUDA_TORCH_SPEC)
	$(CUDA_PIP) install -q "setuptools>=64" wheel ninja
	SKIP_EXT=1 $(CUDA_PIP) install -q --no-build-isolation -e ".[test]"
	touch $@

# The extension with its CUDA backend, compiled in $(CUDA_VENV) against the CUDA build of
# PyTorch (no GPU needed) with -Werror, out of tree: streamsched/_C*.so stays the main
# .venv's. Checked by .ci/check_cuda_ext.py: every symbol resolves once torch is loaded,
# cuda_compiled() is True; and a failed compile leaves a working pure-Python install.
CUDA_BUILD := build/cuda
.PHONY: cuda-build
cuda-build: $(CUDA_BUILD)/.built $(CUDA_BUILD)/.fallback-checked

$(CUDA_BUILD)/.built: $(EXT_SOURCES) setup.py .ci/check_cuda_ext.py $(CUDA_INSTALLED)
	USE_CUDA=1 STREAMSCHED_WERROR=1 MAX_JOBS=$${MAX_JOBS:-2} $(CUDA_PY) setup.py -q build_ext \
	  --build-lib $(CUDA_BUILD)/lib --build-temp $(CUDA_BUILD)/tmp
	$(CUDA_PY) .ci/check_cuda_ext.py built $(CUDA_BUILD)/lib
	touch $@

$(CUDA_BUILD)/.fallback-checked: setup.py .ci/check_cuda_ext.py | $(CUDA_INSTALLED) $(CUDA_BUILD)/.built
	$(CUDA_PY) .ci/check_cuda_ext.py fallback $(CUDA_BUILD)/fallback
	touch $@

# The real-model suite (docs/models.md): timm and Hugging Face transformers models built
# with random weights from their configs, wrapped vs eager, in $(CUDA_VENV). Nothing is
# downloaded at run time (HF_HUB_OFFLINE=1). The in-tree streamsched/_C is built for the
# main .venv's torch and must not be loaded there: the Python runtime runs these tests.
MODELS_SPEC ?= timm==1.0.31 transformers==5.23.0
MODELS_INSTALLED := $(CUDA_VENV)/.models-installed
.PHONY: test-models

$(MODELS_INSTALLED): $(CUDA_INSTALLED)
	$(CUDA_PIP) install -q $(MODELS_SPEC)
	touch $@

test-models: $(MODELS_INSTALLED)
	STREAMSCHED_DISABLE_EXT=1 STREAMSCHED_REQUIRE_EXT=0 HF_HUB_OFFLINE=1 $(CUDA_PY) -m pytest -q tests/models

# The suite's strength: known breakages (a fused member 1e-3 off, effect edges dropped, the
# mode key ignoring submodules, output types lost, the eager fallback disabled, the stacked
# optimizer's unstack broken, record_stream removed, a float32-only kernel error, every
# compiled-schedule output +1), each planted in a copy of the tree under /tmp, must fail a
# test (the model tier too where $(CUDA_VENV) has it). Prints "N killed, M survived" last;
# fails on a survivor (tests/mutation_lite.py).
.PHONY: mutation-lite
mutation-lite: $(EXT_STAMP)
	$(PY) tests/mutation_lite.py

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

# PyTorch first (the CPU wheel on this machine's disk), then the package and its test
# extras against it. --no-build-isolation: the build must see the torch just installed,
# never fetch another one.
$(INSTALLED): setup.cfg setup.py pyproject.toml Makefile | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q "setuptools>=64" wheel
	SKIP_EXT=1 $(PIP) install -q --no-build-isolation -e ".[test,dev,plot]"
	touch $@

$(EXT_STAMP): $(EXT_SOURCES) setup.py $(INSTALLED)
	$(PY) setup.py -q build_ext --inplace
	touch $@

ext: $(EXT_STAMP)

# One intra-op thread, as every CPU figure of the README: on a busy machine two threads
# wait for each other's core at every op (profiles/cpu/examples/).
demo: $(EXT_STAMP)
	$(PY) examples/inception.py --threads 1

test: $(EXT_STAMP)
	$(PY) -m pytest -q tests

test-fast: $(EXT_STAMP)
	$(PY) -m pytest -q -x -m "not slow" tests

lint: $(INSTALLED)
	$(PY) -m ruff check streamsched tests examples benchmarks
	$(PY) -m ruff format --check streamsched tests examples benchmarks

format: $(INSTALLED)
	$(PY) -m ruff format streamsched tests examples benchmarks

bench: $(EXT_STAMP)
	$(PY) -m streamsched bench --out $(OUT)

stress: $(EXT_STAMP)
	$(PY) -m streamsched stress

info: $(EXT_STAMP)
	$(PY) -m streamsched info

# On the GPU machine (see README, "GPU validation"): build with CUDA, run everything
# including the cuda-marked tests, benchmarks and timelines; results under $(OUT).
gpu-check:
	bash .ci/gpu-check.sh $(OUT)

# On this (development) machine, before asking for a GPU machine: the wheels it lacks
# (.whl/, Python 3.12) and its prelude (.gpu/); both are git-ignored and travel with the tree.
gpu-prep:
	bash ../shared/gpu/wheels.sh hypothesis attrs sortedcontainers
	mkdir -p .gpu && cp ../shared/gpu/device-prelude.sh .gpu/

# Removes or moves each synchronisation call of the stream runtimes (Python executor, CUDA
# backend, eager dispatch, graph capture, the native runtime's csrc/runtime.cpp) one at a
# time, in a copy of the tree, and requires the cuda-marked tests on the emulated device to
# fail; prints "N killed, M survived" last. MUTATION_ARGS="--sample 8" runs a sample.
.PHONY: mutation
mutation: $(EXT_STAMP)
	$(PY) .ci/mutation.py $(MUTATION_ARGS)

clean:
	rm -rf build *.egg-info streamsched/_C*.so $(EXT_STAMP) .pytest_cache
