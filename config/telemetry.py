"""What an operator points Prometheus and a trace collector at: every process's /metrics, who may
read it, and where its spans go."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from config.section import Section
from policy.autoscale import ScalePolicy


class TelemetrySettings(Section):
    # The secret every process's /metrics asks for (Authorization: Bearer; Prometheus'
    # `authorization.credentials_file`). Unset: /metrics answers 404, since its labels name
    # tenants and models. `ballast up` makes one (data_dir/metrics-token).
    metrics_token: SecretStr | None = None
    # Tenants are labels up to this many per process (the first seen); the rest are counted
    # under tenant="other", so a fleet of many tenants cannot blow up Prometheus.
    metrics_max_tenants: int = Field(50, ge=0)
    # How often the control worker reads what waits (backlog, queued tokens, the fold's age,
    # surges) from the journal for its gauges.
    metrics_refresh_s: float = Field(15.0, gt=0)
    # The autoscaling signal (ballast_engines_wanted, policy/autoscale.py): each engine kept at
    # this share of its slots by interactive work, a pool's queued batch tokens drained within
    # this many seconds, and the bounds of what it asks for.
    autoscale_target_busy: float = Field(0.7, gt=0, le=1)
    autoscale_drain_s: float = Field(3600.0, gt=0)
    autoscale_min_engines: int = Field(1, ge=0)
    autoscale_max_engines: int = Field(64, ge=1)

    def scale_policy(self) -> ScalePolicy:
        return ScalePolicy(self.autoscale_target_busy, self.autoscale_drain_s, self.autoscale_min_engines,
                           self.autoscale_max_engines)

    # Log lines: "text" for a terminal, "json" (one object a line: time, level, logger,
    # message, process, request_id, tenant, …) for a log pipeline.
    log_format: Literal["text", "json"] = "text"
    # The control worker's own listener: /metrics, /healthz (live) and /readyz (polling
    # Temporal). Port 0: any free one (it logs which).
    control_host: str = "127.0.0.1"
    control_port: int = Field(0, ge=0, le=65535)

    # Traces: the OTLP/HTTP endpoint every process sends its OpenTelemetry spans to, a
    # collector's traces path (http://collector:4318/v1/traces); vLLM's own spans go there
    # too. Unset: no tracing, no spans made or sent.
    otlp_endpoint: str | None = None
    # The share of traces kept where the trace starts here; one a caller sends its decision
    # with (traceparent) follows that decision.
    trace_sample_ratio: float = Field(1.0, ge=0, le=1)
