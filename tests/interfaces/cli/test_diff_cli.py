"""oomkit diff on the command line: the JSON contract, monitor logs, HTML, and bad input."""

from __future__ import annotations

import json

import pytest

from oomkit.interfaces.cli import main

MiB = 2**20


def _log(path, device, rows):
    """A monitor log: header, then (peak_allocated, peak_reserved, device_used) per step."""
    lines = [json.dumps({"oomkit_monitor": 1, "device": device, "capacity_bytes": 80 * 2**30})]
    for step, (alloc, res, used) in enumerate(rows):
        lines.append(
            json.dumps(
                {
                    "step": step, "time_s": float(step), "step_time_s": None,
                    "allocated_bytes": alloc, "reserved_bytes": res, "active_bytes": alloc,
                    "inactive_split_bytes": 0, "peak_allocated_bytes": alloc,
                    "peak_reserved_bytes": res, "num_alloc_retries": 0, "num_ooms": 0,
                    "num_device_alloc": 1, "num_device_free": 0, "device_used_bytes": used,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_monitor_logs_diff_json_contract(tmp_path, capsys):
    """Two monitor logs: peak step, parts that add up, outside from NVML, divergence step."""
    a = _log(tmp_path / "a.jsonl", "H100", [(10 * MiB, 20 * MiB, 520 * MiB), (12 * MiB, 30 * MiB, 530 * MiB)])
    b = _log(tmp_path / "b.jsonl", "H100", [(10 * MiB, 20 * MiB, 520 * MiB), (25 * MiB, 50 * MiB, 560 * MiB)])
    assert main(["diff", str(a), str(b), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_reserved_delta_bytes"] == 20 * MiB
    assert out["parts"] == {"allocated_bytes": 13 * MiB, "placement_bytes": 7 * MiB, "outside_bytes": 10 * MiB}
    assert out["peak_delta_bytes"] == 30 * MiB
    assert out["parts"]["allocated_bytes"] + out["parts"]["placement_bytes"] == out["peak_reserved_delta_bytes"]
    assert out["divergence"]["index"] == 1 and out["divergence"]["unit"] == "step"
    assert out["top_frames"] == []


def test_monitor_logs_of_two_gpus_need_force(tmp_path, capsys):
    """H100 against A100 logs: exit 2 with a message; --force compares them."""
    a = _log(tmp_path / "a.jsonl", "H100", [(1, 2, None)])
    b = _log(tmp_path / "b.jsonl", "A100", [(1, 2, None)])
    assert main(["diff", str(a), str(b)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["diff", str(a), str(b), "--force", "--json"]) == 0


def test_html_path_that_is_an_input_is_refused(tmp_path, capsys):
    """--html A: exit 2, and A is not overwritten."""
    a = _log(tmp_path / "a.jsonl", "H100", [(1, 2, None)])
    before = a.read_text()
    assert main(["diff", str(a), str(a), "--html", str(a)]) == 2
    assert a.read_text() == before
    assert "is one of the inputs" in capsys.readouterr().err


def test_a_log_against_a_prediction_is_refused(tmp_path, capsys):
    """A monitor log against a JSON that is not a prediction: exit 2 with what is missing."""
    a = _log(tmp_path / "a.jsonl", "H100", [(1, 2, None)])
    p = tmp_path / "p.json"
    p.write_text('{"gpu": {"name": "H100"}}')
    assert main(["diff", str(a), str(p)]) == 2
    assert "peak_reserved_at" in capsys.readouterr().err


def test_missing_input_exits_2(tmp_path):
    """A path that does not exist: argparse's exit 2."""
    with pytest.raises(SystemExit) as exc:
        main(["diff", str(tmp_path / "x.pickle"), str(tmp_path / "y.pickle")])
    assert exc.value.code == 2
