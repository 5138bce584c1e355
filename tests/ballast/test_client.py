"""The client CLI's configuration, as the `openai` and `temporal` CLIs resolve theirs: flags,
then the environment, then a profile saved in a file only its owner may read."""

from __future__ import annotations

import stat
import time

import pytest
from click.testing import CliRunner

from ballast import client, client_cli
from ballast.client import Profile


@pytest.fixture
def config(tmp_path, monkeypatch):
    path = tmp_path / "cfg" / "config.toml"
    for var in ("BALLAST_BASE_URL", "OPENAI_BASE_URL", "BALLAST_API_KEY", "OPENAI_API_KEY", "BALLAST_ADMIN_KEY",
                "BALLAST_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("BALLAST_CONFIG", str(path))
    return path


def test_flags_then_environment_then_profile(config, monkeypatch):
    client.write_profile("default", Profile("http://saved:1", "sk-saved", None))
    client.write_profile("ops", Profile("http://ops:2/v1/", None, "sk-admin"))
    client.write_profile("default", Profile(None, None, "sk-admin-too"))  # adds, keeps the rest
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert client.resolve(None, None, None, None) == Profile("http://saved:1", "sk-saved", "sk-admin-too")
    assert client.resolve("ops", None, None, None) == Profile("http://ops:2", None, "sk-admin")  # /v1 is ours to add
    monkeypatch.setenv("OPENAI_BASE_URL", "http://openai-env:3/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    assert client.resolve(None, None, None, None).base_url == "http://openai-env:3"
    monkeypatch.setenv("BALLAST_BASE_URL", "http://env:4")
    monkeypatch.setenv("BALLAST_API_KEY", "sk-env")
    assert client.resolve(None, None, None, None) == Profile(
        "http://env:4", "sk-env", "sk-admin-too")
    assert client.resolve(None, "http://flag:5", "sk-flag", "sk-flag-admin") == Profile(
        "http://flag:5", "sk-flag", "sk-flag-admin")
    with pytest.raises(client.ApiError) as no:
        client.resolve("nobody", None, None, None)
    assert no.value.code == client.Exit.USAGE and "profile set" in str(no.value)


def test_profile_set_and_show_through_the_cli(config):
    runner = CliRunner()
    made = runner.invoke(client_cli.cli, ["--profile", "lab", "profile", "set", "--url", "http://lab:8000",
                                          "--key", "sk-ballast-abcdefghijklmnopqrstuvwxyz"])
    assert made.exit_code == 0, made.output
    shown = runner.invoke(client_cli.cli, ["--profile", "lab", "--json", "profile", "show"])
    assert shown.exit_code == 0, shown.output
    assert '"base_url": "http://lab:8000"' in shown.output
    assert "abcdefghijklmnopqrstuvwxyz" not in shown.output  # keys are shown by their first characters only


def test_since_takes_spans_dates_and_seconds():
    now = time.time()
    assert abs(client_cli.since_time("2d") - (now - 2 * 86400)) < 5
    assert client_cli.since_time("1700000000") == 1700000000
    assert client_cli.since_time("2026-03-01") == 1772323200  # UTC unless it says
    assert client_cli.since_time("2026-03-01T01:00:00+01:00") == 1772323200
    with pytest.raises(Exception, match="give 7d"):
        client_cli.since_time("yesterday")


def test_shell_completion_completes_every_level():
    """What `eval "$(ballast completion bash)"` asks the program, answered as bash expects it."""
    import os
    import subprocess
    import sys

    def complete(words: str) -> list[str]:
        env = dict(os.environ, _BALLAST_COMPLETE="bash_complete", COMP_WORDS=words,
                   COMP_CWORD=str(len(words.split()) - 1))
        got = subprocess.run([sys.executable, "-m", "ballast.cli"], env=env, capture_output=True, text=True, timeout=60)
        return [line.split(",", 1)[1] for line in got.stdout.splitlines()]

    assert complete("ballast ba") == ["batch"]
    assert complete("ballast up") == ["up"]  # the server's commands are listed too
    assert complete("ballast admin engines d") == ["drain"]
    assert "--wait" in complete("ballast batch submit --w")
    script = subprocess.run([sys.executable, "-m", "ballast.cli", "completion", "bash"], capture_output=True,
                            text=True, timeout=60).stdout
    assert "_BALLAST_COMPLETE" in script and "complete " in script
