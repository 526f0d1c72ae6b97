"""Rendering of ``Diagnosis`` records: a JSON object and a terminal report, verdict first."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from oomkit.diagnose.diagnosis import Diagnosis, Remedy
from oomkit.interfaces.reports._untrusted import as_written, controls_shown
from oomkit.units import format_bytes

if TYPE_CHECKING:
    # Annotations only; rich is imported when something is rendered (`--json` never renders)
    # and attribution only comes with a snapshot (issue 19 item 4: start-up), the traceback's
    # location only with a text (issue 41 item 4).
    from rich.console import Console

    from oomkit.diagnose.attribution import Attribution
    from oomkit.diagnose.oom_text import OomText
    from oomkit.diagnose.oom_traceback import OomLocation

__all__ = [
    "REMEDIES_HEADING",
    "diagnosis_to_json",
    "location_line",
    "remedy_headline",
    "remedy_saving",
    "remedy_to_json",
    "render_diagnosis",
    "verdict_label",
]

_CAUSE_WORDS = {
    "shortage": "a real shortage of memory",
    "fragmentation": "fragmentation of PyTorch's cache",
    "outside_pytorch": "memory held outside PyTorch's allocator",
    "fraction_limit": "the per-process memory fraction",
    "request_exceeds_device": "one request larger than the device",
    "leak": "a leak",
    "transient_spike": "a short-lived spike",
}


def verdict_label(diagnosis: Diagnosis) -> str:
    """``Cause: fragmentation of PyTorch's cache``; a snapshot with no OOM says so first."""
    words = _CAUSE_WORDS[diagnosis.cause]
    moment = diagnosis.attribution.moment if diagnosis.attribution is not None else "oom"
    if diagnosis.source == "snapshot" and moment != "oom":
        if diagnosis.cause == "shortage" and diagnosis.causes[0].explained_bytes == 0:
            # Nothing stands out: the finding only states what its peak (or end) held.
            return "No OOM in this snapshot and no risk found"
        when = "its peak of allocated memory" if moment == "peak" else "its end"
        return f"No OOM in this snapshot; the main risk at {when}: {words}"
    return f"Cause: {words}"


def location_line(location: OomLocation) -> str:
    """``Where: loss.backward() at train.py:180, in the backward``."""
    phase = f", in the {location.phase}" if location.phase is not None else ""
    return f"Where: {location.label}{phase}"


# MeasuredRemedy's own fields (diagnose/measured_remedy.py), in its order.
_MEASURED_FIELDS = ("fits", "peak_reserved_bytes", "flag")


def remedy_to_json(remedy: Remedy) -> dict:
    """A remedy's fields, with ``fits`` (``None`` where it was not measured by re-predicting),
    ``peak_reserved_bytes`` (what the re-predicted step needs; ``None`` when not measured) and
    ``flag`` (the ``oomkit predict`` option that applies it, where one does)."""
    out = asdict(remedy)
    # A MeasuredRemedy has the three fields; a plain remedy gets them as None, in that order.
    # (Read by name: a snapshot's or a text's remedies never import the measured kind.)
    for key in _MEASURED_FIELDS:
        out.setdefault(key, None)
    return out


def diagnosis_to_json(diagnosis: Diagnosis, parsed: OomText | None = None) -> dict:
    """The diagnosis as one JSON-ready object (``oomkit explain --json``)."""
    out: dict = {
        "cause": diagnosis.cause,
        "causes": [
            {
                "cause": f.cause,
                "explained_bytes": f.explained_bytes,
                "summary": f.summary,
                "evidence": dict(f.evidence_bytes),
            }
            for f in diagnosis.causes
        ],
        "remedies": [remedy_to_json(r) for r in diagnosis.remedies],
        "deficit_bytes": diagnosis.deficit_bytes,
        "memory_explained": diagnosis.memory_explained,
        "warnings": list(diagnosis.warnings),
        "source": diagnosis.source,
        "figures": dict(diagnosis.figures_bytes),
        "attribution": _attribution_json(diagnosis.attribution),
        "location": None if diagnosis.location is None else asdict(diagnosis.location),
        "gpu": diagnosis.gpu_name,
    }
    if parsed is not None:
        out["message"] = {
            "variant": parsed.variant,
            "torch_versions": parsed.torch_versions,
            "device": parsed.device,
            "requested_bytes": parsed.requested_bytes,
            "total_bytes": parsed.total_bytes,
            "free_bytes": parsed.free_bytes,
            "allocated_bytes": parsed.allocated_bytes,
            "reserved_bytes": parsed.reserved_bytes,
            "private_pool_bytes": parsed.private_pool_bytes,
            "allowed_bytes": parsed.allowed_bytes,
            "processes": [asdict(p) for p in parsed.processes],
        }
    return out


def _attribution_json(attribution: Attribution | None) -> dict | None:
    if attribution is None:
        return None
    out = asdict(attribution)
    out["by_category_bytes"] = dict(attribution.by_category_bytes)
    for site, data in zip(attribution.top_sites, out["top_sites"], strict=True):
        data["label"] = site.label
    return out


# Remedy.rank_key: the ones that lower this process's peak first, then by bytes saved.
REMEDIES_HEADING = "Remedies: what lowers the peak first, then by bytes saved"


def remedy_saving(remedy: Remedy) -> str:
    """``saves ~1.50 GiB``, ``frees 7.17 GiB; this process's peak stays``, ``saves nothing``."""
    nbytes = remedy.saving_bytes
    if nbytes == 0:
        return "saves nothing"  # advice against a change, such as relying on empty_cache()
    amount = (
        "unknown" if nbytes is None else ("~" if remedy.estimate else "") + format_bytes(nbytes)
    )
    if not remedy.lowers_peak:
        return f"frees {amount}; this process's peak stays"
    return f"saves {amount}"


def remedy_headline(number: int, remedy: Remedy) -> str:
    """``1. expandable segments — saves 1.53 GiB (medium confidence)``."""
    fits = ""
    measured_fits = getattr(remedy, "fits", None)  # a MeasuredRemedy's, when it was measured
    if measured_fits is not None:
        fits = ", fits" if measured_fits else ", still does not fit"
    return (
        f"{number}. {remedy.title} — {remedy_saving(remedy)}{fits} "
        f"({remedy.confidence} confidence)"
    )


def render_diagnosis(diagnosis: Diagnosis, console: Console) -> None:
    """Print the verdict, the causes with their evidence, the remedies and the memory paragraph."""
    from rich.table import Table

    top = diagnosis.causes[0]
    console.print(f"[bold]{verdict_label(diagnosis)}[/bold] — {as_written(top.summary)}.")
    if diagnosis.location is not None:
        console.print(as_written(location_line(diagnosis.location)))
    if len(diagnosis.causes) > 1:
        causes = Table(title="Every cause that applies, strongest first", title_justify="left")
        causes.add_column("cause")
        causes.add_column("evidence")
        for finding in diagnosis.causes:
            causes.add_row(finding.cause, as_written(finding.summary))
        console.print(causes)
    if diagnosis.remedies:
        # A list, not a table: code must stay whole so that it can be copied.
        console.print(f"[bold]{REMEDIES_HEADING}[/bold]")
        for i, remedy in enumerate(diagnosis.remedies, 1):
            console.print(remedy_headline(i, remedy))
            console.print(f"   [dim]{as_written(remedy.why)}[/dim]")
            # The code may quote the input (the script a traceback names): shown as written.
            for line in controls_shown(remedy.code).splitlines():
                console.print(f"     {line}", markup=False, highlight=False, soft_wrap=True)
    if diagnosis.attribution is not None:
        _render_attribution(diagnosis.attribution, console)
    if diagnosis.memory_explained:
        console.print(diagnosis.memory_explained)
    if diagnosis.gpu_name is not None and diagnosis.source == "text":
        console.print(f"GPU: {diagnosis.gpu_name}, matched by the message's total memory")
    for warning in diagnosis.warnings:
        console.print(f"[yellow]warning:[/yellow] {as_written(warning)}")


_MOMENT_WORDS = {
    "oom": "at the OOM",
    "peak": "at the peak of allocated memory",
    "final": "at the end",
}


def _short_site(label: str) -> str:
    """``…/models/net.py:60 in update``: a narrow terminal keeps the file and line, not the root.

    Right-side truncation would cut the line number, the part a user needs; JSON keeps the
    full path.
    """
    path, sep, rest = label.partition(":")
    parts = path.split("/")
    if not sep or len(parts) <= 3:
        return label
    return "…/" + "/".join(parts[-2:]) + sep + rest


def _render_attribution(attribution: Attribution, console: Console) -> None:
    """Tables of what was live: by category, by allocation site, the largest tensors."""
    from rich.table import Table

    when = _MOMENT_WORDS.get(attribution.moment, attribution.moment)
    if attribution.by_category_bytes:
        table = Table(title=f"Memory {when} by category", title_justify="left")
        table.add_column("category")
        table.add_column("bytes", justify="right")
        for category, nbytes in attribution.by_category_bytes.items():
            table.add_row(category, format_bytes(nbytes))
        console.print(table)
    if attribution.top_sites:
        table = Table(title=f"Top allocation sites {when}", title_justify="left")
        table.add_column("site")
        table.add_column("live", justify="right")
        table.add_column("tensors", justify="right")
        for site in attribution.top_sites:
            table.add_row(
                as_written(_short_site(site.label)), format_bytes(site.live_bytes), str(site.count)
            )
        console.print(table)
    if attribution.largest_tensors:
        table = Table(title=f"Largest live tensors {when}", title_justify="left")
        table.add_column("size", justify="right")
        table.add_column("allocated at")
        for tensor in attribution.largest_tensors:
            table.add_row(format_bytes(tensor.size_bytes), as_written(_short_site(tensor.site)))
        console.print(table)
