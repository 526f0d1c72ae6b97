"""Tests that hostile, corrupt and foreign files are refused with one clear error."""

import json
import os
import pickle
import random

import pytest

from oomkit.core.snapshot import load_snapshot, write_snapshot
from oomkit.errors import SnapshotFormatError

HOW = r"_record_memory_history\(\).*_dump_snapshot"


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Eval:
    def __reduce__(self):
        return (eval, ("1 + 1",))


def _valid(tmp_path):
    path = tmp_path / "ok.pickle"
    write_snapshot(path, [], {0: []})
    return path


def test_os_system_pickle_is_refused_and_nothing_runs(tmp_path):
    """A pickle whose __reduce__ calls os.system is refused and its command never runs."""
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": _Hostile(marker)}))
    with pytest.raises(
        SnapshotFormatError, match=r"evil\.pickle: refused to load: .*global (posix|os|nt)\.system"
    ):
        load_snapshot(path)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_builtins_eval_is_refused(tmp_path, protocol):
    """A pickle naming builtins.eval is refused whatever its protocol."""
    path = tmp_path / "eval.pickle"
    path.write_bytes(pickle.dumps(_Eval(), protocol=protocol))
    with pytest.raises(
        SnapshotFormatError, match=r"global (builtins|__builtin__)\.eval.*nothing in it was run"
    ):
        load_snapshot(path)


def test_harmless_global_is_refused_too(tmp_path):
    """Even a harmless class instance is refused: snapshots never need a global."""
    import collections

    path = tmp_path / "od.pickle"
    path.write_bytes(pickle.dumps(collections.OrderedDict(segments=[])))
    with pytest.raises(SnapshotFormatError, match=r"global collections\.OrderedDict"):
        load_snapshot(path)


def test_bytes_input_is_refused_the_same_way():
    """load_snapshot(bytes) refuses a hostile pickle too."""
    with pytest.raises(SnapshotFormatError, match=r"<bytes>: refused to load"):
        load_snapshot(pickle.dumps(_Eval()))


@pytest.mark.parametrize("keep", [1, 10, 0.5, -1])
def test_truncated_file_is_refused(tmp_path, keep):
    """A snapshot cut short is refused as truncated or corrupt."""
    src = tmp_path / "full.pickle"
    write_snapshot(
        src,
        [
            {
                "device": 0,
                "address": 0,
                "total_size": 2**21,
                "stream": 0,
                "segment_type": "small",
                "blocks": [{"address": 0, "size": 2**21, "requested_size": 8, "state": "inactive"}],
            }
        ],
        {0: []},
    )
    data = src.read_bytes()
    cut = (
        keep
        if isinstance(keep, int) and keep > 0
        else int(len(data) * keep)
        if keep > 0
        else len(data) - 1
    )
    path = tmp_path / "cut.pickle"
    path.write_bytes(data[:cut])
    with pytest.raises(SnapshotFormatError, match=r"cut\.pickle: .*truncated.*" + HOW):
        load_snapshot(path)


def test_empty_file_is_refused(tmp_path):
    """An empty file is refused as empty."""
    path = tmp_path / "empty.pickle"
    path.write_bytes(b"")
    with pytest.raises(SnapshotFormatError, match=r"empty\.pickle: the file is empty.*" + HOW):
        load_snapshot(path)


def test_json_file_is_refused(tmp_path):
    """A JSON file is refused as JSON, not a pickle."""
    path = tmp_path / "snap.json"
    path.write_text(json.dumps({"segments": []}))
    with pytest.raises(SnapshotFormatError, match=r"snap\.json: this looks like JSON text.*" + HOW):
        load_snapshot(path)


def test_random_bytes_are_refused(tmp_path):
    """Random bytes are refused as corrupt or not a pickle."""
    rng = random.Random(1234)
    path = tmp_path / "noise.bin"
    path.write_bytes(bytes(rng.randrange(256) for _ in range(4096)))
    with pytest.raises(SnapshotFormatError, match=r"noise\.bin: .*" + HOW):
        load_snapshot(path)


@pytest.mark.parametrize("seed", range(20))
def test_random_byte_files_only_ever_raise_snapshot_format_error(tmp_path, seed):
    """Whatever random bytes hold, the only error is SnapshotFormatError."""
    rng = random.Random(seed)
    data = b"\x80\x04" + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    with pytest.raises(SnapshotFormatError):
        load_snapshot(data)


def test_pickle_of_an_int_is_refused(tmp_path):
    """A valid pickle of something that is not a snapshot is refused as foreign."""
    path = tmp_path / "int.pickle"
    path.write_bytes(pickle.dumps(42))
    with pytest.raises(SnapshotFormatError, match=r"int\.pickle: the pickle holds a int.*" + HOW):
        load_snapshot(path)


def test_dict_without_segments_is_refused():
    """A dict that lacks 'segments' is refused, listing its keys."""
    with pytest.raises(SnapshotFormatError, match=r"without a 'segments' list \(keys: a, b\)"):
        load_snapshot(pickle.dumps({"a": 1, "b": 2}))


def test_torch_save_zip_is_refused(tmp_path):
    """A torch.save zip archive is named as such."""
    path = tmp_path / "model.pt"
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(SnapshotFormatError, match=r"zip archive \(what torch\.save writes\)"):
        load_snapshot(path)


def test_segment_with_wrong_types_is_refused():
    """A segment whose address is a string is refused, naming the segment."""
    data = {"segments": [{"address": "0x10", "total_size": 10, "blocks": []}]}
    with pytest.raises(SnapshotFormatError, match=r"segment 0: 'address' is '0x10', not an int"):
        load_snapshot(pickle.dumps(data))


def test_valid_file_loads(tmp_path):
    """A plain-data snapshot passes the restricted unpickler."""
    assert load_snapshot(_valid(tmp_path)).segments == ()
