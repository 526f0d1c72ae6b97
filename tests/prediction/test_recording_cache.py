"""The recording cache's entries: kept whole, read back equal, damage read as a miss."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oomkit.prediction.recording_cache as recording_cache
from oomkit.core.trace import Frame, TraceEvent, TraceHeader, write_trace
from oomkit.prediction.recording_cache import (
    CACHE_FORMAT_VERSION,
    CachedRecording,
    cache_directory,
    cache_disabled,
    load_recording,
    plain_data,
    plain_value,
    recorder_environment,
    recording_key,
    source_tree_digest,
    store_recording,
)

KEY = "ab" * 32
OTHER_KEY = "cd" * 32
FRAME = (Frame("model.py", 12, "forward"),)


def recording(**changes) -> CachedRecording:
    events = (
        TraceEvent("alloc", 1, 512, tags=(("category", "parameter"), ("phase", "user"))),
        TraceEvent("alloc", 2, 4096, frames=FRAME, tags=(("category", "activation"),)),
        TraceEvent("free_requested", 2, 4096, tags=(("category", "activation"),)),
        TraceEvent("free_completed", 2, 4096, tags=(("category", "activation"),)),
    )
    fields = {
        "events": events,
        "step_starts": (1,),
        "warnings": ("1 op was not traced",),
        "bytes_by_category": {"parameter": 512, "activation": 4096},
        "kernel_choices": {"SDPA flash_attention": 24},
        "assumptions": {"cuDNN": "9.20.0"},
        "context": {"description": "GPT-2", "workload": {"lora": {"targets": ("q", "v")}}},
    }
    fields.update(changes)
    return CachedRecording(**fields)


def entry(folder: Path, key: str = KEY) -> Path:
    return folder / f"{key}.trace.gz"


def test_an_entry_reads_back_equal(tmp_path):
    """A stored recording loads equal, field for field, tuples kept as tuples."""
    kept = recording()
    assert store_recording(KEY, kept, tmp_path) is True
    loaded = load_recording(KEY, tmp_path)
    assert loaded == kept
    assert loaded.context["workload"]["lora"]["targets"] == ("q", "v")
    assert loaded.events[1].frames == FRAME
    assert loaded.steps == 1


def test_the_write_leaves_only_the_entry(tmp_path):
    """Written to a temporary file and renamed: the folder holds the entry and nothing else."""
    store_recording(KEY, recording(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{KEY}.trace.gz"]


def test_a_missing_entry_is_a_miss(tmp_path):
    """No entry, no folder, or a key that is not a hex digest: ``None``."""
    assert load_recording(KEY, tmp_path) is None
    assert load_recording(KEY, tmp_path / "absent") is None
    assert load_recording("../etc/passwd", tmp_path) is None


@pytest.mark.parametrize("keep_bytes", [0, 10, 200, -20, -1])
def test_a_truncated_entry_is_a_miss_and_is_rewritten(tmp_path, keep_bytes):
    """A truncated gzip (the end cut at several places) loads as ``None``; storing again
    replaces it with a whole entry."""
    store_recording(KEY, recording(), tmp_path)
    data = entry(tmp_path).read_bytes()
    entry(tmp_path).write_bytes(data[:keep_bytes])
    assert load_recording(KEY, tmp_path) is None
    assert store_recording(KEY, recording(), tmp_path) is True
    assert load_recording(KEY, tmp_path) == recording()


def test_an_entry_cut_before_its_end_line_is_a_miss(tmp_path):
    """Whole gzip, but the trace lacks its end line (a torn write of the text): ``None``."""
    store_recording(KEY, recording(), tmp_path)
    lines = gzip.decompress(entry(tmp_path).read_bytes()).decode().splitlines(keepends=True)
    entry(tmp_path).write_bytes(gzip.compress("".join(lines[:-1]).encode()))
    assert load_recording(KEY, tmp_path) is None


def test_garbage_and_a_pickle_are_misses(tmp_path):
    """Bytes that are no trace (random bytes, a pickle) load as ``None``, without unpickling."""
    entry(tmp_path).write_bytes(os.urandom(300))
    assert load_recording(KEY, tmp_path) is None
    entry(tmp_path).write_bytes(b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x94.")
    assert load_recording(KEY, tmp_path) is None


def test_another_keys_entry_is_a_miss(tmp_path):
    """An entry renamed to another key (or copied from another machine) is not trusted."""
    store_recording(OTHER_KEY, recording(), tmp_path)
    entry(tmp_path, OTHER_KEY).rename(entry(tmp_path))
    assert load_recording(KEY, tmp_path) is None


def test_a_foreign_trace_and_another_version_are_misses(tmp_path):
    """A trace file of another source, or of another cache format version: ``None``."""
    events = recording().events
    write_trace(entry(tmp_path), events, TraceHeader(source="tracer", metadata={"key": KEY}))
    assert load_recording(KEY, tmp_path) is None
    store_recording(KEY, recording(), tmp_path)
    lines = gzip.decompress(entry(tmp_path).read_bytes()).decode()
    old = f'"cache_format":{CACHE_FORMAT_VERSION}'
    assert old in lines
    entry(tmp_path).write_bytes(gzip.compress(lines.replace(old, '"cache_format":99').encode()))
    assert load_recording(KEY, tmp_path) is None


def test_a_header_field_of_the_wrong_type_is_a_miss(tmp_path):
    """Step boundaries that are not integers, or outside the events: ``None``."""
    store_recording(KEY, recording(), tmp_path)
    text = gzip.decompress(entry(tmp_path).read_bytes()).decode()
    for bad in ('"step_starts":["1"]', '"step_starts":[9]', '"step_starts":{"a":1}'):
        damaged = text.replace('"step_starts":[1]', bad)
        assert damaged != text
        entry(tmp_path).write_bytes(gzip.compress(damaged.encode()))
        assert load_recording(KEY, tmp_path) is None


def test_a_context_that_is_not_plain_data_is_not_kept(tmp_path):
    """An object in the context cannot be read back equal: nothing is written."""
    assert store_recording(KEY, recording(context={"x": object()}), tmp_path) is False
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_folder_is_not_an_error(tmp_path):
    """A folder that cannot be made (a file is in the way): ``False``, no exception."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert store_recording(KEY, recording(), blocker / "recordings") is False


def test_the_least_recently_used_entries_are_pruned(tmp_path, monkeypatch):
    """Beyond MAX_ENTRIES, storing removes the entries used longest ago; a hit counts as a
    use, so an old entry just read survives."""
    monkeypatch.setattr(recording_cache, "MAX_ENTRIES", 3)
    keys = [f"{n:064x}" for n in range(4)]
    for age, key in zip((400, 300, 200), keys[:3], strict=True):
        store_recording(key, recording(), tmp_path)
        os.utime(entry(tmp_path, key), (1e9 - age, 1e9 - age))
    assert load_recording(keys[0], tmp_path) == recording()  # the oldest, used now
    store_recording(keys[3], recording(), tmp_path)
    kept = sorted(p.name.split(".")[0] for p in tmp_path.iterdir())
    assert kept == sorted([keys[0], keys[2], keys[3]])


def test_a_dead_writers_temporary_file_is_removed(tmp_path):
    """A temporary file older than an hour (a writer killed before its rename) is removed by
    the next store; a fresh one (a writer at work) is left."""
    old, fresh = tmp_path / ".entry-old.tmp.gz", tmp_path / ".entry-new.tmp.gz"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(old, (1e9, 1e9))
    store_recording(KEY, recording(), tmp_path)
    assert not old.exists() and fresh.exists()


def test_the_folder_follows_the_environment(tmp_path):
    """OOMKIT_CACHE_DIR, else an absolute XDG_CACHE_HOME, else ~/.cache."""
    home = os.path.expanduser("~")
    assert cache_directory({"OOMKIT_CACHE_DIR": str(tmp_path)}) == tmp_path / "recordings"
    assert cache_directory({"XDG_CACHE_HOME": "/x/cache"}) == Path("/x/cache/oomkit/recordings")
    relative = cache_directory({"XDG_CACHE_HOME": "cache"})
    assert relative == Path(home) / ".cache" / "oomkit" / "recordings"
    assert cache_directory({}) == Path(home) / ".cache" / "oomkit" / "recordings"


@pytest.mark.parametrize(
    ("value", "disabled"), [("1", True), ("true", True), ("YES", True), ("0", False), ("", False)]
)
def test_oomkit_no_cache(value, disabled):
    """OOMKIT_NO_CACHE=1 (true, yes, on) turns the cache off."""
    assert cache_disabled({"OOMKIT_NO_CACHE": value}) is disabled


def test_the_recorder_environment_keeps_what_a_recording_reads():
    """cuBLAS/cuDNN/torch variables are keyed; the cache's own and unrelated ones are not."""
    env = {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "CUDNN_CONV_WSCAP_DBG": "64",
        "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1",
        "OOMKIT_CACHE_DIR": "/c",
        "OOMKIT_NO_CACHE": "0",
        "HOME": "/root",
        "COLUMNS": "80",
    }
    assert recorder_environment(env) == {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "CUDNN_CONV_WSCAP_DBG": "64",
        "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1",
    }


def test_the_key_changes_with_any_part_of_the_material():
    """Equal material, equal key (whatever the key order); any changed value, another key."""
    base = {"scenario": {"step": {"batch": 8, "seq": 1024}}, "environment": {}}
    reordered = {"environment": {}, "scenario": {"step": {"seq": 1024, "batch": 8}}}
    assert recording_key(base) == recording_key(reordered)
    assert len(recording_key(base)) == 64
    changed = {"scenario": {"step": {"batch": 9, "seq": 1024}}, "environment": {}}
    assert recording_key(changed) != recording_key(base)
    env = {"scenario": base["scenario"], "environment": {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}}
    assert recording_key(env) != recording_key(base)


def test_the_source_digest_sees_every_edit(tmp_path):
    """An edited, added or renamed .py file changes the digest; __pycache__ does not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    first = source_tree_digest(tmp_path)
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.py").write_text("junk")
    assert source_tree_digest(tmp_path) == first
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    edited = source_tree_digest(tmp_path)
    assert edited != first
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "b.py")
    assert source_tree_digest(tmp_path) not in (first, edited)


PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


@given(PLAIN)
@settings(max_examples=200, deadline=None)
def test_plain_data_comes_back_with_its_types(value):
    """Any nesting of lists, tuples and string-keyed dicts reads back equal, types kept."""
    back = plain_value(plain_data(value))
    assert back == value
    assert repr(back) == repr(value)


@given(st.dictionaries(st.text(max_size=5), st.integers() | st.text(), min_size=2, max_size=4))
@settings(max_examples=50, deadline=None)
def test_plain_value_refuses_what_plain_data_never_writes(data):
    """A mapping of more than one key (not a tag) is not a value: TypeError."""
    with pytest.raises(TypeError, match="not a value"):
        plain_value(data)


_SEEN_CACHE_FOLDERS: list[str] = []


@pytest.mark.parametrize("run", [1, 2])
def test_each_test_has_a_cache_folder_of_its_own(run, tmp_path_factory):
    """tests/conftest.py points OOMKIT_CACHE_DIR at a new folder under pytest's temporary
    folder for every test: none writes the user's cache or replays another test's recording."""
    folder = os.environ["OOMKIT_CACHE_DIR"]
    assert Path(folder).parent == tmp_path_factory.getbasetemp()
    assert folder not in _SEEN_CACHE_FOLDERS
    _SEEN_CACHE_FOLDERS.append(folder)
    assert "OOMKIT_NO_CACHE" not in os.environ
    assert cache_directory() == Path(folder) / "recordings"
