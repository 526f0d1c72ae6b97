"""Fixtures for every test."""

from __future__ import annotations

import gc
import sys

import pytest


def pytest_collection_finish(session):
    """Once the test modules are imported (torch, transformers, oomkit: about 400,000 objects
    that live as long as the worker), move them out of the cyclic collector's sight
    (``gc.freeze``): every later full collection, automatic or asked for (oomkit's
    ``release_after_oom`` runs ``gc.collect()`` per caught OOM), then walks only what the tests
    made, not the whole import graph again (0.22 s of CPU per collection before the freeze,
    measured on this machine)."""
    gc.collect()
    gc.freeze()


_MODULE_RUNNING: list[object] = [None]


def _freeze_what_earlier_modules_left(item):
    """Before each test module's first test, what the earlier modules left alive goes out of
    the collector's sight too (``gc.collect`` then ``gc.freeze``, as after collection): the
    freeze above does not last, since every batch search ends with ``gc.unfreeze()``
    (``plan/frozen_heap.py``), and dynamo's and the tests' caches grow by the module. A module's
    own objects, its fixtures included, stay in the collector's sight until it ends, and what it
    leaves as garbage is collected here before the freeze. Measured on tests/prediction/models,
    tests/runtime and tests/diagnose in one process: 20.5 s of collections, 7.1 s with this
    (192 s of CPU in all, from 206 s), the same peak memory (861 MB, from 883 MB); in the
    whole suite, tests/runtime/test_resilient.py took 0.9 s of CPU, from 18.9 s (its OOMs'
    ``gc.collect`` had walked every earlier module's objects)."""
    if item.path != _MODULE_RUNNING[0]:
        _MODULE_RUNNING[0] = item.path
        gc.collect()
        gc.freeze()


@pytest.fixture(autouse=True)
def _terminal_size_not_inherited(monkeypatch):
    """The CLI sizes its tables from ``$COLUMNS`` when it is set, and a pipe otherwise gets
    unwrapped rows (``interfaces/cli/_common.py``); tests assert those layouts. A parent
    process may set the variables (pytest-xdist's workers get COLUMNS=80, LINES=24), so they
    are removed; a test about them sets its own."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


_CACHE_DIRS = iter(range(1 << 62))


@pytest.fixture(autouse=True)
def _recording_cache_per_test(monkeypatch, tmp_path_factory):
    """``oomkit predict`` keeps recordings in the user's cache folder
    (``prediction/recording_cache.py``): each test gets a folder of its own (made only when a
    test stores a recording), so no test writes into the real cache and none replays another's
    recording; ``OOMKIT_NO_CACHE`` from the caller's shell is removed so the cache runs as it
    does for users."""
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("OOMKIT_CACHE_DIR", str(base / f"oomkit-cache-{next(_CACHE_DIRS)}"))
    monkeypatch.delenv("OOMKIT_NO_CACHE", raising=False)


def pytest_collection_modifyitems(items):
    """The tests that use the local Ray cluster (``ray_session``) run first, in their order:
    every worker collects the same list, and pytest-xdist hands each worker a contiguous part
    of it, so they land on the first worker, which stops the cluster when its first test
    without Ray starts (``_ray_only_while_needed`` below). One worker starts a cluster, not
    each (about 10 s of wall time each), and no idle cluster (raylet, GCS, dashboard agent,
    idle workers) takes CPU for the rest of the run."""
    items.sort(key=lambda item: "ray_session" not in getattr(item, "fixturenames", ()))


_RAY_STOPPED_EARLY: list[bool] = [False]


def _start_ray(ray):
    # Its workers outlive each test's own OOMKIT_CACHE_DIR, so a test's monkeypatched preset
    # (cached by name) would reach another test's prediction: no recording cache there.
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False,
        runtime_env={"env_vars": {"OOMKIT_NO_CACHE": "1"}},
    )


def _ray_only_while_needed(item):
    """A test without ``ray_session`` stops this worker's Ray cluster, if it runs; a test with
    it after that (the tests of Ray come first, so only when another worker's share holds
    some) starts it again, before its fixtures."""
    ray = sys.modules.get("ray")
    if ray is None or not hasattr(ray, "is_initialized"):
        return
    uses = "ray_session" in getattr(item, "fixturenames", ())
    if not uses and ray.is_initialized():
        ray.shutdown()
        _RAY_STOPPED_EARLY[0] = True
    elif uses and _RAY_STOPPED_EARLY[0] and not ray.is_initialized():
        _start_ray(ray)
        _RAY_STOPPED_EARLY[0] = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before each test's fixtures: the heap frozen at a new module, Ray stopped or started."""
    _freeze_what_earlier_modules_left(item)
    _ray_only_while_needed(item)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster of 2 CPUs for every test of a worker that needs one (the executor,
    fleet and plan tests), started once per worker instead of once per module, and stopped
    by the first test without it (``_ray_only_while_needed``). (pytest-xdist's ``--dist
    loadgroup`` would put them on one worker, but xdist 3.8 sets ``item._nodeid``, which
    pytest 9.2's ``Node.nodeid`` no longer reads: the groups do not form.)"""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'oomkit[ray]')")
    if not ray.is_initialized():
        _start_ray(ray)
    yield ray
    if ray.is_initialized():
        ray.shutdown()
