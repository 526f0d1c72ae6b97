"""`--checkpointing [none|full|selective-op]`: a bare flag still means full."""

from __future__ import annotations

import pytest

from oomkit.interfaces.cli import build_parser

pytest.importorskip("torch")


@pytest.mark.parametrize(
    ("flags", "mode"),
    [
        ([], "none"),
        (["--checkpointing"], "full"),
        (["--checkpointing", "full"], "full"),
        (["--checkpointing", "none"], "none"),
        (["--checkpointing", "selective-op"], "selective-op"),
    ],
)
@pytest.mark.parametrize("command", ["predict", "fit"])
def test_modes_reach_step_options(command, flags, mode):
    """Each spelling gives StepOptions.checkpointing its mode, for predict and fit alike."""
    from oomkit.core.gpus import get_gpu
    from oomkit.interfaces.cli._scenario_flags import scenario_from_args
    from oomkit.scenario.options import step_options

    args = build_parser().parse_args([command, "gpt2-124m", *flags])
    scenario = scenario_from_args(args, command, environ={})
    assert step_options(scenario, 2, None, get_gpu("h100")).options.checkpointing == mode


def test_unknown_mode_is_a_usage_error(capsys):
    """A mode argparse does not know exits 2 and lists the choices."""
    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["predict", "gpt2-124m", "--checkpointing", "op"])
    assert raised.value.code == 2
    err = capsys.readouterr().err  # Python 3.12.8+ drops the quotes around the choices
    assert "invalid choice: 'op'" in err and "selective-op" in err
