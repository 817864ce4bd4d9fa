# Two entry points that set everything up from nothing: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

# setup.py compiles the engine's source with Cython: a change there reinstalls (and recompiles).
ENGINE_SRC := setup.py sanitizer/rules/engine.py sanitizer/rules/engine.pxd sanitizer/order/clocks.py sanitizer/order/clocks.pxd

$(VENV)/.installed: pyproject.toml $(ENGINE_SRC)
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_PIN)"
	$(VPY) -m pip install -q -e ".[test,proof,report]"
	touch $@

.PHONY: venv test demo bench
venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(VPY) -m pytest -q -p no:cacheprovider

demo: $(VENV)/.installed
	$(VPY) examples/demo.py

bench: $(VENV)/.installed
	$(VPY) benchmarks/check_throughput.py
