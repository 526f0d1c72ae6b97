# The two Quickstart commands: `make demo` (the main job on a built-in default) and `make test`.
# Each creates the virtual environment it needs. torch is pinned for the dev environment only
# (see DEVELOPERS.md); the package itself supports a range of torch versions.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0

.PHONY: demo test lint bench clean

$(BIN)/oomkit: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(BIN)/oomkit

# The main job: predict a built-in GPT-2 124M training step on an RTX 4090, without a GPU.
# (`oomkit demo` still compares allocator settings on a built-in trace.)
demo: $(BIN)/oomkit
	$(BIN)/oomkit predict gpt2-124m --batch 8 --seq 1024 --gpu rtx4090 --precision bf16-mixed

test: $(BIN)/oomkit
	$(BIN)/python -m pytest

# ruff (with each layer folder's ruff.toml banning imports that go up a layer) and mypy (its
# files and settings are in pyproject.toml); both must report nothing.
lint: $(BIN)/oomkit
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/mypy

bench: $(BIN)/oomkit
	$(BIN)/python benchmarks/replay_speed.py
	$(BIN)/python benchmarks/predict_speed.py

clean:
	rm -rf $(VENV) build src/*.egg-info
