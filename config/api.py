"""The API process: where it listens, what it accepts, how it admits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from config.section import Section
from policy.admission import staleness_s
from protocol.limits import LIMITS

# A new tenant's limits across its models: every dimension bounded, generous for one team,
# far from the whole fleet.
NEW_TENANT_LIMITS: dict[str, int | None] = dict(
    requests_per_min=600, input_tokens_per_min=2_000_000, output_tokens_per_min=500_000, concurrent_requests=64,
    tokens_per_day=100_000_000, batch_queue_tokens=50_000_000, concurrent_fine_tunes=4)


class ApiSettings(Section):
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # A listener of its own for /admin (unset: /admin on the API's port, behind admin keys).
    # Set, /admin answers only there and the API's port answers it 404, so the admin API
    # can stay on a private interface while /v1 faces the world.
    admin_port: int | None = Field(None, ge=1, le=65535)
    admin_host: str = "127.0.0.1"

    # How long an API process trusts what it looked up about a key: a revoked key stops
    # working within this bound and the query that finds it (at once in the process that
    # revoked it); a known key is asked again from then on while its answer still serves,
    # for up to twice this bound.
    key_cache_s: float = Field(5.0, ge=0)
    # /openapi.json, /docs and /redoc, open to anyone who reaches the API: they list every
    # route, the admin API's too, so they are served only where this says so.
    api_docs: bool = False

    # The largest bodies accepted: an upload, any other request (chat, batch create).
    max_upload_bytes: int = 200 * 1024 * 1024
    max_request_bytes: int = 1024 * 1024  # any other request body (chat, batch create)
    max_batch_lines: int = 50_000
    # A request body that stops arriving for this long is answered 408 (a client trickling
    # bytes holds a connection, and what it sent so far, for as long as it likes otherwise).
    request_read_timeout_s: float = Field(30.0, gt=0)

    # Admission (api/services/admission.py, policy/admission.py): decisions from a local view of
    # usage, re-read every admission_refresh_s (the reconciler folds the ledger as often);
    # reserve rows written every admission_flush_s; the reservations of a process not
    # seen for admission_holder_ttl_s expire. "sync": one transaction per decision (the
    # baseline: exact, a database round trip per request). A tier is shed once a
    # tenant's usage reaches its fraction of a limit: flex first, then default.
    admission_mode: Literal["local", "sync"] = "local"
    admission_refresh_s: float = Field(1.0, gt=0)
    admission_flush_s: float = Field(0.1, gt=0)
    admission_holder_ttl_s: float = Field(30.0, gt=0)
    admission_headroom_priority: float = Field(1.0, gt=0, le=1)
    admission_headroom_default: float = Field(0.95, gt=0, le=1)
    admission_headroom_flex: float = Field(0.8, gt=0, le=1)
    # Cost-aware flex: a flex request for a model whose engines are all busy is served by
    # the smaller model named here where that one's are not (JSON, model → model, e.g.
    # {"llama-70b": "llama-8b"}); the response's `model` and its
    # `x-ballast-downgraded-from` header say so. A model not named is shed (429) as before.
    flex_downgrade: dict[str, str] = Field(default_factory=dict)

    # The limits every tenant gets when it is created (the admin API, `ballast tenants
    # create`), for all its models ('*'), so that no new tenant may take the whole fleet; an
    # operator then raises or clears them per tenant. JSON, e.g. {"requests_per_min": 60};
    # a dimension left out or null is unlimited ({}: a new tenant has no limits).
    new_tenant_limits: dict[str, int | None] = Field(default_factory=lambda: dict(NEW_TENANT_LIMITS))

    # Interactive requests are journaled by the window (api/services/settlement.py): each
    # API process hands the requests that ended in the last settle_window_s (at most
    # settle_window_max of them) to one workflow, 2 Temporal actions for the lot. Longer
    # windows cost fewer actions; a request's journal row and ledger settle come this much later.
    # A window is one workflow input: 2,000 requests are about 1 MB, half Temporal's 2 MB cap.
    settle_window_s: float = Field(1.0, gt=0, le=60)
    settle_window_max: int = Field(500, ge=1, le=2000)

    # A request an engine served this long ago that no API reported (its process died
    # mid-stream) is journaled and settled from the engine's record (journal/served.py).
    unreported_after_s: float = Field(60.0, gt=0)

    # What one tenant may keep in the file store (/v1/files): how many files and how many
    # bytes in all, counting its uploads and the output files its batches and fine-tuning
    # jobs wrote (which are always written; past either limit, uploads are refused until it
    # deletes files or they expire).
    max_files_per_tenant: int = Field(10_000, ge=1)
    max_file_bytes_per_tenant: int = Field(100 * 1024**3, ge=1)

    @field_validator("new_tenant_limits")
    @classmethod
    def _known_limits(cls, v: dict[str, int | None]) -> dict[str, int | None]:
        for name, n in v.items():
            if name not in LIMITS:
                raise ValueError(f"{name!r} is not a limit; limits are {', '.join(LIMITS)}")
            if n is not None and n < 0:
                raise ValueError(f"{name} is {n}: a limit is a non-negative number, or null for none")
        return v

    @field_validator("flex_downgrade")
    @classmethod
    def _no_loops(cls, v: dict[str, str]) -> dict[str, str]:
        for big, small in v.items():
            if big == small:
                raise ValueError(f"BALLAST_FLEX_DOWNGRADE sends {big!r} to itself: name a smaller model")
        return v

    @model_validator(mode="after")
    def _headroom_order(self) -> ApiSettings:
        if not (self.admission_headroom_flex <= self.admission_headroom_default <= self.admission_headroom_priority):
            raise ValueError("BALLAST_ADMISSION_HEADROOM_FLEX <= _DEFAULT <= _PRIORITY must hold: tiers shed flex "
                             "first, priority last")
        return self

    @property
    def admission_staleness_s(self) -> float:
        """How late one API process may see another's admissions: the overshoot bound's S
        (2 × flush + 3 × refresh: policy/admission.py)."""
        return staleness_s(self.admission_flush_s, self.admission_refresh_s)
