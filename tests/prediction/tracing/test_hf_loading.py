"""from_pretrained onto the emulated GPU (tracing/hf_loading.py, import_hooks.py): every
device_map a script writes loads the same bytes as ``.to("cuda")``, and the patches are
applied when transformers is imported during the run and undone after."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from oomkit.core.target import Target
from oomkit.prediction.predictor import predict_recording
from oomkit.prediction.tracing.import_hooks import patched_on_import
from oomkit.prediction.tracing.script_run import record_script

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

RTX4090 = Target.resolve("rtx4090")

SCRIPT = """
import sys
import torch
from transformers import AutoModelForCausalLM

how = sys.argv[1]
if how == "to":
    model = AutoModelForCausalLM.from_pretrained("tiny", dtype=torch.bfloat16).to("cuda")
else:
    device_map = {"cuda": "cuda", "auto": "auto", "int": 0, "dict": {"": 0}}[how]
    model = AutoModelForCausalLM.from_pretrained("tiny", device_map=device_map, dtype=torch.bfloat16)
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    ids = torch.randint(0, 1000, (2, 64), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_loading")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128,
    )).save_pretrained(folder / "tiny")
    (folder / "train.py").write_text(textwrap.dedent(SCRIPT))
    return folder


def _peaks(folder, how):
    run = record_script(folder / "train.py", [how], steps=3, target=RTX4090, cwd=folder)
    p = predict_recording(run.recording, target=RTX4090)
    return p.peak_allocated_bytes, p.peak_reserved_bytes


@pytest.mark.parametrize("how", ["cuda", "auto", "int", "dict"])
def test_every_device_map_loads_what_to_cuda_loads(folder, how):
    """device_map="cuda" had failed in transformers' loader threads (aten::empty_strided on the
    CUDA backend), "auto", 0 and {"": 0} at torch.device(0) (no accelerator in a CPU build)."""
    assert _peaks(folder, how) == _peaks(folder, "to")


def test_the_loader_switch_and_patches_are_undone(folder):
    import os

    import transformers.modeling_utils as modeling

    before = (modeling.check_and_set_device_map, modeling._get_device_map)
    _peaks(folder, "auto")
    assert (modeling.check_and_set_device_map, modeling._get_device_map) == before
    assert "HF_DEACTIVATE_ASYNC_LOAD" not in os.environ


def test_a_module_imported_while_open_is_patched_then_put_back(tmp_path, monkeypatch):
    """A module first imported inside patched_on_import is patched once loaded (its loader
    is its own again, so its source reads back), and put back on exit; one already imported
    is patched at once."""
    import inspect

    (tmp_path / "oomkit_hook_probe.py").write_text("def answer():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("oomkit_hook_probe", None)

    def patch(module):
        original = module.answer
        module.answer = lambda: 2
        return lambda: setattr(module, "answer", original)

    with patched_on_import("oomkit_hook_probe", patch):
        import oomkit_hook_probe

        assert oomkit_hook_probe.answer() == 2
        assert "return 1" in inspect.getsource(oomkit_hook_probe)
    assert oomkit_hook_probe.answer() == 1
    assert not any(type(f).__name__ == "_PatchingFinder" for f in sys.meta_path)
    with patched_on_import("oomkit_hook_probe", patch):
        assert oomkit_hook_probe.answer() == 2
    assert oomkit_hook_probe.answer() == 1


def test_the_autocast_state_of_a_meta_tensors_device_is_cudas():
    """torch.is_autocast_enabled / get_autocast_dtype asked of x.device.type ("meta") answer
    for CUDA while recording (trl's chunked log-probs asks so; "meta" raised)."""
    from oomkit.prediction.tracing import trace_step

    seen = {}

    def step():
        x = torch.randn(4, 4, device="meta")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            seen["enabled"] = torch.is_autocast_enabled(x.device.type)
            seen["dtype"] = torch.get_autocast_dtype(x.device.type)
            return (x @ x).sum()

    trace_step(step)
    assert seen == {"enabled": True, "dtype": torch.bfloat16}
