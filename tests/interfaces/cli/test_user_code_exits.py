"""User code that exits or raises, at import, in the builder or in the step: exit 2, one line
naming the file, the line and the exit code or exception (issue 36). The issue's case runs
`python -m oomkit predict file.py:build` in a subprocess (the process's own exit code and
stdout); the property tests over every stage call the CLI's ``main([...])`` in this process
(the code that turns the user's exit or exception into exit 2: ``python -m oomkit`` exits with
what ``main`` returns), each example without a torch import of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from _cli_in_process import run_in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Each stage's code, with {exit} replaced by the statement that exits or raises.
STAGES = {
    "import": """
        import sys
        import torch
        {exit}

        def build():
            return lambda: None
        """,
    "builder": """
        import sys
        import torch

        def build():
            {exit}
        """,
    "step": """
        import sys
        import torch

        def build():
            model = torch.nn.Linear(4, 4)

            def step():
                model(torch.randn(2, 4)).sum().backward()
                {exit}

            return step, (model,)
        """,
}
# The line {exit} lands on, after dedent (first line is empty).
EXIT_LINE = {"import": 4, "builder": 6, "step": 10}
STAGE_WORDS = {"import": "importing", "builder": "build()", "step": "the step"}


def _predict(tmp_path, text):
    path = tmp_path / "user.py"
    path.write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "oomkit", "predict", f"{path}:build", "--gpu", "rtx4090"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    return done.returncode, done.stdout, done.stderr


def _predict_in_process(tmp_path, text):
    """``_predict``'s exit code, stdout and stderr from ``main([...])`` run in this process in
    the working directory the subprocess gets (``_cli_in_process.run_in_process``)."""
    path = tmp_path / "user.py"
    path.write_text(textwrap.dedent(text))
    run = run_in_process(["predict", f"{path}:build", "--gpu", "rtx4090"], cwd=tmp_path)
    return run.returncode, run.stdout, run.stderr


_CODES = st.one_of(
    st.none(),
    st.integers(-5, 300),
    st.text(alphabet="abcdefghij klmnop", min_size=1, max_size=12),
)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stage=st.sampled_from(sorted(STAGES)), code=_CODES)
def test_sys_exit_anywhere_is_exit_2_naming_line_and_code(tmp_path, stage, code):
    """sys.exit(0 / 3 / 'msg' / None) at import, in build() or in the step: exit 2 (never the
    script's own code, never 0), one line with the file, the line and sys.exit(code)."""
    text = STAGES[stage].replace("{exit}", f"sys.exit({code!r})")
    exit_code, _, err = _predict_in_process(tmp_path, text)
    assert exit_code == 2, err
    said = "sys.exit()" if code is None else f"sys.exit({code!r})"
    assert f"called {said} at " in err
    assert STAGE_WORDS[stage] in err
    assert f"user.py:{EXIT_LINE[stage]}" in err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("oomkit: error:")]) == 1


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    stage=st.sampled_from(sorted(STAGES)),
    error=st.sampled_from(["ValueError", "KeyError", "RuntimeError", "ZeroDivisionError", "OSError"]),
)
def test_an_exception_anywhere_is_exit_2_naming_it(tmp_path, stage, error):
    """raise X('boom') at import, in build() or in the step: exit 2, the exception's type and
    message, no traceback."""
    text = STAGES[stage].replace("{exit}", f"raise {error}('boom')")
    exit_code, _, err = _predict_in_process(tmp_path, text)
    assert exit_code == 2, err
    assert error in err
    assert "boom" in err
    assert "Traceback" not in err


def test_sys_exit_zero_at_import_is_not_success(tmp_path):
    """The issue's case: sys.exit(0) at import used to exit 0 with no output."""
    exit_code, out, err = _predict(tmp_path, STAGES["import"].replace("{exit}", "sys.exit(0)"))
    assert (exit_code, out) == (2, "")
    assert "importing" in err and "called sys.exit(0) at" in err and "user.py:4" in err


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stage=st.sampled_from(sorted(STAGES)), code=st.integers(0, 255))
def test_os_exit_anywhere_is_exit_2_naming_line_and_code(tmp_path, stage, code):
    """os._exit(N) ends a process at once: it had ended oomkit with the user's N and no word
    (N = 0 looked like success). Now, like sys.exit: exit 2, one line, os._exit(N) and where."""
    text = STAGES[stage].replace("import sys", "import os").replace("{exit}", f"os._exit({code})")
    exit_code, _, err = _predict_in_process(tmp_path, text)
    assert exit_code == 2, err
    assert f"called os._exit({code}) at " in err and f"user.py:{EXIT_LINE[stage]}" in err
    assert STAGE_WORDS[stage] in err and "Traceback" not in err
    assert os._exit.__module__ == "posix" or os._exit.__name__ == "_exit"  # the real one back


def test_os_exit_in_a_whole_script_is_exit_2(tmp_path):
    """`oomkit predict train.py` of a script that calls os._exit before any step."""
    script = tmp_path / "train.py"
    script.write_text("import os\nimport torch\nos._exit(3)\n")
    run = run_in_process(["predict", str(script), "--gpu", "rtx4090"], cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "the script called os._exit(3) at train.py:3" in run.stderr


def test_a_file_rewritten_at_the_same_size_and_time_is_read_as_it_is_now(tmp_path):
    """The user's file is compiled from its source each time: a bytecode cache keyed by mtime
    and size had served sys.exit('g') for a file now saying sys.exit('h') (a flaky hypothesis
    example in CI), and no __pycache__ is written beside the user's code."""
    path = tmp_path / "user.py"
    for code in ("g", "h"):
        path.write_text(textwrap.dedent(STAGES["import"].replace("{exit}", f"sys.exit({code!r})")))
        os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
        run = run_in_process(["predict", f"{path}:build", "--gpu", "rtx4090"], cwd=tmp_path)
        assert run.returncode == 2 and f"called sys.exit({code!r}) at " in run.stderr
    assert not (tmp_path / "__pycache__").exists()
