# Every target that needs the environment depends on .venv/.installed, so `make train` and
# `make test` on a fresh clone install first.
PY        := .venv/bin/python
VENV_OK   := .venv/.installed
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
export PYTHONUNBUFFERED := 1

.PHONY: install install-offline wheelhouse train test test-random test-fast lint typecheck check bench soak gpu-check ds-configs clean

install: $(VENV_OK)

$(VENV_OK): pyproject.toml
	@bash scripts/install.sh
	@touch $@

# tiny (10.1M parameters) on the built-in corpus in the precision `auto` picks (bf16 where the CPU has native
# bf16, fp32 on AVX2-only CPUs): 300 steps of 8 x 256 tokens (~614k tokens, about one epoch), val loss ~5.3
# nats (docs/benchmarks.md). Then: .venv/bin/llmtrain generate runs/tiny --prompt "The function"
TRAIN_RUN_DIR ?= runs/tiny
train: $(VENV_OK)
	.venv/bin/llmtrain train --preset tiny --run-dir $(TRAIN_RUN_DIR) --resume auto \
		--steps 300 --micro-batch 8 --seq-len 256 --lr 2e-3 --warmup-steps 30 \
		--eval-every 100 --save-every 100 --log-every 10

# The suite runs in TEST_WORKERS processes (pytest-xdist; a file's tests stay in one, so its trained
# references are made once): most multi-process tests wait on process start-up, rendezvous and kills, so
# two workers finish sooner than one even on two cores. Files are handed out in collection order, which
# tests/conftest.py puts longest first (--no-loadscope-reorder: xdist would sort them by test count). Order: pytest-randomly shuffles files and the
# tests inside them with TEST_SEED (printed at the top; the same seed gives the same order), so no test
# may depend on another having run: `make test TEST_SEED=7`, or `make test-random` for a new seed.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
TEST_SEED    ?= 2
PYTEST_RUN   := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25
test: $(VENV_OK)
	$(PYTEST_RUN) --randomly-seed=$(TEST_SEED) -m "not gpu" tests

test-random: $(VENV_OK)
	$(PYTEST_RUN) --randomly-seed=$$(od -An -N2 -tu2 /dev/urandom | tr -d ' ') -m "not gpu" tests

test-fast: $(VENV_OK)
	$(PY) -m pytest -q -p no:randomly -m "not gpu and not slow" tests

lint: $(VENV_OK)
	.venv/bin/ruff check llmtrain tests bench
	.venv/bin/ruff format --check llmtrain tests bench

typecheck: $(VENV_OK)
	.venv/bin/mypy

check: lint typecheck test

bench: $(VENV_OK)
	$(PY) -m bench

soak: $(VENV_OK)
	$(PY) -m pytest -q -s tests/soak_resume.py

# The GPU check of an installed llmtrain on a machine with a CUDA device: bench/results/gpu.json. No install
# prerequisite: without a CUDA device it refuses in one line at once, and without network it cannot install
# (make install-offline). GPU_CHECK_ARGS: --out DIR, --time-limit SECONDS, --only SECTION ..., --dry-run.
GPU_CHECK_ARGS ?=
gpu-check:
	@bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

# Air-gapped install. Where pip has network access: make wheelhouse [WHEELHOUSE=dir] [WHEEL_PYTHON=3.12]
# [WHEEL_PLATFORM=manylinux_2_28_x86_64] (default: this machine's python3 and platform); carry the folder
# and this checkout over; there: make install-offline WHEELHOUSE=dir (see scripts/wheelhouse.sh).
WHEELHOUSE ?= wheelhouse
WHEEL_PYTHON ?=
WHEEL_PLATFORM ?=
wheelhouse:
	bash scripts/wheelhouse.sh build $(WHEELHOUSE) $(if $(WHEEL_PYTHON),--python-version $(WHEEL_PYTHON)) \
		$(if $(WHEEL_PLATFORM),--platform $(WHEEL_PLATFORM))

install-offline:
	bash scripts/wheelhouse.sh install $(WHEELHOUSE)
	@touch $(VENV_OK)

ds-configs: $(VENV_OK)
	$(PY) -m llmtrain.planning.dsconfig_reference

clean:
	rm -rf .venv build *.egg-info .pytest_cache .mypy_cache .ruff_cache
