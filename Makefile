# The two Quickstart commands: `make demo` (the main job on a built-in default) and `make test`.
# Each creates the virtual environment it needs. torch is pinned for the dev environment only
# (see DEVELOPERS.md); the package itself supports a range of torch versions.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
# Where torch comes from. PyPI's Linux wheel is the multi-GB CUDA build; PyTorch's CPU-only index
# (about 200 MB) is enough for everything here, GPU-free prediction included. It is used when
# pip can reach it; otherwise pip's own configuration decides (a local mirror, PyPI). Override
# with `make TORCH_INDEX=...`, or `make TORCH_INDEX=` to always use pip's configuration.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test test-compiled compiled-site lint docs bench bench-compiled clean

$(BIN)/oomkit: pyproject.toml requirements/torchtitan.txt requirements/dev-constraints.txt
	$(PYTHON) -m venv $(VENV)
	if [ -n "$(TORCH_INDEX)" ] && $(BIN)/python scripts/index_reachable.py "$(TORCH_INDEX)"; then \
		$(BIN)/pip install -q --index-url "$(TORCH_INDEX)" $(TORCH_PIN); \
	else \
		$(BIN)/pip install -q $(TORCH_PIN); \
	fi
	$(BIN)/pip install -q -c requirements/dev-constraints.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps -r requirements/torchtitan.txt
	touch $(BIN)/oomkit

# The main job: predict a built-in GPT-2 124M training step on an RTX 4090, without a GPU.
# (`oomkit demo` still compares allocator settings on a built-in trace.)
demo: $(BIN)/oomkit
	$(BIN)/oomkit predict gpt2-124m --batch 8 --seq 1024 --gpu rtx4090 --precision bf16-mixed

# The tests run in parallel (pytest-xdist), one worker per core, at most 4: each worker imports
# torch (about 0.5 GB), and the tests that fork process pools take cores of their own.
# --dist worksteal: each worker starts on its own contiguous share of the tests (a module's
# tests stay on one worker, so a module-scoped fixture is made once, not once per worker) and
# a worker that runs out takes half of another's queue; xdist's default (load) hands out
# chunks it cannot take back, so one worker could run the last modules alone.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 4 ] && n=4; echo $$n)
TEST_DIST ?= worksteal
# About 240 tests start `python -m oomkit` (or a script that imports it) in a process of its
# own. A shell with PYTHONDONTWRITEBYTECODE set (as on the development machines) would have each
# of them compile oomkit's ~290 modules from source again (about 0.4 s of CPU each): the tests
# write bytecode as Python does by default (__pycache__, ignored by git). Empty is unset to Python.
TEST_ENV := PYTHONDONTWRITEBYTECODE=

test: $(BIN)/oomkit
	$(TEST_ENV) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist $(TEST_DIST)

# CI also runs the allocator, replay and hostile-input tests on the compiled core that `pip install .` gives: a
# wheel built by setup.py (mypyc; the build fails rather than fall back to pure Python), installed
# into build/compiled-site, which PYTHONPATH puts before the editable install's sources.
COMPILED_TESTS := tests/core tests/prediction/test_replay_hooks.py \
	tests/interfaces/cli/test_replay_cli.py tests/interfaces/cli/test_tune.py \
	tests/interfaces/cli/test_simulate_cli.py tests/interfaces/reports/test_golden.py \
	tests/robustness/test_hostile_snapshots.py tests/robustness/test_hostile_traces.py \
	tests/robustness/test_hostile_pickles.py
compiled-site: $(BIN)/oomkit
	rm -rf build/compiled-wheel build/compiled-site
	OOMKIT_REQUIRE_COMPILED=1 $(BIN)/pip wheel -q --no-deps -w build/compiled-wheel .
	$(BIN)/pip install -q --no-deps --target build/compiled-site build/compiled-wheel/oomkit-*.whl

test-compiled: compiled-site
	OOMKIT_EXPECT_COMPILED=1 PYTHONPATH=build/compiled-site $(BIN)/python -m pytest \
		-n $(TEST_WORKERS) --dist $(TEST_DIST) -p no:cacheprovider $(COMPILED_TESTS)

# ruff (with each layer folder's ruff.toml banning imports that go up a layer) and mypy (its
# files and settings are in pyproject.toml); both must report nothing.
lint: $(BIN)/oomkit
	$(BIN)/ruff check src tests benchmarks scripts setup.py
	$(BIN)/mypy

# The documentation site (mkdocs.yml; Material theme, mkdocstrings, the CLI reference generated
# from the parser by docs/hooks/cli_reference.py) into site/; --strict fails on any broken link,
# missing page or docstring warning.
docs: $(BIN)/oomkit
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(BIN)/oomkit
	$(BIN)/python benchmarks/replay_speed.py
	$(BIN)/python benchmarks/predict_speed.py

# The replay benchmark's real traces on the core a user installs (the wheel setup.py compiles)
# and on the pure-Python sources, one after the other.
bench-compiled: compiled-site
	PYTHONPATH=build/compiled-site $(BIN)/python benchmarks/replay_speed.py --part real
	$(BIN)/python benchmarks/replay_speed.py --part real

clean:
	rm -rf $(VENV) build site src/*.egg-info
