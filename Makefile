# Two entry points that set everything up from nothing: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_PIN)"
	$(VPY) -m pip install -q -e ".[test,proof,report]"
	touch $@

.PHONY: venv test demo bench gpu-check
venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(VPY) -m pytest -q -p no:cacheprovider

demo: $(VENV)/.installed
	$(VPY) examples/demo.py

bench: $(VENV)/.installed
	$(VPY) benchmarks/check_throughput.py

# On a machine with one CUDA GPU and a CUDA build of torch: capture end to end (under 5 minutes).
gpu-check:
	$(PY) -m sanitizer.capture.gpu_selfcheck
