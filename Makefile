# Set-up is two commands: `make demo` and `make test`.
# Both create .venv when it is missing and install the package into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test venv clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	touch $@

$(VENV)/.installed: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/fusion-pass demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
