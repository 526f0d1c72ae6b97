"""Tests for oomkit.prediction.module_groups: repeated layers merged into one row, numeric order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from oomkit.prediction.module_groups import ModuleGroup, group_modules, natural_key

MiB = 2**20


def test_twelve_identical_blocks_become_one_row():
    """h.0 ... h.11 of one leaf module, equal bytes, read as ``h.0-11.mlp (12 layers)``."""
    rows = [(f"h.{i}.mlp", 48 * MiB) for i in range(12)] + [("wte", 400 * MiB)]
    groups = group_modules(rows)
    assert [(g.label, g.layers, g.total_bytes) for g in groups] == [
        ("h.0-11.mlp", 12, 576 * MiB),
        ("wte", 1, 400 * MiB),
    ]
    assert groups[0].paths == tuple(f"h.{i}.mlp" for i in range(12))
    assert groups[0].describe() == "h.0-11.mlp (12 layers, 48.00 MiB each)"
    assert groups[1].describe() == "wte"


def test_rounding_differences_merge_and_show_a_range():
    """Layers within 5% (block rounding) merge; the label gives the smallest and largest."""
    rows = [("h.0.c_fc", 92 * MiB), ("h.1.c_fc", 91 * MiB), ("h.2.c_fc", 91 * MiB)]
    (group,) = group_modules(rows)
    assert (group.label, group.min_bytes, group.max_bytes) == ("h.0-2.c_fc", 91 * MiB, 92 * MiB)
    assert group.describe() == "h.0-2.c_fc (3 layers, 91.00-92.00 MiB each)"


def test_layers_holding_different_bytes_or_with_a_gap_stay_apart():
    """Half-freed layers (backward part-way) and a skipped index start a new run."""
    rows = [(f"layers.{i}", 10 * MiB) for i in range(3)]
    rows += [(f"layers.{i}", 2 * MiB) for i in range(3, 6)]
    rows += [("layers.7", 2 * MiB)]
    labels = [(g.label, g.total_bytes) for g in group_modules(rows)]
    assert labels == [("layers.0-2", 30 * MiB), ("layers.3-5", 6 * MiB),
                      ("layers.7", 2 * MiB)]


def test_numeric_order_h2_before_h10():
    """Equal totals sort by the numbers' values, not as text; so do the members of a group."""
    assert sorted(["h.10", "h.2", "h.1"], key=natural_key) == ["h.1", "h.2", "h.10"]
    rows = [("h.10.x", MiB), ("h.2.y", MiB), ("a", MiB)]
    assert [g.label for g in group_modules(rows)] == ["a", "h.2.y", "h.10.x"]
    members = [(f"blocks.{i}.attn", MiB) for i in (10, 2, 9, 0, 1, 3, 4, 5, 6, 7, 8)]
    (group,) = group_modules(members)
    assert group.label == "blocks.0-10.attn"
    assert group.paths[:3] == ("blocks.0.attn", "blocks.1.attn", "blocks.2.attn")


def test_root_module_and_nested_indices():
    """The root module ("") stays its own row; only the first number is the layer index."""
    rows = [("", 5), ("layer1.0.conv1", 7), ("layer1.1.conv1", 7), ("enc.0.sub.0", 3),
            ("enc.1.sub.0", 3)]
    assert [(g.label, g.layers) for g in group_modules(rows)] == [
        ("layer1.0-1.conv1", 2),  # ResNet's blocks: "layer1" is a name, "0" the index
        ("enc.0-1.sub.0", 2),
        ("", 1),
    ]


@given(st.dictionaries(
    st.from_regex(r"[a-c](\.[0-9]{1,2})?(\.[a-b])?", fullmatch=True),
    st.integers(min_value=1, max_value=10**9),
    max_size=40,
))
def test_groups_partition_the_rows(rows):
    """Every path lands in exactly one group; group bytes sum to the rows' bytes."""
    groups = group_modules(rows.items())
    paths = [p for g in groups for p in g.paths]
    assert sorted(paths) == sorted(rows)
    assert sum(g.total_bytes for g in groups) == sum(rows.values())
    for g in groups:
        assert isinstance(g, ModuleGroup)
        assert g.min_bytes <= g.max_bytes <= g.min_bytes * 1.05
        assert g.total_bytes == sum(rows[p] for p in g.paths)
    totals = [g.total_bytes for g in groups]
    assert totals == sorted(totals, reverse=True)
