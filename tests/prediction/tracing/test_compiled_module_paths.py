"""A ``torch.compile``d model is named as the model: no ``OptimizedModule`` path, no warning."""

from __future__ import annotations

import warnings

import torch

from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing.module_paths import ModulePaths


def _model() -> torch.nn.Sequential:
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_the_compile_wrapper_takes_its_models_path():
    """OptimizedModule is the model: seen first, it is the root "" and its layers have no _orig_mod."""
    model = _model()
    compiled = torch.compile(model)
    paths = ModulePaths()
    assert paths.path_of(compiled, None) == ""
    assert paths.path_of(model, None) == ""
    assert paths.path_of(model[2], (compiled, "")) == "2"


def test_the_compile_wrapper_inside_a_parent_takes_the_child_path():
    """A compiled submodule called inside its parent is named by the parent's attribute."""
    with torch.device("meta"):
        parent = torch.nn.Module()
        parent.body = _model()
    compiled = torch.compile(parent.body)
    paths = ModulePaths()
    paths.path_of(parent, None)
    assert paths.path_of(compiled, (parent, "")) == "body"


def test_a_traced_compiled_model_has_no_wrapper_path_and_no_hook_warning():
    """Eagerly traced torch.compile(model): tags name the layers, torch's global-hook warning stays quiet."""
    model = _model()
    compiled = torch.compile(model)
    with torch.device("meta"):
        x = torch.zeros(8, 16)

    def step(m, x):
        compiled(x).sum().backward()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recording = trace_step(step, model, x, steps=1)
    modules = {dict(e.tags).get("module") for e in recording.events if e.action == "alloc"}
    assert not any("OptimizedModule" in (m or "") or "_orig_mod" in (m or "") for m in modules)
    assert {"0", "2"} <= modules
    assert not [w for w in caught if "global hooks" in str(w.message)]


def test_a_presets_compiled_region_is_named_by_the_preset_step_not_the_launcher():
    """With no user frame, the site is the preset step's line, never `bin/oomkit` or torch's."""
    from oomkit.prediction.models import StepOptions, build_preset_step

    built = build_preset_step("gpt2-124m", StepOptions(batch_size=1, seq_len=16, compile=True))
    recording = trace_step(built.step_fn, *built.track, steps=1)
    (warning,) = [w for w in recording.warnings if "compiled code was entered" in w]
    assert "(oomkit/prediction/models/steps.py:" in warning
    assert " in train_step (1x)" in warning


def test_the_oomkit_console_script_is_hidden_but_a_users_file_of_that_name_is_not():
    """pip's `bin/oomkit` launcher is oomkit's; a user's `oomkit` file elsewhere is theirs."""
    from oomkit.prediction.tracing.stand_ins import is_hidden_file

    assert is_hidden_file("/home/me/.venv/bin/oomkit")
    assert is_hidden_file("C:/env/Scripts/oomkit")
    assert not is_hidden_file("/home/me/project/oomkit")
    assert not is_hidden_file("/home/me/.venv/bin/train.py")


def test_a_module_that_died_before_it_was_named_has_no_path():
    """A weakref first hashed after its module died cannot be hashed; the module was never
    named, so it has no path (the recording's build had raised "weak object has gone away"
    when a library dropped a module it made during the step)."""
    import gc

    paths = ModulePaths()
    module = torch.nn.Linear(2, 2)
    ref = paths.ref(module)
    del module
    gc.collect()
    assert ref() is None
    assert paths.of_ref(ref) is None
