# sparsekv developer entry points. Each target works on a fresh machine by itself.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
# CUDA=1 also installs the `cuda` extra (CuPy and torch) for the cuda backend and cuda
# ranks. The default is the cpu backend only: no torch, no CuPy (a small .venv).
CUDA    ?=
comma   := ,
EXTRAS  := $(if $(CUDA),cuda$(comma)test,test)
# One stamp per flavour: `make install CUDA=1` after a plain install adds the extra.
STAMP   := $(VENV)/.installed-$(if $(CUDA),cuda,cpu)
PYTEST_ARGS ?=
# Worker processes for `make test` / `make soak` (pytest-xdist); 0 or 1: one process.
# Most tests wait on a daemon or a rank process, so more workers than cores pay: on 2 cores
# 4 workers take ~43 s where 2 take ~54 and one ~100. `make test-cuda` stays serial (the
# GPU tests share the devices).
JOBS    ?= 4
XDIST   := $(if $(filter-out 0 1,$(JOBS)),-n $(JOBS),)

.PHONY: install test test-cuda soak demo bench nvcc wheel gpu-wheels clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

# The default suite: every behaviour, short property runs, no soak tests (pyproject's
# addopts deselect `-m soak`).
test: install
	$(VPY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# On the GPU machine: run everything and fail (not skip) the tests marked `cuda`.
test-cuda: install
	$(VPY) -m pytest -q --require-cuda $(PYTEST_ARGS)

# Long runs: the tests marked `soak` (tests/client/test_soak.py; tests/soak/test_chaos.py,
# the chaos soak, and tests/soak/test_attack_soak.py, each SPARSEKV_SOAK_S seconds, default 60) and every hypothesis property
# test with many more examples (SPARSEKV_LONG=1; tests/helpers.py `examples`). Minutes.
soak: install
	SPARSEKV_LONG=1 $(VPY) -m pytest -q $(XDIST) -m "soak or hypothesis" $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/sparsekv demo

bench: install
	$(VENV)/bin/sparsekv bench

# Compile every kernel source for Hopper to catch errors without a GPU.
nvcc:
	@for f in csrc/*.cu; do [ -f "$$f" ] || continue; echo "nvcc $$f"; \
	  nvcc -arch=sm_90 -std=c++17 -c -o /dev/null "$$f" || exit 1; done
	@# the resolve's specialisations the daemon builds (daemon/kernels.py resolve_defines)
	@d="-DSKV_HASH_SCALE=4 -DSKV_WS_SMEM=1 -DSKV_LRU_SMEM=1 -DSKV_OWNER_SMEM=1"; echo "nvcc csrc/resolve.cu $$d"; \
	  nvcc -arch=sm_90 -std=c++17 -c -o /dev/null $$d csrc/resolve.cu
	@# the prefetch with a block size other than the default
	@d="-DSKV_RESOLVE_THREADS=256"; echo "nvcc csrc/prefetch.cu $$d"; \
	  nvcc -arch=sm_90 -std=c++17 -c -o /dev/null $$d csrc/prefetch.cu

# A wheel of the package (no dependencies) in dist/: `pip install dist/sparsekv-*.whl`.
wheel:
	$(PY) -m pip wheel -q --no-deps -w dist .

# The wheels tests/gpu/device_run.sh installs on the GPU machine (python 3.12, no pyzmq,
# pytest or prometheus-client there), downloaded into .whl/ for the device tool to carry.
# One version of each is kept (the newest): two stop the machine's pip install, and pip
# download can leave two (it fetched two hypothesis versions once).
gpu-wheels:
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
	  pyzmq "setuptools>=77" prometheus-client pytest hypothesis pytest-timeout
	$(PY) -c 'import collections, glob, os; from packaging.version import Version; \
	  w = collections.defaultdict(list); \
	  [w[os.path.basename(p).split("-")[0].lower()].append(p) for p in glob.glob(".whl/*.whl")]; \
	  [os.remove(p) for ps in w.values() for p in sorted(ps, key=lambda p: Version(os.path.basename(p).split("-")[1]))[:-1]]'

clean:
	rm -rf $(VENV) build dist *.egg-info
