"""Settings that would make the fleet controller or the engine misbehave are refused at
start-up, naming the variable."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from config import Settings


def test_defaults_are_consistent():
    s = Settings(_env_file=None)
    assert 0 <= s.surge_low <= s.surge_high <= 1 and s.engine_nice == 10
    assert s.flex_starve_after_s < s.wait_bound_flex_s <= s.wait_bound_default_s <= s.wait_bound_priority_s


@pytest.mark.parametrize("env, name", [
    (dict(BALLAST_SURGE_HIGH="1.5"), "surge_high"),
    (dict(BALLAST_SURGE_BATCH_SHARE="-0.1"), "surge_batch_share"),
    (dict(BALLAST_FLEET_TICK_S="0"), "fleet_tick_s"),
    (dict(BALLAST_ENGINE_NICE="25"), "engine_nice"),
    (dict(BALLAST_SURGE_HIGH="0.3", BALLAST_SURGE_LOW="0.6"), "BALLAST_SURGE_LOW"),
    (dict(BALLAST_FLEX_STARVE_AFTER_S="30"), "BALLAST_FLEX_STARVE_AFTER_S"),  # past flex's 10 s bound
])
def test_bad_fleet_settings_are_refused(monkeypatch, env, name):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValidationError, match=name):
        Settings(_env_file=None)


def test_services_connect_as_their_own_role(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://owner:secret@db:5432/ballast?sslmode=require")
    for name in ("BALLAST_DATABASE_URL", "BALLAST_SERVICE_ROLE", "BALLAST_SERVICE_DATABASE_URL",
                 "BALLAST_SERVICE_DATABASE_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    s = Settings(_env_file=None)
    assert s.database_url == "postgresql://owner:secret@db:5432/ballast?sslmode=require"  # migrations
    # Not the owner's password:
    assert s.service_db_url == "postgresql://ballast_service@db:5432/ballast?sslmode=require"

    monkeypatch.setenv("BALLAST_SERVICE_ROLE", "svc")
    monkeypatch.setenv("BALLAST_SERVICE_DATABASE_PASSWORD", "p@ss")
    assert Settings(_env_file=None).service_db_url == "postgresql://svc:p%40ss@db:5432/ballast?sslmode=require"

    monkeypatch.setenv("BALLAST_SERVICE_DATABASE_URL", "postgresql://other@elsewhere/ballast")
    assert Settings(_env_file=None).service_db_url == "postgresql://other@elsewhere/ballast"


def test_no_database_no_service_url(monkeypatch):
    for name in ("DATABASE_URL", "BALLAST_DATABASE_URL", "BALLAST_SERVICE_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    assert Settings(_env_file=None).service_db_url is None


def test_the_workflow_link_is_the_ui_list_of_the_workflows_runs():
    from urllib.parse import parse_qs, urlsplit

    from config.temporal import TemporalSettings

    assert TemporalSettings(temporal_address="x:7233").workflow_url("batch:b_1") is None  # no UI: no link
    s = TemporalSettings(temporal_address="x:7233", temporal_namespace="prod ns", temporal_ui_url="https://ui.example/")
    link = urlsplit(s.workflow_url("batch:b_1"))
    assert (link.scheme, link.netloc, link.path) == ("https", "ui.example", "/namespaces/prod%20ns/workflows")
    assert parse_qs(link.query) == {"query": ['WorkflowId="batch:b_1"']}
