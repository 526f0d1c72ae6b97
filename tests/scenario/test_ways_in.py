"""One scenario, four ways in: Python, a TOML file, CLI flags and the MCP tool give identical
prediction JSON (issue 33's acceptance), on a preset, --hf with a local config, a
file.py:function, --fsdp, and --lora with --quantize."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import textwrap

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import oomkit  # noqa: E402
from oomkit.interfaces.cli import main  # noqa: E402
from oomkit.interfaces.reports.prediction import prediction_to_json  # noqa: E402
from oomkit.scenario import scenario_to_data, scenario_to_toml  # noqa: E402

FUNCTION = '''
import torch

def build(batch_size, seq_len=32):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch_size, seq_len, 64)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (model, opt, x)
'''


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """(name, CLI flags, Python keywords) of each workload."""
    folder = tmp_path_factory.mktemp("ways_in")
    hf = folder / "tiny-llama"
    # One layer: the ways in are the subject (as ONE_BLOCK_GPT2 below), and each is recorded 4 times.
    transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
    ).save_pretrained(hf)
    step = folder / "step.py"
    step.write_text(textwrap.dedent(FUNCTION))
    small = {"batch": 1, "seq": 32, "gpu": "rtx4090"}
    flags = ["--batch", "1", "--seq", "32", "--gpu", "rtx4090"]
    return [
        ("preset", ["gpt2-124m", *flags], ("gpt2-124m", small)),
        ("hf", ["--hf", str(hf), *flags], (None, {"hf": str(hf), **small})),
        ("function", [f"{step}:build", "--batch", "2", "--gpu", "rtx4090"],
         (f"{step}:build", {"batch": 2, "gpu": "rtx4090"})),
        ("fsdp", ["gpt2-124m", "--fsdp", "2", *flags], ("gpt2-124m", {"fsdp": 2, **small})),
        ("lora-quantize", ["gpt2-124m", "--lora", "4", "--quantize", "nf4", *flags],
         ("gpt2-124m", {"lora": 4, "quantize": "nf4", **small})),
    ]


# Preset gpt2-124m built one block deep (256 wide, vocabulary 8192), in this process and in the
# `oomkit mcp` server's: the ways in are the subject, not the model's size (a full gpt2-124m
# recording costs seconds of CPU, and each preset case is recorded 4 times).
ONE_BLOCK_GPT2 = """
import dataclasses, types
from oomkit.prediction.models import presets
from oomkit.prediction.models.gpt2 import GPT2Shape
_shape = GPT2Shape(hidden=256, layers=1, heads=4, vocab=8192, positions=512)
presets.PRESETS = types.MappingProxyType(
    {**presets.PRESETS, "gpt2-124m": dataclasses.replace(presets.PRESETS["gpt2-124m"], shape=_shape)}
)
"""
# `python -m oomkit mcp`, after ONE_BLOCK_GPT2.
MCP_SERVER = ONE_BLOCK_GPT2 + """
import sys
from oomkit.interfaces.cli import console_main
sys.argv = ["oomkit", "mcp"]
console_main()
"""


@pytest.fixture
def one_block_gpt2(monkeypatch):
    """ONE_BLOCK_GPT2 in this process, undone after the test."""
    from oomkit.prediction.models import presets

    monkeypatch.setattr(presets, "PRESETS", presets.PRESETS)
    exec(ONE_BLOCK_GPT2, {})


def _cli(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["predict", *argv, "--json"])
    assert code in (0, 1), argv
    return json.loads(out.getvalue())


async def _mcp_results(scenarios):
    """Each scenario through the `predict` tool of `oomkit mcp` (MCP_SERVER), with the MCP
    SDK's own client over stdio (one server for all of them), and the tool list."""
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=sys.executable, args=["-c", MCP_SERVER])
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = await session.list_tools()
        results = []
        for data in scenarios:
            result = await session.call_tool("predict", data)
            assert not result.is_error, result.content[0].text
            results.append(json.loads(result.content[0].text))
        bad = await session.call_tool("predict", {"model": {"preset": "gpt2-124m"}, "step": {"batch": 0}})
        return tools, results, bad


def test_the_four_ways_in_give_identical_json(cases, tmp_path, one_block_gpt2):
    """Python, TOML, CLI flags and MCP: the same JSON, the scenario embedded in each."""
    pytest.importorskip("mcp")
    import anyio

    by_way: dict[str, list] = {"python": [], "toml": [], "cli": []}
    scenarios = []
    for name, flags, (what, keywords) in cases:
        prediction = oomkit.predict(what, **keywords)
        python = json.loads(json.dumps(prediction_to_json(prediction)))
        scenario = oomkit.Scenario.model_validate(python["scenario"])
        config = tmp_path / f"{name}.toml"
        config.write_text(scenario_to_toml(scenario))
        by_way["python"].append(python)
        by_way["toml"].append(_cli(["--config", str(config)]))
        by_way["cli"].append(_cli(flags))
        scenarios.append(scenario_to_data(scenario))
    tools, mcp, bad = anyio.run(_mcp_results, scenarios)
    for i, (name, _, _) in enumerate(cases):
        python = by_way["python"][i]
        assert by_way["toml"][i] == python, name
        assert by_way["cli"][i] == python, name
        assert mcp[i] == python, name
        assert python["peak_reserved_bytes"] > 0
    assert by_way["python"][3]["scenario"]["parallel"] == {"fsdp": 2}
    assert by_way["python"][4]["scenario"]["quantize"] == {"format": "nf4"}
    names = [tool.name for tool in tools.tools]
    assert names == ["predict", "fit", "explain", "replay", "tune", "diff", "doctor", "gpus"]
    predict_schema = tools.tools[0].input_schema
    assert predict_schema["title"] == "Scenario" and "lora" in predict_schema["properties"]
    assert bad.is_error
    assert bad.content[0].text == (
        "oomkit: error: the scenario: --batch (step.batch): must be at least 1; got 0"
    )


def test_list_tools_prints_each_schema(capsys):
    """`oomkit mcp --list-tools` prints each tool's name and its input schema."""
    assert main(["mcp", "--list-tools"]) == 0
    tools = json.loads(capsys.readouterr().out)["tools"]
    by_name = {t["name"]: t["input_schema"] for t in tools}
    assert by_name["predict"] == by_name["fit"] == oomkit.Scenario.model_json_schema()
    assert by_name["explain"]["required"] == ["input"]
    device = {"gpu", "capacity", "context_overhead"}  # the device, as the CLI's flags
    assert set(by_name["replay"]["properties"]) == {"snapshot", "verify", "what_if", *device}
    assert set(by_name["tune"]["properties"]) == {"source", *device}
    assert by_name["gpus"]["properties"] == {}
