# Two commands do all the set-up on a fresh clone:  make demo  and  make test.
# Both create (or reuse) the virtual environment $(VENV) and build the extension into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# No GPU here: the CPU build of torch from local disk. With a GPU: the default (CUDA) build.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
# CUDA kernels only where a GPU answers (nvidia-smi -L) or DSPARK_CUDA=1 asks (CI: sm_80 + sm_90a);
# a machine without a GPU skips minutes of nvcc for two architectures it cannot run.
DSPARK_CUDA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
export DSPARK_CUDA
# what the demo needs (build tools, the runtime, the plots) ...
DEPS := setuptools wheel pybind11 cmake ninja numpy safetensors tokenizers jinja2 tqdm \
        matplotlib nvidia-ml-py scipy
# ... and what only the tests need (the real clients the server is tested with among them)
TEST_DEPS := pytest hypothesis transformers fastapi uvicorn prometheus-client openai httpx \
        "lm-eval[api]" xgrammar jsonschema "guidellm~=0.8.1"
SOURCES := setup.py pyproject.toml CMakeLists.txt $(shell find csrc -type f 2>/dev/null)

.PHONY: test demo build env bench-cpu clean

$(VENV)/.deps: Makefile pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --progress-bar on "$(TORCH_SPEC)"
	$(PY) -m pip install --progress-bar on $(DEPS)
	touch $@

$(VENV)/.test-deps: $(VENV)/.deps
	$(PY) -m pip install --progress-bar on $(TEST_DEPS)
	touch $@

$(VENV)/.build-$(DSPARK_CUDA): $(VENV)/.deps $(SOURCES)
	@echo "building the extension (DSPARK_CUDA=$(DSPARK_CUDA)); CMake prints each step"
	$(PY) -m pip install -v --no-build-isolation --no-deps -e .
	rm -f $(VENV)/.build-*
	touch $@

build: $(VENV)/.build-$(DSPARK_CUDA)

env: build
	$(PY) -m dspark_rt env

test: build $(VENV)/.test-deps
	$(PY) -m dspark_rt env
	$(PY) -m pytest -q -ra

demo: build
	$(PY) -m dspark_rt demo $(DEMO_ARGS)

bench-cpu: build
	$(PY) bench/bench_kernels.py --device cpu

clean:
	rm -rf build *.egg-info dspark_rt/*.so $(VENV)/.build-*
