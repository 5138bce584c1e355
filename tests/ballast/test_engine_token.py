"""BALLAST_ENGINE_TOKEN is required wherever the engine endpoint is served or called: an
engine worker and the API started by hand without it refuse to start, saying what to set."""

from __future__ import annotations

import pytest

from ballast import cli
from config import Settings


@pytest.fixture
def reachable(monkeypatch):
    """Everything else they need is set (nothing is connected to before the token check)."""
    monkeypatch.setenv("BALLAST_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("BALLAST_TEMPORAL_ADDRESS", "127.0.0.1:1")
    monkeypatch.delenv("BALLAST_ENGINE_TOKEN", raising=False)


@pytest.mark.parametrize("argv", [["worker", "engine"], ["api"]])
@pytest.mark.parametrize("value", [None, "", "   "])
def test_refuses_to_start_without_the_token(reachable, monkeypatch, argv, value):
    if value is not None:
        monkeypatch.setenv("BALLAST_ENGINE_TOKEN", value)
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    assert "BALLAST_ENGINE_TOKEN is not set" in str(exit.value.code)


def test_the_token_is_a_secret(monkeypatch):
    monkeypatch.setenv("BALLAST_ENGINE_TOKEN", "s3cret-engine-token")
    s = Settings(_env_file=None)
    assert s.engine_token is not None and s.engine_token.get_secret_value() == "s3cret-engine-token"
    assert "s3cret" not in repr(s) and "s3cret" not in str(s.model_dump())
