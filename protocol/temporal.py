"""The dataclasses that cross Temporal: one input per workflow and per activity.

Fields may be added with defaults (old histories still decode); never repurposed.
Nothing large travels here: ids and offsets only, payloads stay in the journal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from protocol.fleet import Surge, SurgePolicy

BatchOutcome = Literal["completed", "cancelled", "expired", "failed"]
ItemStatus = Literal["completed", "failed", "preempted", "superseded"]
RequestStatus = Literal["completed", "cancelled", "failed", "abandoned"]


@dataclass
class BatchInput:
    batch_id: str
    expires_at: float  # unix seconds: completion_window ends here
    engine_queue: str
    concurrency: int = 256
    heartbeat_timeout_s: float = 10.0
    items_per_run: int = 1000  # then continue-as-new: keeps each history a few thousand events
    group_size: int = 16  # items per generation activity
    # Whose batch: engine queues interleave tenants' generations by weight (fairness keys).
    tenant: str = "default"
    fairness_weight: float = 1.0
    # A fenced tenant's batch: the other regions' queues of its geography, taken in turn
    # when a group waits `spill_after_s` with no engine worker claiming it (its region is
    # down, draining or full), so work spills inside the fence and never outside it.
    spill_queues: list[str] = field(default_factory=list)
    spill_after_s: float = 30.0
    # Groups that share a prefix go to one engine worker's own queue (policy/grouping.py);
    # one it leaves unclaimed this long goes to the shared queue. 0: no such groups.
    sticky_wait_s: float = 0.0
    # The model its lines name (its pool's queue is `engine_queue`); "": the control
    # worker's own model (a batch from before pools).
    model: str = ""
    # Its generations' Temporal priority: a shorter completion window's go first (policy/promises.py).
    priority_key: int = 4
    # Carried across continue-as-new.
    validated: bool = False
    after_idx: int = -1
    cancel_requested: bool = False


@dataclass
class ValidateInput:
    batch_id: str
    model: str = ""  # the batch's model ("": the control worker's own)


@dataclass
class ValidateResult:
    total: int
    failed: bool  # the file itself is invalid; errors are on the batch


@dataclass
class PendingInput:
    batch_id: str
    after_idx: int
    limit: int
    # The queue the batch runs on now: its page comes back as a Page, items placed on the
    # engine workers of that queue. "": a bare list of indices (before sticky groups).
    queue: str = ""


@dataclass
class Page:
    """The next pending items, clustered by prompt, with where each run of them goes:
    `runs` (count, queue) cover `idxs` in order; queue "" is the batch's own."""
    idxs: list[int]
    runs: list[tuple[int, str]]


@dataclass
class FinalizeInput:
    batch_id: str
    status: BatchOutcome
    at: float


@dataclass
class FailBatchInput:
    batch_id: str
    code: str
    message: str


@dataclass
class GenerateInput:
    batch_id: str
    idxs: list[int]


@dataclass
class FailItemInput:
    batch_id: str
    idx: int
    message: str
    code: str = "internal_error"
    status_code: int = 500


@dataclass
class GenerateResult:
    # superseded: a newer attempt holds the item's lease (this one is a zombie)
    status: ItemStatus
    idx: int = -1
    tokens: int = 0
    resumed_from: int = 0  # tokens already in the journal when this attempt began


@dataclass
class InteractiveInput:
    request_id: str
    tenant: str
    tier: str  # the service tier served: priority | default | flex
    model: str
    endpoint: str
    engine_id: str
    prompt_tokens: int
    # The admission's reservation (api/services/admission.py), for the ledger rows the journaling
    # transaction writes: None where the request was not admitted through one.
    reserved_input: int | None = None
    reserved_output: int | None = None
    holder: str | None = None  # the admitting process
    admitted_at: float | None = None  # unix seconds: the reservation's window
    http_request_id: str | None = None  # the HTTP request's x-request-id (api/request_ids.py)
    downgraded_from: str | None = None  # the model asked, where a flex request was served by a smaller one
    # How it ended: the API starts the workflow once the request has ended. None: a
    # workflow an older API started mid-stream, whose outcome comes by the `finished` signal.
    outcome: RequestOutcome | None = None


@dataclass
class RequestOutcome:
    status: RequestStatus
    completion_tokens: int = 0
    finish_reason: str | None = None
    ttft_ms: float | None = None  # as the API saw it: request received → first token out
    engine_ttft_ms: float | None = None  # as the engine worker saw it: request in → first token


@dataclass
class RequestWindowInput:
    """The interactive requests one API process saw end in one window (api/services/
    settlement.py), each with its outcome: journaled together by one workflow."""

    holder: str  # the API process (its admission holder)
    requests: list[InteractiveInput]


@dataclass
class JournalRequestInput:
    request: InteractiveInput
    outcome: RequestOutcome


@dataclass
class FleetInput:
    """The fleet controller's settings, and its state carried across continue-as-new."""

    policy: SurgePolicy = field(default_factory=SurgePolicy)
    tick_s: float = 1.0
    stale_s: float = 5.0  # an engine silent this long has left the fleet
    ticks_per_run: int = 300  # then continue-as-new (~10 history events per tick)
    pools: dict[str, Surge] = field(default_factory=dict)
    members: list[str] = field(default_factory=list)


@dataclass
class ObserveFleetInput:
    stale_s: float


@dataclass
class FleetEvent:
    stream: str
    type: str
    payload: dict[str, Any]
    key: str  # idempotency key: a retried apply journals nothing twice


@dataclass
class ApplyFleetInput:
    caps: list[tuple[str, int | None]]  # (engine id, batch cap; None lifts the fleet's cap)
    events: list[FleetEvent]


@dataclass
class QuotaInput:
    """The quota reconciler's settings (workflows/quota.py)."""

    tick_s: float = 1.0
    holder_ttl_s: float = 30.0  # an admitting process not seen this long: its reservations expire
    ticks_per_run: int = 300  # then continue-as-new (a handful of history events per tick)


@dataclass
class ReconcileInput:
    holder_ttl_s: float
    tick_s: float = 1.0  # the period it runs at: a tick taking half of it is logged


@dataclass
class ReconcileResult:
    rows: int  # quota_usage rows written
    expired: int  # reservations expired


@dataclass
class FineTuneInput:
    job_id: str
    engine_queue: str  # where training chunks run (engine workers poll it)
    chunk_steps: int = 10  # optimizer steps per chunk at least: one checkpoint each
    heartbeat_timeout_s: float = 30.0
    chunks_per_run: int = 100  # then continue-as-new: a long job's history stays small
    tenant: str = "default"
    fairness_weight: float = 1.0
    checkpoint_overhead: float = 0.0  # see TrainChunkInput.max_overhead
    chunk_max_s: float = 300.0
    # Carried across continue-as-new.
    validated: bool = False
    paused: bool = False
    cancel_requested: bool = False


@dataclass
class FineTuneRef:
    job_id: str


@dataclass
class ValidateTrainingResult:
    examples: int
    failed: bool  # the file is unusable: the job failed, its error says why


@dataclass
class TrainChunkInput:
    job_id: str
    steps: int  # at least this many (fewer only at the end, or when stopped)
    # More while the chunk's cost beyond its steps exceeds this share of their time (0: no more).
    max_overhead: float = 0.0
    max_chunk_s: float = 300.0  # but no longer: what a crash can lose


@dataclass
class TrainChunkResult:
    step: int  # steps done, all of them checkpointed
    total_steps: int
    done: bool
    preempted: bool = False  # stopped early for interactive work; the next chunk resumes
    # The tenant's tokens_per_day is spent: no step was trained, and the next chunk waits
    # until then (unix seconds: the next UTC day).
    wait_until: float | None = None


@dataclass
class FineTuneStatusInput:
    job_id: str
    status: str  # running, paused, succeeded, cancelled, failed
    message: str = ""


@dataclass
class WebhookInput:
    """A job reached a terminal status: announce it to its tenant's endpoints
    (workflows/webhooks.py). `kind`: "batch" | "fine_tuning.job"."""

    kind: str
    job_id: str


@dataclass
class WebhookPlan:
    """The event raised (none where no endpoint of the tenant subscribes to it), where it
    goes, and how the control worker's settings say to retry each delivery."""

    event_id: str = ""
    endpoints: list[str] = field(default_factory=list)
    initial_interval_s: float = 1.0
    max_interval_s: float = 300.0
    give_up_after_s: float = 3 * 86400.0
    attempt_timeout_s: float = 10.0


@dataclass
class DeliverInput:
    event_id: str
    endpoint_id: str


@dataclass
class AbandonInput:
    event_id: str
    endpoint_id: str
    reason: str
    detail: str = ""
