"""``oomkit doctor [SNAPSHOT]``: the allocator settings actually in effect, and what misfires."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from oomkit.interfaces.cli._common import (
    add_alloc_conf_flag,
    add_json_flag,
    add_torch_version_flag,
    existing_file,
    print_json,
    stdout_console,
)

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "doctor",
        help="show which allocator settings are in effect (environment or snapshot)",
        description="Without SNAPSHOT: which of PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF / "
        "PYTORCH_HIP_ALLOC_CONF this torch reads, how it parses, and what the running allocator "
        "reports (on a GPU machine); with --alloc-conf STR, that value instead. With SNAPSHOT: "
        "the settings it recorded, else what its trace implies. Flags combinations that are "
        "ignored or do not do what they are set for. Exit code 1 when a setting is not applied "
        "(an error finding).",
    )
    parser.add_argument("snapshot", type=_snapshot_file, metavar="SNAPSHOT", nargs="?")
    add_alloc_conf_flag(
        parser,
        help="check this PYTORCH_CUDA_ALLOC_CONF value, as if the environment set it (no live "
        "allocator is asked), e.g. expandable_segments:True,max_split_size_mb:128",
    )
    add_torch_version_flag(
        parser, default="the installed torch's (SNAPSHOT: the file's), else the newest release"
    )
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="do not ask the running torch about its allocator (which initialises CUDA)",
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


# A setting's text (`expandable_segments:True,...`), not a path: a word, a colon, no separator.
_SETTING_LIKE = re.compile(r"^\s*[A-Za-z_]+\s*:[^/\\]*$")


def _snapshot_file(text: str) -> Path:
    """An existing snapshot file; an allocator setting given in its place is pointed to
    ``--alloc-conf``."""
    try:
        return existing_file(text)
    except argparse.ArgumentTypeError:
        if _SETTING_LIKE.match(text) and not Path(text).exists():
            raise argparse.ArgumentTypeError(
                f"{text!r} is an allocator setting, not a snapshot file: check it with "
                f"`oomkit doctor --alloc-conf {text!r}`"
            ) from None
        raise


def _installed_torch_version() -> str | None:
    """The installed torch's version, read from its ``torch/version.py`` (torch and the package
    metadata not imported: ``core.gpus.installed_torch``)."""
    from oomkit.core.gpus.installed_torch import installed_torch_version

    return installed_torch_version()


def run(args: argparse.Namespace) -> int:
    from oomkit.diagnose.settings_doctor import doctor_environment, doctor_snapshot
    from oomkit.interfaces.reports.doctor import render_settings_report, settings_report_to_json

    if args.snapshot is not None and args.alloc_conf is not None:
        from oomkit.errors import OomkitError

        raise OomkitError(
            "doctor checks a snapshot's recorded settings or one --alloc-conf, not both: drop one"
        )
    if args.snapshot is not None:
        from oomkit.core.snapshot import load_snapshot
        from oomkit.interfaces.cli._progress import progress_enabled, snapshot_progress

        with snapshot_progress(progress_enabled(args, sys.stderr), args.snapshot.name) as progress:
            snapshot = load_snapshot(args.snapshot, progress=progress.loading)
        report = doctor_snapshot(snapshot, args.torch_version)
    else:
        installed = _installed_torch_version()
        if args.torch_version:
            version, version_from = args.torch_version, "--torch-version"
        elif installed:
            version, version_from = installed, "installed torch"
        else:
            version, version_from = None, "newest release (no torch installed)"
        live = None
        environ: dict[str, str] = dict(os.environ)
        if args.alloc_conf is not None:
            # The setting as the variable torch reads first would carry it, and nothing else
            # of the environment's allocator variables (settings_from_environ's order).
            for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
                environ.pop(name, None)
            environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
        elif installed and not args.no_live and not args.torch_version:
            from oomkit.runtime.allocator_probe import read_live_allocator

            live = read_live_allocator()
        report = doctor_environment(environ, version, torch_version_from=version_from, live=live)
        if args.alloc_conf is not None:
            import dataclasses

            report = dataclasses.replace(report, source="--alloc-conf")
    if args.json:
        print_json(settings_report_to_json(report))
    else:
        render_settings_report(report, stdout_console())
    return 1 if report.worst == "error" else 0
