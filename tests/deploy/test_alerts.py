"""The alert rules in deploy/prometheus are valid and fire as their tests say, by
Prometheus' own promtool (from the OS package `make test-deps` installs)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not installed: run `make test-deps` (`make test` does), which installs Prometheus")
    return found


@pytest.mark.parametrize("args", [["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]])
def test_promtool(promtool, args):
    done = subprocess.run([promtool, *args], cwd=RULES, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_rule_has_a_test():
    import yaml  # type: ignore[import-untyped]

    groups = yaml.safe_load((RULES / "alerts.yml").read_text())["groups"]
    cases = yaml.safe_load((RULES / "alerts_test.yml").read_text())["tests"]
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    fired = {t["alertname"] for case in cases for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert alerts == fired
    records = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    read = {t["expr"].split("{")[0] for case in cases for t in case.get("promql_expr_test", []) if t.get("exp_samples")}
    assert records == read
