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

demo: $(BIN)/oomkit
	$(BIN)/oomkit demo

test: $(BIN)/oomkit
	$(BIN)/python -m pytest

lint: $(BIN)/oomkit
	$(BIN)/ruff check src tests benchmarks

bench: $(BIN)/oomkit
	$(BIN)/python benchmarks/replay_speed.py

clean:
	rm -rf $(VENV) build src/*.egg-info
