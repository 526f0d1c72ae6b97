"""``oomkit mcp``: predict, fit, explain, replay, tune, diff, doctor and gpus as MCP tools.

An agent (Claude, an IDE) talks to this server over stdio with the official MCP Python SDK
(``pip install 'oomkit[mcp]'``). Each tool's input schema is JSON Schema: ``predict`` and
``fit`` take the ``Scenario``'s own (``oomkit.scenario``), the others a small record of their
command's arguments. Each tool runs the command itself with ``--json`` (predict and fit with
the scenario as their ``--config``), so its result is, byte for byte, the JSON the command
prints; a command that exits 2 (bad input) is a tool error carrying its one-line message.
``oomkit mcp --list-tools`` prints each tool's name and input schema without serving.

A call never ends the server: its arguments are checked against the tool's schema first (the
SDK does not), a command line built from them cannot hold an option an agent slipped into a
value (each value is ``--flag=VALUE`` or follows ``--``; ``explain``'s ``-``, "read stdin",
would read the protocol's own stream and is refused), the command's ``SystemExit`` (argparse's
usage errors) is its exit code, and calls run one at a time (each redirects this process's
``sys.stdout`` while it runs).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from oomkit.errors import TorchRequiredError
from oomkit.interfaces.cli._common import print_json

__all__ = ["TOOLS", "McpTool", "add_parser", "call_tool", "run", "tool_schemas"]


@dataclass(frozen=True)
class McpTool:
    """One tool: its name, what it answers, its input schema and the command line it runs.

    Attributes:
        name: the tool's name (the command's).
        description: what it answers, for the agent.
        schema: a callable returning its input JSON Schema (imports pydantic when called).
        argv: the tool's arguments -> the command line, ``--json`` included.
        check: the arguments -> an error message, or None when they fit the schema (predict
            and fit: None, their scenario is checked by the command itself).
    """

    name: str
    description: str
    schema: Callable[[], dict[str, Any]]
    argv: Callable[[dict[str, Any]], list[str]]
    check: Callable[[dict[str, Any]], str | None] | None = None


def _scenario_schema() -> dict[str, Any]:
    from oomkit.scenario import Scenario

    return Scenario.model_json_schema()


class _Arguments:
    """A tool's arguments, ``{name: (type, default, description)}``: their JSON Schema, and the
    check of a call's arguments against it (a pydantic model, built when first needed)."""

    def __init__(self, fields: dict[str, tuple[Any, Any, str]], required: Sequence[str] = ()):
        self._fields, self._required = fields, tuple(required)
        self._model: Any = None

    def _built(self) -> Any:
        if self._model is None:
            from pydantic import ConfigDict, Field, create_model

            spec: dict[str, Any] = {
                name: (kind, Field(... if name in self._required else default, description=text))
                for name, (kind, default, text) in self._fields.items()
            }
            config = ConfigDict(extra="forbid", strict=True)  # a number is no path
            self._model = create_model("Arguments", __config__=config, **spec)
        return self._model

    def schema(self) -> dict[str, Any]:
        return dict(self._built().model_json_schema())

    def check(self, arguments: dict[str, Any]) -> str | None:
        from pydantic import ValidationError

        try:
            self._built().model_validate(arguments)
        except ValidationError as exc:
            return "; ".join(
                f"{'.'.join(str(part) for part in error['loc']) or 'arguments'}: {error['msg']}"
                for error in exc.errors(include_url=False)
            )
        return None


def _scenario_argv(command: str) -> Callable[[dict[str, Any]], list[str]]:
    """``predict`` / ``fit``: the scenario written to a file, run as ``--config FILE --json``
    (the file is removed by ``call_tool``)."""

    def argv(arguments: dict[str, Any]) -> list[str]:
        handle, path = tempfile.mkstemp(prefix="oomkit-mcp-", suffix=".json")
        with os.fdopen(handle, "w") as file:
            json.dump(arguments, file)
        return [command, "--config", path, "--json"]

    return argv


def _flags(arguments: dict[str, Any], names: dict[str, str]) -> list[str]:
    """``--flag=value`` for each argument given (one word: a value cannot be read as an option);
    a true boolean is the flag alone."""
    out: list[str] = []
    for key, flag in names.items():
        value = arguments.get(key)
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            out += [f"{flag}={item}" for item in value]
        else:
            out.append(f"{flag}={value}")
    return out


def _explain_check(arguments: dict[str, Any]) -> str | None:
    if arguments.get("input") == "-":  # stdin is the protocol's stream here
        return "input: give the OOM text itself or a file's path; '-' (stdin) is the MCP stream"
    return _EXPLAIN.check(arguments)


_GPU: tuple[Any, Any, str] = (str | None, None, "a catalog GPU (e.g. rtx4090) or a size (24GiB)")
# replay and tune: the device as predict's target.gpu, or the allocator's own limit.
_DEVICE: dict[str, tuple[Any, Any, str]] = {
    "gpu": (
        str | None,
        None,
        "the device, a catalog GPU (e.g. rtx4090) or a size (24GiB): the allocator may reserve "
        "its total less the CUDA context, as predict; not with capacity",
    ),
    "capacity": (
        str | None,
        None,
        "the allocator's own limit (e.g. 24GiB), nothing subtracted; not with gpu",
    ),
    "context_overhead": (
        str | None,
        None,
        "memory outside PyTorch on the gpu (default: its CUDA context); 0: the whole total",
    ),
}
_DEVICE_FLAGS = {"gpu": "--gpu", "capacity": "--capacity", "context_overhead": "--context-overhead"}

_EXPLAIN = _Arguments(
    {
        "input": (str, None, "the OOM text itself, or the path of a snapshot or JSON"),
        "gpu": _GPU,
        "measure": (bool, True, "re-predict to measure remedies (saved predictions)"),
    },
    required=("input",),
)
_REPLAY = _Arguments(
    {
        "snapshot": (str, None, "the snapshot file (torch.cuda.memory._dump_snapshot)"),
        "verify": (bool, False, "compare every recorded decision with the simulator's"),
        "what_if": (list[str] | None, None, "allocator settings to compare"),
        **_DEVICE,
    },
    required=("snapshot",),
)
_TUNE = _Arguments(
    {"source": (str, None, "a snapshot or oomkit trace file"), **_DEVICE}, required=("source",)
)
_DIFF = _Arguments(
    {"a": (str, None, "the first run's file"), "b": (str, None, "the second's")},
    required=("a", "b"),
)
_DOCTOR = _Arguments(
    {
        "snapshot": (str | None, None, "a snapshot file (optional)"),
        "alloc_conf": (
            str | None,
            None,
            "a PYTORCH_CUDA_ALLOC_CONF value to check instead of the environment (optional)",
        ),
    }
)
_GPUS = _Arguments({})

TOOLS: tuple[McpTool, ...] = (
    McpTool(
        "predict",
        "Predict a training or inference step's peak GPU memory on a named GPU without a GPU "
        "(the Scenario: model, step, lora, quantize, target, parallel, run).",
        _scenario_schema,
        _scenario_argv("predict"),
    ),
    McpTool(
        "fit",
        "Find the largest batch that fits on a GPU (or the smallest GPU a batch fits on), "
        "without a GPU; the Scenario's search section shapes the question.",
        _scenario_schema,
        _scenario_argv("fit"),
    ),
    McpTool(
        "explain",
        "Explain a CUDA out-of-memory error: its cause, the evidence and ranked remedies, from "
        "the error text, a snapshot file or a saved prediction (predict --json).",
        _EXPLAIN.schema,
        lambda a: [
            "explain", "--json",
            *_flags(a, {"gpu": "--gpu"}), *([] if a.get("measure", True) else ["--no-measure"]),
            "--", str(a["input"]),
        ],
        _explain_check,
    ),
    McpTool(
        "replay",
        "Replay a PyTorch memory snapshot through the simulated caching allocator; verify it "
        "decision for decision, or ask what-if under other PYTORCH_CUDA_ALLOC_CONF settings.",
        _REPLAY.schema,
        lambda a: [
            "replay", "--json",
            *_flags(a, {"verify": "--verify", "what_if": "--what-if", **_DEVICE_FLAGS}),
            "--", str(a["snapshot"]),
        ],
        _REPLAY.check,
    ),
    McpTool(
        "tune",
        "Find the PYTORCH_CUDA_ALLOC_CONF that reserves least for a snapshot or trace.",
        _TUNE.schema,
        lambda a: ["tune", "--json", *_flags(a, _DEVICE_FLAGS), "--", str(a["source"])],
        _TUNE.check,
    ),
    McpTool(
        "diff",
        "Split the change in peak memory between two runs (snapshots, saved predictions or "
        "monitor logs) into allocated and placement.",
        _DIFF.schema,
        lambda a: ["diff", "--json", "--", str(a["a"]), str(a["b"])],
        _DIFF.check,
    ),
    McpTool(
        "doctor",
        "Show which allocator settings are in effect, from a snapshot (or this environment, "
        "or a PYTORCH_CUDA_ALLOC_CONF value given), and what misfires.",
        _DOCTOR.schema,
        lambda a: [
            "doctor", "--json", *_flags(a, {"alloc_conf": "--alloc-conf"}),
            *(["--", str(a["snapshot"])] if a.get("snapshot") else []),
        ],
        _DOCTOR.check,
    ),
    McpTool(
        "gpus",
        "List the GPUs predict and fit can name, with their memory and CUDA context.",
        _GPUS.schema,
        lambda a: ["gpus", "--json"],
        _GPUS.check,
    ),
)
_BY_NAME = {tool.name: tool for tool in TOOLS}


def tool_schemas() -> list[dict[str, Any]]:
    """Each tool's name, description and input schema (``--list-tools``)."""
    return [
        {"name": t.name, "description": t.description, "input_schema": t.schema()} for t in TOOLS
    ]


# One call at a time: each redirects this process's sys.stdout and sys.stderr while it runs.
_ONE_CALL = threading.Lock()


def call_tool(name: str, arguments: dict[str, Any]) -> tuple[int, str, str]:
    """Run tool ``name`` as its command with ``--json``, in this process.

    Returns:
        (exit code, what it printed on stdout, on stderr): exit 2 and the reason for arguments
        that do not fit the tool's schema.

    Raises:
        KeyError: no such tool.
    """
    from oomkit.interfaces.cli import main

    tool = _BY_NAME[name]
    problem = tool.check(dict(arguments)) if tool.check is not None else None
    if problem is not None:
        return 2, "", f"oomkit: error: {name}: {problem}\n"
    argv = tool.argv(dict(arguments))
    out, err = io.StringIO(), io.StringIO()
    try:
        with _ONE_CALL, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's usage errors: the command's exit code
                code = exc.code if isinstance(exc.code, int) else 2
                # The usage text argparse prints first is for a terminal; the error is its last line.
                lines = err.getvalue().strip().splitlines()
                err = io.StringIO(lines[-1] + "\n" if lines else "")
    finally:
        if "--config" in argv:  # the scenario file written for predict / fit
            with contextlib.suppress(OSError):
                os.unlink(argv[argv.index("--config") + 1])
    said = err.getvalue()
    if "--config" in argv:  # errors name the scenario, not the file written for it
        said = said.replace(f"{argv[argv.index('--config') + 1]}: ", "the scenario: ")
    return code, out.getvalue(), said


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "mcp",
        help="serve predict, fit, explain, replay, tune, diff, doctor and gpus as MCP tools",
        description="Serve oomkit's commands as Model Context Protocol tools over stdio, for an "
        "agent; each tool returns the JSON its command prints with --json. Needs the MCP SDK: "
        "pip install 'oomkit[mcp]'.",
    )
    parser.add_argument(
        "--list-tools", action="store_true", help="print each tool's name and input schema, and exit"
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.list_tools:
        print_json({"tools": tool_schemas()})
        return 0
    try:
        import anyio
        import mcp.types  # noqa: F401
        from mcp.server.lowlevel import Server  # noqa: F401
    except ImportError as exc:
        raise TorchRequiredError(
            "oomkit mcp serves the tools with the MCP Python SDK, which is not installed: "
            "pip install 'oomkit[mcp]'"
        ) from exc
    anyio.run(_serve)
    return 0


async def _serve() -> None:
    """The stdio server: lists the tools and runs each call as its command."""
    import anyio
    from mcp import types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    from oomkit._version import __version__

    async def list_tools(_ctx: Any, _params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(name=t["name"], description=t["description"], input_schema=t["input_schema"])
                for t in tool_schemas()
            ]
        )

    async def call(_ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name not in _BY_NAME:
            return _error(f"no tool {params.name!r}; the tools: {', '.join(_BY_NAME)}")
        # The commands are synchronous and may take a while: off the event loop.
        code, out, err = await anyio.to_thread.run_sync(
            call_tool, params.name, dict(params.arguments or {})
        )
        if code == 2 or not out.strip():
            return _error(err.strip() or f"oomkit {params.name} exited {code}")
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=out)],
            structured_content=json.loads(out),
            is_error=False,
        )

    server: Any = Server(
        "oomkit", version=__version__, on_list_tools=list_tools, on_call_tool=call
    )
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def _error(message: str) -> Any:
    from mcp import types

    return types.CallToolResult(
        content=[types.TextContent(type="text", text=message)], is_error=True
    )

