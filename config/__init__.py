"""Every knob of a Ballast process, read from `BALLAST_*` environment variables, one module
per concern; `Settings` is all of them, what a process receives and passes down.

`DATABASE_URL` is honoured too, because that is what every platform hands a service.
Nothing here has side effects, and nothing here imports from the rest of Ballast but
`policy/`: every layer may import it.
"""

from __future__ import annotations

from typing import Literal

from config.api import ApiSettings
from config.database import DatabaseSettings
from config.engine import CPU_KV_CACHE_GIB, TINY_MODEL_NAME, EngineSettings
from config.paths import PathSettings
from config.placement import PlacementSettings
from config.scheduling import SchedulingSettings
from config.stack import StackSettings
from config.telemetry import TelemetrySettings
from config.temporal import TemporalSettings
from config.webhooks import WebhookSettings
from config.work import WorkSettings

__all__ = ["CPU_KV_CACHE_GIB", "TINY_MODEL_NAME", "Settings"]

# The sections in the order a reference lists them.
SECTIONS = (PathSettings, DatabaseSettings, TemporalSettings, ApiSettings, PlacementSettings, EngineSettings,
            SchedulingSettings, WorkSettings, WebhookSettings, TelemetrySettings, StackSettings)


class Settings(StackSettings, TelemetrySettings, WebhookSettings, WorkSettings, SchedulingSettings, EngineSettings,
               PlacementSettings, ApiSettings, TemporalSettings, DatabaseSettings, PathSettings):
    def require(self, name: Literal["database_url", "service_db_url", "temporal_address"]) -> str:
        """A URL this process cannot run without. The CLI checks them before it starts a
        process (`ballast up` fills them in); this turns a miss into a clear error."""
        value: str | None = getattr(self, name)
        if not value:
            env = "BALLAST_TEMPORAL_ADDRESS" if name == "temporal_address" else "BALLAST_DATABASE_URL"
            raise RuntimeError(f"{env} is not set: {name} is needed here")
        return value
