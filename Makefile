# sparsekv developer entry points. Each target works on a fresh machine by itself.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# On machines without a GPU take the CPU build of torch (a plain `torch` pulls several GB).
TORCH   ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: install test test-cuda demo bench nvcc clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[test]"
	touch $(STAMP)

test: install
	$(VPY) -m pytest -q $(PYTEST_ARGS)

# On the GPU machine: run everything and fail (not skip) the tests marked `cuda`.
test-cuda: install
	$(VPY) -m pytest -q --require-cuda $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/sparsekv demo

bench: install
	$(VENV)/bin/sparsekv bench

# Compile every kernel source for Hopper to catch errors without a GPU.
nvcc:
	@for f in csrc/*.cu; do [ -f "$$f" ] || continue; echo "nvcc $$f"; \
	  nvcc -arch=sm_90 -std=c++17 -c -o /dev/null "$$f" || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
