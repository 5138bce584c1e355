"""Every type of event the journal holds, and what its payload carries. Projections,
audits, invariants and the database's fencing trigger (migration 0011) all go by these
names; `SELECT type, count(*) FROM events GROUP BY 1` lists them."""

from __future__ import annotations

from enum import StrEnum


class EventType(StrEnum):
    # Files and batches (journal/batch_store.py), each projected into its read model.
    FILE_CREATED = "file_created"  # the `files` row
    BATCH_CREATED = "batch_created"  # the `batches` row
    BATCH_STATUS = "batch_status"  # batch_id, status, at, and the fields that status sets
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
    # The fleet controller (workflows/fleet.py).
    SURGE_STARTED = "surge_started"  # pressure, engines, caps
    SURGE_ENDED = "surge_ended"
