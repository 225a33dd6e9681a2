# One-command entry points. Each creates .venv on first use (Python + pip are all it needs).
PY ?= python3
VENV ?= .venv
# The CPU build of torch that the CI machine carries on disk; override for a CUDA machine.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Engine adapters are tested against the real engines, each in its own venv (their torch pins differ).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm==0.26.0
SGLANG_VENV ?= .venv-sglang
SGLANG_SPEC ?= sglang==0.5.17

.PHONY: demo info test test-core test-vllm test-sglang test-gpu clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/nvfp4-plugin demo

info: $(VENV)/.installed
	$(VENV)/bin/nvfp4-plugin info

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)" pytest hypothesis
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

# SGLang pins its own torch (2.11) and transformers (5.12.1): its own venv, like vLLM's.
$(SGLANG_VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q "$(SGLANG_SPEC)" pytest hypothesis
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

# The whole CPU test suite (what CI runs). pytest exit code 5 = "no tests collected" is not a failure.
test: test-core test-vllm test-sglang

test-core: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -m "not gpu and not sm100" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

# vLLM adapter tests with the real vLLM (CPU platform, simulated tensor parallelism)
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -m "not gpu and not sm100" tests/engines/test_vllm_*.py $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

# SGLang adapter tests with the real SGLang (CPU, simulated tensor and expert parallelism)
test-sglang: $(SGLANG_VENV)/.installed
	$(SGLANG_VENV)/bin/python -m pytest -q -m "not gpu and not sm100" tests/engines/test_sglang_*.py $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

# GPU tests, on the GPU machine, with its system python (torch + triton preinstalled there).
test-gpu:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH python3 -m pytest -q -m "gpu" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no GPU tests collected"; fi; exit $$rc

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) build *.egg-info
