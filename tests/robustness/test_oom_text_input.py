"""Hostile OOM text for `oomkit explain`: huge coloured logs, CRLF, bad bytes, markup (issue 16),
absurd and self-contradicting figures, UTF-16 logs (issue 36)."""

from __future__ import annotations

import io
import json
import sys
import time
import tracemalloc

from _cli_bounds import CliResult
from _cli_in_process import run_in_process
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from oomkit.diagnose.oom_text import find_oom_texts, parse_oom_text
from oomkit.interfaces.cli import main

MiB = 2**20
LOG_BYTES = 50 * MiB

# A fragmented 2.2+ message (a 2.30 GiB cache covers 1.70 GiB), coloured as a terminal log shows.
FRAGMENTED = (
    "\x1b[1;31mtorch.OutOfMemoryError\x1b[0m: CUDA out of memory. Tried to allocate "
    "\x1b[33m1.70 GiB\x1b[0m. GPU 0 has a total capacity of 6.00 GiB of which 0 bytes is free. "
    "Of the allocated memory 2.93 GiB is allocated by PyTorch, and 2.30 GiB is reserved by "
    "PyTorch but unallocated."
)
# A second rank's plain shortage.
SHORTAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 1 has a total "
    "capacity of 4.00 GiB of which 0 bytes is free. Of the allocated memory 3.50 GiB is allocated"
    " by PyTorch, and 10.00 MiB is reserved by PyTorch but unallocated."
)


def _noise_line(i: int) -> bytes:
    """One log line: ANSI colours, a progress bar, bytes that are not UTF-8, CRLF."""
    return (
        f"\x1b[32m[2026-11-26 08:00:{i % 60:02d}]\x1b[0m step {i} loss=0.{i % 997:03d} "
        "\x1b[2K\r|\u2588\u2588\u2588\u2591\u2591| [bold]not markup[/bold] ".encode()
        + b"\xff\xfe\xc3(\x80 "
        + b"x" * 40
        + b"\r\n"
    )


def _log(tmp_path, messages: list[str]):
    """A ~50 MB log with the messages at its start, middle and end."""
    block = b"".join(_noise_line(i) for i in range(1000))
    repeats = LOG_BYTES // len(block)
    parts = [block] * repeats
    for position, message in zip((1, repeats // 2, repeats - 1), messages, strict=False):
        parts.insert(position, message.replace(". ", ".\r\n", 2).encode() + b"\r\n")
    path = tmp_path / "train.log"
    path.write_bytes(b"".join(parts))
    assert path.stat().st_size >= 49 * MiB
    return path


def _bounded(call):
    """Run ``call`` and return (its result, seconds, peak bytes Python allocated)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        result = call()
    finally:
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, seconds, peak


def test_a_50_mb_coloured_crlf_log_with_bad_bytes_and_three_ooms(tmp_path, capsys):
    """The first OOM is explained, the others counted, in bounded time and memory."""
    path = _log(tmp_path, [FRAGMENTED, SHORTAGE, SHORTAGE])
    code, seconds, peak = _bounded(lambda: main(["explain", str(path), "--json"]))
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cause"] == "fragmentation"
    assert out["message"]["device"] == 0
    assert any("holds 3 out-of-memory messages (devices 0, 1)" in w for w in out["warnings"])
    assert seconds < 60
    assert peak < 8 * LOG_BYTES  # a few copies of the text, not one object per word


def test_a_50_mb_log_without_an_oom_is_exit_2(tmp_path, capsys):
    """No message in 50 MB: exit 2 and one line, in bounded time and memory."""
    path = _log(tmp_path, [])
    code, seconds, peak = _bounded(lambda: main(["explain", str(path)]))
    assert code == 2
    err = capsys.readouterr().err
    assert "no CUDA out-of-memory message found" in err
    assert len(err.splitlines()) == 1
    assert seconds < 60
    assert peak < 8 * LOG_BYTES


def test_escapes_and_markup_in_the_input_are_printed_as_written(capsys):
    """Text without an OOM: the error quotes it with escapes visible and markup literal."""
    hostile = "\x1b]0;pwned\x07\x1b[2J[bold red]boom[/bold red] [link=file:///etc]x[/link]"
    assert main(["explain", hostile]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err  # no escape reaches the terminal
    assert "\\x1b[2J" in err  # it is shown as written
    assert "[bold red]boom[/bold red]" in err  # markup is not interpreted


def test_a_coloured_message_reads_as_plain(capsys):
    """ANSI colours inside the figures do not hide them; the report holds no escape."""
    parsed = parse_oom_text(FRAGMENTED)
    assert parsed.requested_bytes == round(1.70 * 2**30)
    assert main(["explain", FRAGMENTED]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Cause: fragmentation")
    assert "\x1b" not in out


def test_non_utf8_stdin_is_read_leniently(monkeypatch, capsys):
    """Piped bytes that are not UTF-8 around a message: explained, not a UnicodeDecodeError."""
    data = b"\xff\xfe garbage \x80\r\n" + SHORTAGE.encode() + b"\r\n\xc3("
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert main(["explain", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cause"] == "shortage"


def test_crlf_and_comment_prefixes_split_a_message():
    """A message broken by CRLF and quoted with '> ' in an issue still parses once."""
    quoted = "\r\n".join("> " + part for part in SHORTAGE.split(". "))
    assert [m.device for m in find_oom_texts(quoted.replace("\r\n> ", ". \r\n> "))] == [1]


# --- issue 36: absurd figures, self-contradicting figures, UTF-16 logs ------------------------
# Each case runs `python -m oomkit explain FILE` the way a user or a script would, with a time
# limit, and asserts the exit code and a one-line answer without a traceback.

_FIGURES = ("requested", "total", "free", "allocated", "cached")


def _message(**figures: str) -> str:
    values = {
        "requested": "20.00 MiB",
        "total": "79.11 GiB",
        "free": "0 bytes",
        "allocated": "70.00 GiB",
        "cached": "20.00 MiB",
    } | figures
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {values['requested']}. "
        f"GPU 0 has a total capacity of {values['total']} of which {values['free']} is free. "
        f"Of the allocated memory {values['allocated']} is allocated by PyTorch, and "
        f"{values['cached']} is reserved by PyTorch but unallocated."
    )


def _explain(path) -> CliResult:
    """``oomkit explain PATH``'s exit code and output, run in this process (these tests check
    what explain prints and its exit code, not the process boundary: a child process costs an
    interpreter start and oomkit's imports for each hypothesis example)."""
    return run_in_process(["explain", str(path)], environ={"NO_COLOR": "1", "COLUMNS": "200"})


def _refused(proc: CliResult, words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert words in proc.stderr


_SIX_EXAMPLES = settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_SIX_EXAMPLES
@given(
    figure=st.sampled_from(_FIGURES),
    digits=st.integers(min_value=25, max_value=5000),
    unit=st.sampled_from(["bytes", "KiB", "MiB", "GiB"]),
    decimals=st.booleans(),
)
def test_a_figure_beyond_2_to_the_64_is_exit_2(tmp_path, figure, digits, unit, decimals):
    """A 25- to 5000-digit figure anywhere in the message: exit 2, one line naming it."""
    number = "9" * digits + (".00" if decimals else "")
    path = tmp_path / "oom.log"
    path.write_text(_message(**{figure: f"{number} {unit}"}))
    proc = _explain(path)
    _refused(proc, f"({digits} digits), more than 2**64 bytes")


def test_a_400_digit_gib_figure_and_a_5000_digit_byte_count(tmp_path):
    """The two figures of issue 36, each refused with its digit count."""
    path = tmp_path / "oom.log"
    path.write_text(_message(allocated="1" * 400 + ".00 GiB"))
    _refused(_explain(path), "(400 digits), more than 2**64 bytes")
    path.write_text(_message(requested="7" * 5000 + " bytes"))
    _refused(_explain(path), "(5000 digits), more than 2**64 bytes")


def test_700_gib_allocated_on_a_79_gib_gpu_is_inconsistent(tmp_path):
    """An H100-class total cannot hold 700 GiB: refused as inconsistent, never explained."""
    path = tmp_path / "oom.log"
    path.write_text(_message(allocated="700.00 GiB"))
    proc = _explain(path)
    _refused(proc, "the out-of-memory message is inconsistent: it says 700.02 GiB is in use")
    assert "matched to the H100 PCIe" in proc.stderr


@_SIX_EXAMPLES
@given(
    total=st.sampled_from(["39.39 GiB", "79.11 GiB", "79.33 GiB", "139.80 GiB", "15.77 GiB"]),
    excess_gib=st.integers(min_value=2, max_value=10**6),
    where=st.sampled_from(["allocated", "cached"]),
)
def test_more_held_than_a_datacenter_gpu_has_is_exit_2(tmp_path, total, excess_gib, where):
    """A100/H100/H200/V100 totals with more held than the device: exit 2, 'inconsistent'."""
    held = f"{float(total.split()[0]) + excess_gib:.2f} GiB"
    path = tmp_path / "oom.log"
    path.write_text(_message(total=total, **{where: held}))
    _refused(_explain(path), "the out-of-memory message is inconsistent")


@_SIX_EXAMPLES
@given(total_gib=st.integers(min_value=1, max_value=200), extra_gib=st.integers(1, 10**6))
def test_more_free_than_the_device_is_exit_2(tmp_path, total_gib, extra_gib):
    """More free memory than the device's total: exit 2, 'inconsistent'."""
    path = tmp_path / "oom.log"
    path.write_text(
        _message(total=f"{total_gib}.00 GiB", free=f"{total_gib + extra_gib}.00 GiB")
    )
    _refused(_explain(path), "is free on a GPU with")


def test_a_windows_card_holding_more_than_its_total_is_explained_with_a_warning():
    """A real message (meshgen#7: 13.98 GiB on an 8 GiB card) is WDDM's shared memory."""
    from oomkit.diagnose.diagnosis import diagnose_oom_text

    text = _message(total="8.00 GiB", allocated="13.98 GiB", requested="1002.00 MiB")
    diagnosis = diagnose_oom_text(parse_oom_text(text))
    assert diagnosis.cause == "shortage"
    assert any("only Windows' WDDM driver allows that" in w for w in diagnosis.warnings)


_LOG_LINE = st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FFF, blacklist_categories=("Cs",)),
    max_size=60,
).filter(lambda line: "memory" not in line)


@_SIX_EXAMPLES
@given(
    encoding=st.sampled_from(["utf-16", "utf-16-le", "utf-16-be"]),
    before=st.lists(_LOG_LINE, max_size=5),
    after=st.lists(_LOG_LINE, max_size=5),
    crlf=st.booleans(),
)
# Found by CI on a fresh clone: a line naming vLLM made the log read as vLLM's runtime OOM.
@example(encoding="utf-16", before=[], after=["VLLM"], crlf=False)
def test_a_utf16_log_holding_an_oom_is_explained(tmp_path, encoding, before, after, crlf):
    """PowerShell's `>` (UTF-16 LE with a mark), and UTF-16 without one: the OOM is found."""
    newline = "\r\n" if crlf else "\n"
    text = newline.join([*before, FRAGMENTED, *after]) + newline
    data = text.encode(encoding)
    if encoding == "utf-16":
        assert data[:2] == b"\xff\xfe"  # Python writes little-endian with a mark, as PowerShell
    path = tmp_path / "train.log"
    path.write_bytes(data)
    proc = _explain(path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Cause: fragmentation")


def test_decode_log_keeps_utf8_that_starts_with_a_utf16_mark():
    """Bytes that merely start like a mark (a UTF-8 log with stray bytes) stay UTF-8."""
    from oomkit.diagnose.oom_text import decode_log

    data = b"\xff\xfe garbage \x80\r\n" + SHORTAGE.encode()
    assert SHORTAGE in decode_log(data)
    assert decode_log(SHORTAGE.encode("utf-16")) == SHORTAGE
    assert decode_log(b"") == ""


def test_utf16_stdin_is_read(monkeypatch, capsys):
    """PowerShell piping a UTF-16 log into stdin: the OOM is found."""
    data = ("log line\r\n" + SHORTAGE + "\r\n").encode("utf-16")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert main(["explain", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cause"] == "shortage"


def test_a_process_line_larger_than_an_h100_is_exit_2(tmp_path):
    """NVML saying one process holds 700 GiB of a 79.11 GiB GPU: inconsistent."""
    path = tmp_path / "oom.log"
    path.write_text(
        _message().replace("is free. ", "is free. Process 7 has 700.00 GiB memory in use. ")
    )
    _refused(_explain(path), "it says 700.00 GiB is in use on a GPU with 79.11 GiB")
