"""``oomkit explain``: the cause of a CUDA out-of-memory error and what to change."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from oomkit._lazy import LazyPattern
from oomkit.errors import ConfigError, OomTextError
from oomkit.interfaces.cli._common import (
    add_alloc_conf_flag,
    add_gpu_flag,
    add_json_flag,
    print_json,
    stdout_console,
    target_from_args,
)
from oomkit.interfaces.cli._progress import (
    is_terminal,
    progress_bar,
    progress_enabled,
    snapshot_progress,
)

__all__ = ["add_parser", "run"]



def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "explain",
        help="explain an OOM error: its cause, the evidence and ranked remedies",
        description="Explain a CUDA out-of-memory error: pass its text, a file holding it (a log "
        "or traceback is fine), '-' (the default) to read stdin, a memory snapshot (ideally "
        "dumped in the except handler of torch.OutOfMemoryError), or a saved prediction "
        "(`oomkit predict ... --json > p.json`). Works without torch. Exit 0 after a diagnosis, "
        "2 when no OOM message is found or the file cannot be read.",
    )
    parser.add_argument(
        "source",
        nargs="?",
        default="-",
        metavar="TEXT|FILE|-",
        help="the error text, a file holding it, a snapshot, a prediction JSON, or - for stdin",
    )
    add_gpu_flag(
        parser,
        default=None,
        help="the GPU it ran on (a catalog name, or its total memory such as 24GiB), for its "
        "total memory and CUDA-context figure (default: matched by total memory; snapshots do "
        "not record it)",
    )
    parser.add_argument(
        "--device",
        type=int,
        metavar="N",
        help="snapshot device to explain (default: the one with an OOM, else the first)",
    )
    parser.add_argument(
        "--memory-fraction",
        type=float,
        metavar="F",
        help="snapshot: the set_per_process_memory_fraction in effect (snapshots do not record it)",
    )
    add_alloc_conf_flag(
        parser,
        help="the PYTORCH_CUDA_ALLOC_CONF the failing run used, for a pasted message (a snapshot "
        "records its own): with expandable_segments:True on, explain says so instead of "
        "repeating PyTorch's advice to turn it on",
    )
    parser.add_argument(
        "--no-measure",
        dest="measure",
        action="store_false",
        help="saved prediction of a preset or a script: estimate model changes (mixed "
        "precision, checkpointing, optimizer, batch) instead of measuring each by re-predicting "
        "(a script: its batch argument halved, run again) (faster)",
    )
    from oomkit.interfaces.cli.fleet import add_fleet_flags

    add_fleet_flags(parser)  # a directory of per-rank snapshots: one report across the ranks
    add_json_flag(parser)
    parser.add_argument(
        "--html",
        metavar="FILE",
        help="also write a self-contained HTML report (with a memory timeline and a segment "
        "map for snapshots)",
    )
    parser.set_defaults(run=run)
    return parser


# What explain says on a terminal before it waits for pasted text (issue 16 item 13).
STDIN_PROMPT = (
    "oomkit explain: paste the CUDA out-of-memory error (the whole traceback is fine), then press "
    "Ctrl-D on a new line (Ctrl-Z then Enter on Windows). Or pass a file: oomkit explain "
    "error.log"
)


def _read_stdin(stdin: IO[str], stderr: IO[str]) -> str:
    """Stdin's text; on a terminal, first says on stderr what it waits for."""
    if is_terminal(stdin):
        print(STDIN_PROMPT, file=stderr, flush=True)
    raw = getattr(stdin, "buffer", None)
    if raw is not None:
        from oomkit.diagnose.oom_text import decode_log

        # Bytes, decoded leniently: a log with non-UTF-8 bytes is still a log, and a UTF-16
        # one (PowerShell's redirect) is read as UTF-16.
        return decode_log(raw.read())
    return stdin.read()


def _looks_like_path(source: str) -> bool:
    """An argument without whitespace is a file name: every OOM message has spaces."""
    return bool(source) and len(source) < 4096 and not any(c.isspace() for c in source)


def _is_directory(source: str) -> bool:
    try:
        return len(source) < 4096 and Path(source).is_dir()
    except (OSError, ValueError):
        return False


def _read_source(source: str) -> str | Path:
    """The text to explain, or the path of a snapshot (a pickle) to load.

    Raises:
        OomTextError: the argument names a file that does not exist, or a directory.
    """
    if source == "-":
        return _read_stdin(sys.stdin, sys.stderr)
    from oomkit._files import input_file_error, not_a_file_reason

    path = Path(source)
    if _is_directory(source):
        raise OomTextError(
            f"{source}: is a directory, not a file. Pass the log, snapshot or prediction file "
            "inside it, e.g. oomkit explain logs/train.log"
        )
    what = not_a_file_reason(source)  # a long pasted message is no file either
    if what is not None:
        if _looks_like_path(source):
            raise OomTextError(
                f"{source}: {what}. Pass an existing log, snapshot (.pickle) or prediction "
                "(.json), the error text in quotes, or - to read it from stdin"
            )
        return source
    from oomkit.core.snapshot import looks_like_pickle

    try:
        with path.open("rb") as head:
            magic = head.read(8)
        if looks_like_pickle(magic):  # a snapshot in any pickle protocol, not error text
            return path
        from oomkit.diagnose.oom_text import decode_log

        return decode_log(path.read_bytes())
    except OSError as exc:
        raise input_file_error(path, exc) from None


def _as_json(text: str) -> object | None:
    """The JSON value of a text that is one JSON object, else None (then it is error text)."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # nested past the recursion limit: not a prediction
        return None


def run(args: argparse.Namespace) -> int:
    if args.source != "-" and _is_directory(args.source):
        from oomkit.interfaces.cli import fleet

        return fleet.run_explain(args, args.source)
    from oomkit.diagnose.diagnosis import diagnose_oom_text
    from oomkit.diagnose.oom_text import find_oom_texts, parse_oom_text
    from oomkit.interfaces.reports.diagnosis import diagnosis_to_json, render_diagnosis

    gpu = None
    if args.gpu is not None:
        gpu = target_from_args(args).gpu  # the one target path, as replay and predict
    if args.memory_fraction is not None and not 0.0 < args.memory_fraction <= 1.0:
        raise ConfigError(
            f"--memory-fraction must be in (0, 1]; got {args.memory_fraction}. Example: "
            "--memory-fraction 0.5"
        )
    if args.html is not None:
        from oomkit._files import check_output_path

        # Before any work: the page may not overwrite the file being explained.
        inputs = [] if args.source == "-" else [args.source]
        check_output_path(args.html, inputs=inputs, flag="--html")
    source = _read_source(args.source)
    data = None if isinstance(source, Path) else _as_json(source)
    if args.alloc_conf is not None and (isinstance(source, Path) or isinstance(data, Mapping)):
        raise ConfigError(
            "--alloc-conf describes the run behind a pasted message; a snapshot records its own "
            "settings and a prediction names its own (drop --alloc-conf)"
        )
    parsed = snapshot = None
    prediction: Mapping[str, Any] | None = None
    if isinstance(source, Path):
        from oomkit.core.snapshot import load_snapshot
        from oomkit.diagnose.snapshot_diagnosis import diagnose_snapshot
        with snapshot_progress(progress_enabled(args, sys.stderr), source.name) as progress:
            snapshot = load_snapshot(source, progress=progress.loading)
            progress.phase("diagnosing (replaying the trace)")
            diagnosis = diagnose_snapshot(
                snapshot,
                device=args.device,
                gpu=gpu,
                memory_fraction=args.memory_fraction,
            )
    elif isinstance(data, Mapping):
        from oomkit.diagnose.prediction_diagnosis import diagnose_prediction

        prediction = data
        show = args.measure and progress_enabled(args, sys.stderr)
        with progress_bar(show, "measuring remedies by re-predicting") as progress:
            if isinstance(data.get("scenario"), Mapping):
                # A save that carries its request: re-predicted, and the fresh record diagnosed
                # (its report's fields are not read). The user's prints go to stderr.
                from oomkit.interfaces.cli._common import user_output_to_stderr
                from oomkit.scenario.explaining import explain_saved

                with user_output_to_stderr():
                    diagnosis = explain_saved(data, measure=args.measure, progress=progress)
            else:  # saved before predictions carried their scenario
                diagnosis = diagnose_prediction(data, measure=args.measure, progress=progress)
    else:
        from oomkit.diagnose.oom_traceback import find_oom_location

        serving = _serving_log(source, args)
        found = find_oom_texts(source)
        if serving is not None and not found:  # a vLLM / SGLang log: answered with the knob
            return serving
        parsed = found[0] if found else parse_oom_text(source)  # raises: none found
        expandable = None
        if args.alloc_conf is not None:
            from oomkit.core.allocator import AllocatorConfig

            expandable = AllocatorConfig.parse(args.alloc_conf).expandable_segments
        diagnosis = diagnose_oom_text(
            parsed, gpu, expandable_segments=expandable, location=find_oom_location(source)
        )
        if len(found) > 1:
            devices = sorted({str(m.device) for m in found if m.device is not None})
            diagnosis = dataclasses.replace(
                diagnosis,
                warnings=(
                    *diagnosis.warnings,
                    f"the text holds {len(found)} out-of-memory messages"
                    + (f" (devices {', '.join(devices)})" if devices else "")
                    + "; this explains the first. Pass one message (or one rank's log) to "
                    "explain another",
                ),
            )
    if args.html is not None:
        from oomkit.interfaces.reports.diagnosis_html import write_diagnosis_html

        write_diagnosis_html(
            args.html,
            diagnosis,
            snapshot=snapshot,
            device=args.device,
            source=args.source,
            prediction=prediction,
        )
    if args.json:
        print_json(diagnosis_to_json(diagnosis, parsed))
    else:
        render_diagnosis(diagnosis, stdout_console())
    return 0


# Words every vLLM or SGLang log or memory error the serving diagnosis reads has at least one of
# (searched in place: a 50 MB log is not lower-cased into a copy).
_ENGINE_WORDS = LazyPattern(
    r"vllm|sglang|kv cache|cache blocks|mem_fraction_static|gpu_memory_utilization|"
    r"not enough memory",
    re.IGNORECASE,
)


def _serving_log(source: str, args: argparse.Namespace) -> int | None:
    """A vLLM or SGLang start-up log or OOM: printed with the knob to turn; its exit code (1 when
    the engine failed), or ``None`` for text that is no such log."""
    if _ENGINE_WORDS.search(source) is None:  # no engine log: nothing imported, nothing copied
        return None
    from oomkit.diagnose.serving_logs import diagnose_serving_log
    from oomkit.interfaces.reports.serving import render_serving_log, serving_log_to_json

    serving = diagnose_serving_log(source)
    if serving is None or (serving.failure is None and not serving.figures):
        return None
    if args.json:
        print_json({"serving": serving_log_to_json(serving)})
    else:
        render_serving_log(serving, stdout_console())
    return 1 if serving.failure is not None else 0
