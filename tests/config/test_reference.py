"""docs/settings.md is what `config.reference` renders from the code today, and it names
every setting a process reads exactly once."""

from __future__ import annotations

import re
from pathlib import Path

from ballast import procs
from ballast.client import CLIENT_ENV
from bench.stack import KEEP_LOGS_ENV
from config import Settings
from config.reference import render

SETTINGS_MD = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_the_settings_reference_is_current():
    assert SETTINGS_MD.read_text() == render(), (
        "docs/settings.md is out of date with config/: run `.venv/bin/python -m config.reference > docs/settings.md`"
    )


def test_every_setting_is_documented_once():
    # The model's own field list is the oracle, not the renderer: a field in a section the
    # reference does not list, or listed twice, fails here.
    text = SETTINGS_MD.read_text()
    expected = {f"BALLAST_{name.upper()}" for name in Settings.model_fields}
    counts = {env: len(re.findall(rf"`{env}`", text)) for env in expected}
    assert {env: n for env, n in counts.items() if n != 1} == {}
    listed = set(re.findall(r"^\| `(BALLAST_\w+)`", text, re.M))
    assert listed == expected


def test_the_docs_name_only_settings_that_exist():
    # A renamed or removed setting leaves its old name in prose; `BALLAST_X_*` names a family.
    fields = {f"BALLAST_{name.upper()}" for name in Settings.model_fields}
    root = SETTINGS_MD.parents[1]
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for env in re.findall(r"BALLAST_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)", doc.read_text()):
            assert env in fields or env in NOT_SETTINGS, f"{doc.name} names {env}, which config.Settings does not read"


# Read by the test suite (histories), by a supervisor's child before any settings are (the
# readiness file ballast/procs.py writes), by the client CLI, or by `ballast cells` (its own
# file, not the settings of a process of a cell): never a setting.
NOT_SETTINGS = {"BALLAST_RECORD_HISTORIES", procs.READY_FILE_ENV, *CLIENT_ENV, "BALLAST_CELLS_FILE", KEEP_LOGS_ENV}
