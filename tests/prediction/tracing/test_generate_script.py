"""An inference script that calls transformers' generate: it runs to max_new_tokens."""

from __future__ import annotations

import linecache
import textwrap

import pytest
import torch

from oomkit.core.target import Target
from oomkit.prediction.tracing.script_run import record_script
from oomkit.prediction.tracing.value_reads import value_tracking

pytest.importorskip("transformers")

RTX4090 = Target.resolve("rtx4090")

# GPT-2 of one block, made from its config (no download); token ids made on the CPU, as a
# tokenizer makes them, and moved to the GPU.
GENERATE = """
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel

config = GPT2Config(n_layer=1, n_head=2, n_embd=256, vocab_size=100, n_positions=128)
model = GPT2LMHeadModel(config).to("cuda").eval()
ids = torch.randint(2, 100, (8, 8)).to("cuda")
with torch.no_grad():
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(sys.argv[1]),
        do_sample=False, pad_token_id=0, eos_token_id=1,
    )
assert out.shape == (8, 8 + int(sys.argv[1])), out.shape
"""


def _run(tmp_path, new_tokens):
    (tmp_path / "gen.py").write_text(textwrap.dedent(GENERATE))
    return record_script(tmp_path / "gen.py", [str(new_tokens)], target=RTX4090, cwd=tmp_path)


@pytest.mark.parametrize("new_tokens", [3, 7])
def test_generate_runs_to_max_new_tokens(tmp_path, new_tokens):
    """Each new token but the last asks whether the sequences ended ('not yet'); the last is
    the length limit's stop, known. One attention call per token per block."""
    run = _run(tmp_path, new_tokens)
    assumption = run.recording.assumptions["generation length"]
    assert assumption.startswith(f"transformers' generate asked {new_tokens - 1} time(s)")
    assert run.steps_recorded == 0
    attention = {k: n for k, n in run.recording.kernel_choices.items() if "SDPA" in k}
    assert sum(attention.values()) == new_tokens, attention


def test_more_new_tokens_hold_more_memory(tmp_path):
    """The KV cache grows with each token (8 sequences x 256 keys and 256 values, fp32: 16 KiB
    a token): with 64 new tokens the peak is at the end, holding the cache of all 72."""
    from oomkit.prediction.predictor import predict_recording

    def predicted(new_tokens: int):
        folder = tmp_path / str(new_tokens)
        folder.mkdir()
        return predict_recording(_run(folder, new_tokens).recording, target=RTX4090)

    short, long = predicted(2), predicted(64)
    assert long.peak_allocated_bytes > short.peak_allocated_bytes
    assert long.peak_allocated_at.by_category_bytes["activation"] >= 72 * 16 * 1024


def test_the_stop_check_of_older_transformers_answers_not_yet():
    """transformers 4.x asks in _has_unfinished_sequences (`elif this_peer_finished`): a bool()
    read there is 'not yet' too; the same read elsewhere is refused as a condition."""
    source = (
        "def _has_unfinished_sequences(this_peer_finished):\n"
        "    if this_peer_finished:\n"
        "        return False\n"
        "    return True\n"
    )
    namespace: dict[str, object] = {}
    exec(compile(source, "/lib/site-packages/transformers/generation/utils.py", "exec"), namespace)
    elsewhere: dict[str, object] = {}
    exec(compile(source, "/lib/site-packages/mylib/loop.py", "exec"), elsewhere)
    from oomkit.errors import DataDependentValueError

    with value_tracking() as (_, reads), torch.device("meta"):
        finished = torch.empty(3, dtype=torch.long).max() == 0  # unknown
        assert namespace["_has_unfinished_sequences"](finished) is True
        with pytest.raises(DataDependentValueError):
            elsewhere["_has_unfinished_sequences"](finished)
    assert reads.generation_goes_on == 1


@pytest.mark.parametrize("new_tokens", [3, 6])
def test_beam_search_runs_to_max_new_tokens_with_every_beam(tmp_path, new_tokens):
    """num_beams=3: transformers 5's _beam_search asks after each token but the last whether a
    beam is unfinished ('yes'), runs the model on 8 x 3 sequences, and crops its output to the
    length it ran (the script asserts the shape)."""
    script = GENERATE.replace("do_sample=False,", "do_sample=False, num_beams=3,")
    (tmp_path / "gen.py").write_text(textwrap.dedent(script))
    run = record_script(tmp_path / "gen.py", [str(new_tokens)], target=RTX4090, cwd=tmp_path)
    assumption = run.recording.assumptions["generation length"]
    assert assumption.startswith(f"transformers' generate asked {new_tokens - 1} time(s)")
    attention = {k: n for k, n in run.recording.kernel_choices.items() if "SDPA" in k}
    assert sum(attention.values()) == new_tokens, attention


def test_a_slice_bound_tensor_is_read_as_an_index():
    """x[:, :n] with n a 0-dim tensor: torch reads n in C++; a known n slices, an unknown one
    is refused as an integer, naming the line (not the meta kernel's failure)."""
    from oomkit.errors import DataDependentValueError

    with value_tracking() as (_, reads), torch.device("meta"):
        x = torch.empty(4, 10)
        n = torch.tensor(3) + 2  # known: 5
        assert x[:, :n].shape == (4, 5)
        assert x[1:n, ::2].shape == (3, 5)
        x[:, n:] = 0.0  # __setitem__ too
        unknown = torch.empty(4, 10).argmax()
        with pytest.raises(DataDependentValueError, match="integer"):
            x[:, :unknown]
    assert [r.outcome for r in reads.records.values()].count("answered") >= 3


def test_token_ids_made_on_the_gpu_with_a_mask_of_ones_generate(tmp_path):
    """Ids drawn on the GPU (values unknown) with ``attention_mask=torch.ones_like(ids)``:
    the mask is known (ones_like reads only its input's layout), and generate's check for
    dummy ids filled with -100 is answered "no" (token ids are never negative). It had stopped
    at both reads."""
    source = GENERATE.replace('ids = torch.randint(2, 100, (8, 8)).to("cuda")', 'ids = torch.randint(2, 100, (8, 8), device="cuda")')
    assert source != GENERATE
    (tmp_path / "gen.py").write_text(textwrap.dedent(source))
    run = record_script(tmp_path / "gen.py", ["4"], target=RTX4090, cwd=tmp_path)
    assert run.recording.assumptions["generation length"].startswith("transformers' generate asked 3 time(s)")
    mask_reads = [
        text for key, text in run.recording.assumptions.items()
        if key.startswith("read at utils.py:") and "(torch.ones_like)" in text
    ]
    assert len(mask_reads) == 2


def test_ids_drawn_on_the_gpu_without_a_mask_generate_with_the_inferred_mask_dropped(tmp_path):
    """Unknown ids, no attention_mask, a pad token: generate's right-padding check (it only
    logs) is answered "no", and its test of the mask it inferred is answered "all ones" (no
    padding), said as an assumption; generate then runs to max_new_tokens. Both had stopped
    the script ("bool() of a tensor whose values oomkit cannot know")."""
    source = GENERATE.replace(
        'ids = torch.randint(2, 100, (8, 8)).to("cuda")',
        'ids = torch.randint(2, 100, (8, 8), device="cuda")',
    ).replace("ids, attention_mask=torch.ones_like(ids), ", "ids, ")
    assert "attention_mask" not in source
    (tmp_path / "gen.py").write_text(textwrap.dedent(source))
    run = record_script(tmp_path / "gen.py", ["4"], target=RTX4090, cwd=tmp_path)
    assumptions = run.recording.assumptions
    assert assumptions["generation length"].startswith("transformers' generate asked 3 time(s)")
    inferred = [text for key, text in assumptions.items() if key.endswith(" in generate")]
    assert inferred == [
        "bool() = True, assumed: the attention mask generate inferred from token ids oomkit "
        "cannot know is all ones (no padding), so generate drops it; pass attention_mask to "
        "generate to state it; 1 time(s)"
    ]


def test_a_mask_the_code_passed_is_not_assumed_all_ones(monkeypatch):
    """The all-ones answer is for a mask generate inferred (kwargs_has_attention_mask False);
    the same test of a mask the code passed, unknown, is refused as a condition."""
    from oomkit.errors import DataDependentValueError

    source = (
        "def generate(mask, kwargs_has_attention_mask):\n"
        "    model_kwargs = {'attention_mask': mask}\n"
        "    if (\n"
        "        True\n"
        "        and (model_kwargs[\"attention_mask\"] == 1).all()\n"
        "    ):\n"
        "        return 'dropped'\n"
        "    return 'kept'\n"
    )
    filename = "/lib/site-packages/transformers/generation/utils.py"
    # The check reads generate's line, as from the installed file.
    monkeypatch.setitem(
        linecache.cache, filename, (len(source), None, source.splitlines(True), filename)
    )
    namespace: dict[str, object] = {}
    exec(compile(source, filename, "exec"), namespace)
    generate = namespace["generate"]
    with value_tracking() as (_, reads), torch.device("meta"):
        mask = torch.empty(2, 4, dtype=torch.long)
        assert generate(mask, False) == "dropped"
        with pytest.raises(DataDependentValueError, match="condition"):
            generate(mask, True)
    assert [r.value for r in reads.records.values()] == ["True"]
