"""Hostile OOM text for `oomkit explain`: huge coloured logs, CRLF, bad bytes, markup (issue 16)."""

from __future__ import annotations

import io
import json
import sys
import time
import tracemalloc

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
