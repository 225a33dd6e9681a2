# One-command entry points. Each creates .venv on first use (Python + pip are all it needs).
PY ?= python3
VENV ?= .venv
# The CPU build of torch that the CI machine carries on disk; override for a CUDA machine.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Triton (and with it the CPU interpreter tests) is installed on Linux x86_64 only (pyproject's test
# extra); there its absence is a failure, elsewhere its tests skip.
CORE_REQUIRE := $(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),triton)
# The engine adapters are tested against the real vLLM and SGLang, both in one venv (see
# tests/engines/requirements-engines.txt for what is left out and why).
ENGINES_VENV ?= .venv-engines
ENGINES_SPEC ?= vllm==0.26.0 sglang==0.5.17 flashinfer-python==0.6.14
# The engines pin torch 2.11.0; on this CPU-only machine the release that lies on its disk stands in
# (the adapters only touch the engines' Python layers). SGLang imports torchvision at start-up, and
# PyPI has no CPU torchvision for x86_64, so this is a CUDA build of torch (it runs on the CPU too).
ENGINES_TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# No wheel cache: the CI machine's disk is small.
PIP_INSTALL = python -m pip install -q --no-cache-dir

.PHONY: demo info test test-core test-engines test-vllm test-sglang test-image test-gpu clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(VENV)/bin/$(PIP_INSTALL) --upgrade pip
	$(VENV)/bin/$(PIP_INSTALL) "$(TORCH_SPEC)"
	$(VENV)/bin/$(PIP_INSTALL) -e ".[test,demo]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/nvfp4-plugin demo

info: $(VENV)/.installed
	$(VENV)/bin/nvfp4-plugin info

# vLLM and SGLang without their CUDA-only dependencies (--no-deps + the curated list); pip's
# resolver then reports the packages it did not install, which is expected.
$(ENGINES_VENV)/.installed: pyproject.toml Makefile tests/engines/requirements-engines.txt
	$(PY) -m venv $(ENGINES_VENV)
	$(ENGINES_VENV)/bin/$(PIP_INSTALL) --upgrade pip
	$(ENGINES_VENV)/bin/$(PIP_INSTALL) $(ENGINES_TORCH_SPEC)
	$(ENGINES_VENV)/bin/$(PIP_INSTALL) --no-deps $(ENGINES_SPEC)
	$(ENGINES_VENV)/bin/$(PIP_INSTALL) -r tests/engines/requirements-engines.txt > $(ENGINES_VENV)/pip.log 2>&1; \
	rc=$$?; if [ $$rc -ne 0 ]; then cat $(ENGINES_VENV)/pip.log; else \
	grep -Ev "^ERROR: pip's dependency resolver|^(vllm|sglang) [0-9.]+ requires " $(ENGINES_VENV)/pip.log; fi; exit $$rc
	$(ENGINES_VENV)/bin/python -c "import vllm, sglang, torch; print('engines venv:', vllm.__version__, sglang.__version__, torch.__version__)"
	$(ENGINES_VENV)/bin/$(PIP_INSTALL) --no-deps -e .
	touch $@

# The whole CPU test suite (what CI runs). pytest exit code 5 = "no tests collected" is not a failure.
test: test-core test-engines test-image

test-core: $(VENV)/.installed
	NVFP4_TEST_REQUIRE=$(CORE_REQUIRE) $(VENV)/bin/python -m pytest -q -m "not gpu and not sm100" --ignore=tests/engines $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

# The adapters inside the real vLLM and SGLang (CPU platform, simulated tensor and expert parallelism).
# NVFP4_TEST_REQUIRE turns a broken engine install into a failure instead of skipped tests.
test-engines: test-vllm test-sglang

test-vllm: $(ENGINES_VENV)/.installed
	NVFP4_TEST_REQUIRE=vllm,flashinfer $(ENGINES_VENV)/bin/python -m pytest -q -m "not gpu and not sm100" tests/engines/test_vllm_*.py $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

test-sglang: $(ENGINES_VENV)/.installed
	NVFP4_TEST_REQUIRE=sglang $(ENGINES_VENV)/bin/python -m pytest -q -m "not gpu and not sm100" tests/engines/test_sglang_*.py $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

# The serving image without Docker: hadolint on the Dockerfile, then its build script for real: the
# extension for sm_90a / sm_100a / sm_103a against the engines venv's CUDA torch, checked with
# cuobjdump (the test extras' wheel) and `info --capability X.Y --compile`.
IMAGE_BUILD_DIR ?= /tmp/nvfp4-image-build
test-image: $(VENV)/.installed $(ENGINES_VENV)/.installed
	$(VENV)/bin/hadolint Dockerfile
	rm -rf $(IMAGE_BUILD_DIR)
	CUOBJDUMP=$$($(VENV)/bin/python -c 'import nvidia, pathlib; print(next(str(c) for b in nvidia.__path__ for c in pathlib.Path(b).glob("*/bin/cuobjdump")))') \
	PYTHON=$(ENGINES_VENV)/bin/python MAX_JOBS=2 bash docker/build.sh --target $(IMAGE_BUILD_DIR)

# GPU tests, on the GPU machine, with its system python (torch + triton preinstalled there).
test-gpu:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH python3 -m pytest -q -m "gpu" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no GPU tests collected"; fi; exit $$rc

clean:
	rm -rf $(VENV) $(ENGINES_VENV) build *.egg-info
