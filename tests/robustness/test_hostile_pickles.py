"""Crafted pickles: nothing in them runs (a canary file is never made); each is refused (exit 2)."""

from __future__ import annotations

import builtins
import copyreg
import os
import pickle
import pickletools
import sys
from pathlib import Path

import pytest

from oomkit.core.snapshot import load_snapshot
from oomkit.errors import OomkitError, SnapshotFormatError
from oomkit.interfaces.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from _hostile_support import assert_within_bounds, base_snapshot, run_bounded  # noqa: E402

PROTOCOLS = list(range(pickle.HIGHEST_PROTOCOL + 1))  # 0-5


class _System:
    """Unpickles as os.system("touch CANARY")."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


class _Eval:
    """Unpickles as builtins.eval("open(CANARY, 'w').close()")."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self):
        return (builtins.eval, (f"open({str(self.canary)!r}, 'w').close()",))


class _Exec:
    """Unpickles as builtins.exec(...), the payload a web exploit would use."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self):
        return (builtins.exec, (f"import pathlib; pathlib.Path({str(self.canary)!r}).touch()",))


PAYLOADS = {"os.system": _System, "builtins.eval": _Eval, "builtins.exec": _Exec}

# Where inside an otherwise valid snapshot the payload is put.
PLACES = ("top", "segment", "block", "frame_filename", "trace_entry", "user_metadata", "settings")


def _nest(payload, place: str):
    data = base_snapshot()
    if place == "top":
        return payload
    if place == "segment":
        data["segments"].append(payload)
    elif place == "block":
        data["segments"][0]["blocks"][1]["extra"] = payload
    elif place == "frame_filename":
        data["segments"][0]["blocks"][0]["frames"][0]["filename"] = payload
    elif place == "trace_entry":
        data["device_traces"][0][1]["size"] = payload
    elif place == "user_metadata":
        data["user_metadata"] = {"run": [1, {"deep": payload}]}
    elif place == "settings":
        data["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": payload}
    return data


def _manual(canary: Path) -> dict[str, bytes]:
    """Hand-written opcode streams that the pickle module would not write itself."""
    touch = f"touch {canary}".encode()
    return {
        # getattr(__import__('os'), 'system')('touch ...'): a getattr chain in protocol 0.
        "getattr_chain": b"c__builtin__\ngetattr\n(c__builtin__\n__import__\n(S'os'\ntRS'system'\n"
        b"tR(S'" + touch + b"'\ntR.",
        # INST: protocol 0's class-call opcode.
        "inst": b"(S'" + touch + b"'\nios\nsystem\n.",
        # OBJ: protocol 1's, after a GLOBAL.
        "obj": b"(cos\nsystem\nS'" + touch + b"'\no.",
        # copyreg._reconstructor, as protocol 0/1 pickles of objects name it.
        "copyreg_reconstructor": b"ccopy_reg\n_reconstructor\n(cos\nsystem\nc__builtin__\nobject\n"
        b"NtR.",
        # STACK_GLOBAL (protocol 4) naming posix.system, then a REDUCE.
        "stack_global": b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x8c\x06system"
        b"\x93\x8c" + bytes([len(touch)]) + touch + b"\x85R.",
        # torch.save's storages: persistent ids, binary and text.
        "binpersid": b"\x80\x02X\x07\x00\x00\x00storageQ.",
        "persid": b"Pstorage\n.",
        # protocol 5 out-of-band buffer with no buffers given.
        "next_buffer": b"\x80\x05\x97.",
    }


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_reduce_payload_is_refused_and_never_runs(tmp_path, payload, place, protocol):
    """os.system / eval / exec reduce payloads, anywhere in a snapshot, any protocol: refused."""
    canary = tmp_path / "CANARY"
    data = pickle.dumps(_nest(PAYLOADS[payload](canary), place), protocol=protocol)
    result = run_bounded(lambda: load_snapshot(data))
    assert_within_bounds(result)
    assert isinstance(result.error, SnapshotFormatError), result.error
    assert "refused to load: the pickle names the global" in str(result.error)
    assert "nothing in it was run" in str(result.error)
    assert not canary.exists()


@pytest.mark.parametrize("name", sorted(_manual(Path("x"))))
def test_hand_written_opcodes_are_refused(tmp_path, name):
    """getattr chains, INST/OBJ, copyreg, STACK_GLOBAL, persistent ids, buffers: refused."""
    canary = tmp_path / "CANARY"
    data = _manual(canary)[name]
    # A well-formed opcode stream (pickletools parses without running anything).
    assert [op.name for op, _, _ in pickletools.genops(data)][-1] == "STOP"
    result = run_bounded(lambda: load_snapshot(data))
    assert_within_bounds(result)
    assert isinstance(result.error, SnapshotFormatError), result.error
    assert not canary.exists()


@pytest.mark.parametrize("registered", [True, False])
def test_copyreg_extension_codes_are_refused(tmp_path, registered):
    """EXT1 (copyreg's extension registry) names os.system: refused whether registered or not."""
    canary = tmp_path / "CANARY"
    code = 0xF1
    touch = f"touch {canary}".encode()
    # PROTO 2, EXT1 code, the command string, TUPLE1, REDUCE, STOP.
    data = b"\x80\x02\x82" + bytes([code]) + b"C" + bytes([len(touch)]) + touch + b"\x85R."
    if registered:
        copyreg.add_extension("posix", "system", code)
    try:
        result = run_bounded(lambda: load_snapshot(data))
    finally:
        if registered:
            copyreg.remove_extension("posix", "system", code)
    assert_within_bounds(result)
    assert isinstance(result.error, SnapshotFormatError), result.error
    assert not canary.exists()


@pytest.mark.parametrize("command", [["replay"], ["replay", "--verify"], ["explain"], ["tune"]])
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_cli_refuses_hostile_pickles_with_exit_2(tmp_path, capsys, command, payload):
    """Every command that reads a snapshot: exit 2, one line, no canary."""
    canary = tmp_path / "CANARY"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(_nest(PAYLOADS[payload](canary), "user_metadata")))
    result = run_bounded(lambda: main([command[0], str(path), *command[1:]]))
    assert_within_bounds(result)
    assert result.value == 2, result.error
    err = capsys.readouterr().err
    assert err.startswith(f"oomkit: error: {path}: refused to load")
    assert not canary.exists()


def test_every_refusal_is_an_oomkit_error():
    """API callers catch one type: SnapshotFormatError is an OomkitError."""
    assert issubclass(SnapshotFormatError, OomkitError)
