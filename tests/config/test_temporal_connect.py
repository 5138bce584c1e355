"""Where a Ballast process's Temporal client goes and how: Ballast's settings, else the SDK's
environment configuration (TEMPORAL_* variables, TOML profiles), with TLS, client
certificates and API keys from the latter. What `Client.connect` receives is captured;
tests/deploy/test_temporal_tls.py proves it against a real TLS terminator."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from temporalio.service import TLSConfig

import config.temporal
from config import Settings
from config.temporal import TemporalSettings, connect_temporal


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No TEMPORAL_* or BALLAST_TEMPORAL_* variable, and no ~/.config/temporalio/temporal.toml."""
    for name in list(os.environ):
        if name.startswith(("TEMPORAL_", "BALLAST_TEMPORAL_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))


@pytest.fixture
def connected(monkeypatch) -> list[dict[str, Any]]:
    """Every `Client.connect` call connect_temporal makes: its target and keyword arguments."""
    calls: list[dict[str, Any]] = []

    async def fake_connect(target_host: str, **kwargs: Any) -> str:
        calls.append(dict(target_host=target_host, **kwargs))
        return "client"

    monkeypatch.setattr(config.temporal.Client, "connect", fake_connect)
    return calls


def write_profiles(path: Path, certs: Path) -> Path:
    path.write_text(f"""
[profile.default]
address = "localhost:7233"

[profile.cloud]
address = "prod.a1b2c.tmprl.cloud:7233"
namespace = "prod.a1b2c"

[profile.cloud.tls]
server_name = "prod.a1b2c.tmprl.cloud"
client_cert_path = "{certs / 'client.pem'}"
client_key_path = "{certs / 'client.key'}"
""")
    return path


async def test_nothing_configured_leaves_the_address_unset(connected):
    s = TemporalSettings(_env_file=None)
    assert (s.temporal_address, s.temporal_namespace) == (None, "default")  # `ballast up` starts a dev server
    with pytest.raises(RuntimeError, match="TEMPORAL_ADDRESS"):
        await connect_temporal(s)
    assert connected == []


async def test_temporal_variables_configure_every_process(monkeypatch, connected):
    monkeypatch.setenv("TEMPORAL_ADDRESS", "temporal.internal:7233")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "ballast")
    s = Settings(_env_file=None)
    # What the CLI checks and `ballast up` asks before it starts a dev server of its own:
    assert s.require("temporal_address") == "temporal.internal:7233"
    assert s.temporal_namespace == "ballast"
    await connect_temporal(s)
    assert connected == [dict(target_host="temporal.internal:7233", namespace="ballast")]  # plain text, as before


async def test_a_toml_profile(monkeypatch, tmp_path, connected):
    (tmp_path / "client.pem").write_text("CERT")
    (tmp_path / "client.key").write_text("KEY")
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(write_profiles(tmp_path / "temporal.toml", tmp_path)))
    assert TemporalSettings(_env_file=None).temporal_address == "localhost:7233"  # the default profile

    monkeypatch.setenv("TEMPORAL_PROFILE", "cloud")
    s = TemporalSettings(_env_file=None)
    assert (s.temporal_address, s.temporal_namespace) == ("prod.a1b2c.tmprl.cloud:7233", "prod.a1b2c")
    await connect_temporal(s)
    (call,) = connected
    assert call["target_host"] == "prod.a1b2c.tmprl.cloud:7233" and call["namespace"] == "prod.a1b2c"
    assert call["tls"] == TLSConfig(domain="prod.a1b2c.tmprl.cloud", client_cert=b"CERT", client_private_key=b"KEY")


def test_a_missing_profile_is_an_error_not_a_silent_default(monkeypatch, tmp_path):
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(write_profiles(tmp_path / "temporal.toml", tmp_path)))
    monkeypatch.setenv("TEMPORAL_PROFILE", "staging")
    with pytest.raises(Exception, match="staging"):
        TemporalSettings(_env_file=None)


async def test_variables_override_the_profile(monkeypatch, tmp_path, connected):
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(write_profiles(tmp_path / "temporal.toml", tmp_path)))
    monkeypatch.setenv("TEMPORAL_PROFILE", "cloud")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "staging.a1b2c")
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_CERT_PATH", str(tmp_path / "other.pem"))
    (tmp_path / "client.key").write_text("KEY")
    (tmp_path / "other.pem").write_text("OTHER")
    s = TemporalSettings(_env_file=None)
    assert (s.temporal_address, s.temporal_namespace) == ("prod.a1b2c.tmprl.cloud:7233", "staging.a1b2c")
    await connect_temporal(s)
    assert connected[0]["tls"].client_cert == b"OTHER"


async def test_ballast_settings_win_and_tls_still_comes_from_the_sdk(monkeypatch, tmp_path, connected):
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(write_profiles(tmp_path / "temporal.toml", tmp_path)))
    monkeypatch.setenv("TEMPORAL_ADDRESS", "elsewhere:7233")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "elsewhere")
    monkeypatch.setenv("BALLAST_TEMPORAL_ADDRESS", "temporal.ballast:7233")
    monkeypatch.setenv("BALLAST_TEMPORAL_NAMESPACE", "default")  # set, though it is the default: it wins
    monkeypatch.setenv("TEMPORAL_TLS_SERVER_CA_CERT_PATH", str(tmp_path / "ca.pem"))
    monkeypatch.setenv("TEMPORAL_TLS_SERVER_NAME", "temporal.ballast")
    (tmp_path / "ca.pem").write_text("CA")
    s = TemporalSettings(_env_file=None)
    assert (s.temporal_address, s.temporal_namespace) == ("temporal.ballast:7233", "default")
    await connect_temporal(s)
    assert connected == [dict(target_host="temporal.ballast:7233", namespace="default",
                              tls=TLSConfig(domain="temporal.ballast", server_root_ca_cert=b"CA"))]


async def test_an_api_key_turns_tls_on_as_the_sdk_does(monkeypatch, connected):
    monkeypatch.setenv("TEMPORAL_ADDRESS", "us-east-1.aws.api.temporal.io:7233")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "prod.a1b2c")
    monkeypatch.setenv("TEMPORAL_API_KEY", "secret-key")
    monkeypatch.setenv("TEMPORAL_GRPC_META_X_TEAM", "inference")
    await connect_temporal(TemporalSettings(_env_file=None))
    (call,) = connected
    assert call["api_key"] == "secret-key" and call["tls"] is True  # the system's roots
    assert dict(call["rpc_metadata"]) == {"x-team": "inference"}

    connected.clear()
    monkeypatch.setenv("TEMPORAL_TLS", "false")  # a key over plain text, to a local proxy say: still the SDK's call
    await connect_temporal(TemporalSettings(_env_file=None))
    assert connected[0]["tls"] is False
