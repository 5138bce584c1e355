"""`ballast up`: the processes it runs on this machine and how it keeps them up."""

from __future__ import annotations

from pydantic import Field

from config.section import Section


class StackSettings(Section):
    # `ballast up`: how many engine workers (one vLLM engine each) it runs on this machine,
    # and their regions in turn (comma-separated; unset: each in `region`).
    engines: int = Field(1, ge=1)
    engine_regions: str | None = None

    # `ballast up`: the bookkeeping (the control worker and the embedded Temporal server)
    # runs at a lower CPU priority than the request path (the API and the engine worker),
    # so a request's journaling never takes the CPU from the next request's first token.
    bookkeeping_nice: int = Field(5, ge=0, le=19)

    # `ballast up` on a CPU engine: every other process keeps off the cores vLLM binds its
    # model worker to (ballast/cpus.py), as vLLM's own frontend and engine core do.
    isolate_engine_cpus: bool = False

    # `ballast up` restarts a crashed child after restart_backoff_s, doubling (up to
    # restart_max_backoff_s) for each crash within restart_healthy_after_s of its start;
    # restart_max_quick_crashes such crashes in a row is a crash loop: it gives up.
    restart_backoff_s: float = Field(1.0, ge=0)
    restart_max_backoff_s: float = Field(30.0, ge=0)
    restart_healthy_after_s: float = Field(30.0, ge=0)
    restart_max_quick_crashes: int = Field(5, ge=1)
