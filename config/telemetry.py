"""What an operator points Prometheus at: every process's /metrics, and who may read it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from config.section import Section


class TelemetrySettings(Section):
    # The secret every process's /metrics asks for (Authorization: Bearer; Prometheus'
    # `authorization.credentials_file`). Unset: /metrics answers 404, since its labels name
    # tenants and models. `ballast up` makes one (data_dir/metrics-token).
    metrics_token: SecretStr | None = None
    # Tenants are labels up to this many per process (the first seen); the rest are counted
    # under tenant="other", so a fleet of many tenants cannot blow up Prometheus.
    metrics_max_tenants: int = Field(50, ge=0)
    # Log lines: "text" for a terminal, "json" (one object a line: time, level, logger,
    # message, process, request_id, tenant, …) for a log pipeline.
    log_format: Literal["text", "json"] = "text"
    # The control worker's own listener: /metrics, /healthz (live) and /readyz (polling
    # Temporal). Port 0: any free one (it logs which).
    control_host: str = "127.0.0.1"
    control_port: int = Field(0, ge=0, le=65535)
