"""Scenarios: one typed record of what a user asks, and the library every way in calls.

``Scenario`` (``model.py``) is what runs, its step, the target and the run; ``files.py`` reads
and writes it as TOML or JSON; ``run.py`` predicts it and ``fitting.py`` searches its batch.
The CLI, config files, the Python facade (``oomkit.predict``) and the MCP tools all build a
``Scenario`` and call these. Importing this package imports pydantic (the commands that only
read files never do).
"""

from __future__ import annotations

from oomkit.scenario.alternatives import FitAlternative, fit_alternatives
from oomkit.scenario.files import (
    apply_overrides,
    load_scenario,
    scenario_from_data,
    scenario_to_data,
    scenario_to_toml,
)
from oomkit.scenario.fitting import FitAnswer, fit
from oomkit.scenario.model import (
    LengthsSection,
    LoraSection,
    ModelSection,
    ParallelSection,
    QuantizeSection,
    RunSection,
    Scenario,
    SearchSection,
    StepSection,
    TargetSection,
)
from oomkit.scenario.run import PredictRun, predict, predicting, scenario_target

__all__ = [
    "FitAlternative",
    "FitAnswer",
    "LengthsSection",
    "LoraSection",
    "ModelSection",
    "ParallelSection",
    "PredictRun",
    "QuantizeSection",
    "RunSection",
    "Scenario",
    "SearchSection",
    "StepSection",
    "TargetSection",
    "apply_overrides",
    "fit",
    "fit_alternatives",
    "load_scenario",
    "predict",
    "predicting",
    "scenario_from_data",
    "scenario_target",
    "scenario_to_data",
    "scenario_to_toml",
]
