"""The /metrics text of a process, and who may read it.

The Temporal SDK exports its metrics from its Rust runtime on an endpoint of its own; each
process binds it to a free loopback port and appends it to its own text, so a process is
one scrape target whatever runs in it."""

from __future__ import annotations

import hmac
import logging
import socket
from dataclasses import dataclass

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
_runtime: Runtime | None = None
_temporal_url: str | None = None


def temporal_runtime() -> Runtime:
    """The Temporal runtime of this process, whose metrics its /metrics includes: made once,
    shared by its clients and workers."""
    global _runtime, _temporal_url
    if _runtime is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        _runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{port}")))
        _temporal_url = f"http://127.0.0.1:{port}/metrics"
    return _runtime


async def render() -> bytes:
    """Every series of this process, in Prometheus' text format."""
    text = generate_latest(REGISTRY)
    if _temporal_url is not None:
        try:
            async with httpx.AsyncClient(timeout=5) as http:
                r = await http.get(_temporal_url)
                r.raise_for_status()
                text += r.content
        except httpx.HTTPError as err:  # the rest is still worth a scrape
            log.warning("the Temporal SDK's metrics could not be read: %s", err)
    return text


def allowed(authorization: str | None, token: str | None) -> bool | None:
    """Whether a request with this Authorization header may read /metrics: None where
    metrics are off (no token configured), else whether it presents the token."""
    if not token:
        return None
    presented = (authorization or "").removeprefix("Bearer ").strip()
    return hmac.compare_digest(presented.encode(), token.encode())


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    code: str

    @property
    def headers(self) -> dict[str, str] | None:
        """A 401 names the scheme it asks for."""
        return {"WWW-Authenticate": "Bearer"} if self.status == 401 else None


def refusal(authorization: str | None, token: str | None) -> Refusal | None:
    """What /metrics answers a request that may not read it (every process alike); None: it may."""
    ok = allowed(authorization, token)
    if ok is None:
        return Refusal(404, "Metrics are off: set BALLAST_METRICS_TOKEN and scrape with it as a bearer token.",
                       "not_found")
    return None if ok else Refusal(401, "The metrics token is missing or wrong.", "invalid_metrics_token")
