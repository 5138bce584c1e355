"""Every type of event the journal holds, and what its payload carries. Projections,
audits, invariants and the database's fencing trigger (migration 0011) all go by these
names; `SELECT type, count(*) FROM events GROUP BY 1` lists them."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from enum import StrEnum
from typing import Any


class EventType(StrEnum):
    # Files and batches (journal/batch_store.py), each projected into its read model.
    FILE_CREATED = "file_created"  # the `files` row
    FILE_EXPIRES = "file_expires"  # id, expires_at (unix seconds)
    FILE_DELETED = "file_deleted"  # id, reason: "deleted" (DELETE /v1/files) | "expired" (the sweep)
    BATCH_CREATED = "batch_created"  # the `batches` row
    BATCH_STATUS = "batch_status"  # batch_id, status, at, and the fields that status sets
    # Beside batch_created: how long its output and error files live once written (seconds
    # from their creation; OpenAI's `output_expires_after`). No read model: finalize reads it.
    BATCH_OUTPUT_EXPIRY = "batch_output_expiry"  # batch_id, seconds
    # Beside batch_created: the model the batch runs (its input file's first request's),
    # projected into its row. Batches created before it have none.
    BATCH_MODEL = "batch_model"  # batch_id, model
    # batch_id, window, deadline, estimated_at (None: pace not measured), ahead (output
    # tokens due no later, its own included), rate (the pace promised on, tokens a second)
    BATCH_PROMISED = "batch_promised"
    # tenant, model, slots (0: none), by (the admin key's id), at (unix seconds); projected
    # into `reservations`, the one in force: the journal keeps every change.
    RESERVATION_SET = "reservation_set"
    ITEM_CREATED = "item_created"  # batch_id, idx, custom_id, the request body
    # A generation's attempt (fenced: the database refuses them without the current lease).
    ITEM_CHUNK = "item_chunk"  # offset, token_ids: tokens generated since the last chunk
    ITEM_PREEMPTED = "item_preempted"  # batch_id, idx, offset: it yielded, every token journaled
    ITEM_COMPLETED = "item_completed"  # batch_id, idx, body_json: the response line
    ITEM_FAILED = "item_failed"  # batch_id, idx, status_code, error
    # Interactive requests.
    REQUEST_FINISHED = "request_finished"  # the request's record and outcome (its workflow)
    REQUEST_SERVED = "request_served"  # what the engine worker served (journal/served.py)
    # Fine-tuning jobs (journal/finetune_store.py).
    FT_JOB_CREATED = "ft_job_created"  # the `fine_tuning_jobs` row
    FT_STATUS = "ft_status"  # job_id, status, at, and the fields that status sets
    FT_CHECKPOINT = "ft_checkpoint"  # job_id, step, object_key, sha256, losses (fenced)
    FT_EVENT = "ft_event"  # one line of the job's /events
    FT_MODEL_DELETED = "ft_model_deleted"  # job_id, model, at: its tenant deleted the fine-tuned model
    # A tenant's content erased (journal/erasure.py): at, who asked, and what was masked.
    CONTENT_ERASED = "content_erased"
    # Completion webhooks (journal/webhook_store.py; payloads in protocol/webhooks.py), stream
    # `webhook:<event id>`: the event raised once per (job, terminal status), each delivery
    # attempt to an endpoint, and an endpoint given up on.
    WEBHOOK_EVENT = "webhook_event"
    WEBHOOK_ATTEMPT = "webhook_attempt"
    WEBHOOK_ABANDONED = "webhook_abandoned"
    # The fleet controller (workflows/fleet.py).
    SURGE_STARTED = "surge_started"  # pressure, engines, caps
    SURGE_ENDED = "surge_ended"


# -- the payloads of a batch item's events ---------------------------------------------
#
# Their keys are what the journal has always held: an append retried from newer code
# compares its payload with the row already there, so a field is never added to an event
# type once written (a new fact is a new event type). `dataclasses.asdict` writes them.


@dataclass(frozen=True)
class ItemChunk:
    """Tokens a generation produced since the item's last chunk: `token_ids` from `offset`."""

    batch_id: str
    idx: int
    offset: int
    token_ids: list[int]
    runner: str  # the attempt that wrote it (its lease holder)
    # Each token's logprob alternatives (protocol/logprobs.py), where the request asked for
    # them; left out of the payload otherwise.
    logprobs: list[Any] | None = None
    choice: int = 0  # which of the request's `n` choices (left out of the payload when 0)


@dataclass(frozen=True)
class ItemPreempted:
    batch_id: str
    idx: int
    offset: int  # tokens journaled when it yielded
    choice: int = 0  # as ItemChunk's


def choice_key(stream: str, what: str, choice: int, offset: int) -> str:
    """An item event's idempotency key: choice 0's is the key items had before `n`."""
    return f"{stream}:{what}:{offset}" if choice == 0 else f"{stream}:{what}:{choice}:{offset}"


@dataclass(frozen=True)
class ItemCompleted:
    batch_id: str
    idx: int
    body_json: str = ""  # the response body, as the JSON text the output file splices in ("": none kept)


@dataclass(frozen=True)
class ItemFailed:
    batch_id: str
    idx: int
    status_code: int
    body_json: str = ""


ItemPayload = ItemChunk | ItemPreempted | ItemCompleted | ItemFailed
_ITEM: dict[str, type[ItemChunk] | type[ItemPreempted] | type[ItemCompleted] | type[ItemFailed]] = {
    EventType.ITEM_CHUNK: ItemChunk, EventType.ITEM_PREEMPTED: ItemPreempted,
    EventType.ITEM_COMPLETED: ItemCompleted, EventType.ITEM_FAILED: ItemFailed,
}


def item_payload(type_: str, d: dict[str, Any]) -> ItemPayload:
    """A journaled item event's payload, typed (KeyError if it lacks a field that has no
    default)."""
    cls = _ITEM[type_]
    return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d or f.default is MISSING})


def chunk_payload(chunk: ItemChunk) -> dict[str, Any]:
    """What a chunk event holds: its fields, without `logprobs` where it has none (the keys
    a chunk has always had, which a retried append compares)."""
    d = asdict(chunk)
    if chunk.logprobs is None:
        del d["logprobs"]
    if chunk.choice == 0:
        del d["choice"]
    return d


def preempted_payload(yielded: ItemPreempted) -> dict[str, Any]:
    """As chunk_payload: `choice` only where it is not 0."""
    d = asdict(yielded)
    if yielded.choice == 0:
        del d["choice"]
    return d


def item_result(type_: str, d: dict[str, Any]) -> ItemCompleted | ItemFailed:
    """An item's result event's payload (ValueError for any other event)."""
    p = item_payload(type_, d)
    if not isinstance(p, ItemCompleted | ItemFailed):
        raise ValueError(f"{type_} is not an item's result")
    return p
