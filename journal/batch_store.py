"""Files, batches and their items: the journal operations the API and activities share.

Every write is an event (`journal.events.append`); reads go to the read models.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    cast,
    exists,
    func,
    literal,
    or_,
    select,
    text,
    tuple_,
)
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from journal.events import Event, NewEvent, append, append_one
from journal.finetune_store import FINAL as FINE_TUNE_FINAL
from journal.leases import acquire_many
from journal.schema import batch_items, batches, events, files, fine_tuning_jobs
from policy.lifecycle import can_move
from protocol import keys
from protocol.events import EventType, ItemCompleted, ItemFailed
from storage.objects import ObjectStore

log = logging.getLogger(__name__)

PREFIX_SORT_CHARS = 16_384  # of a prompt, to cluster a page by: a 4k-token system prompt


def stable_id(prefix: str, *parts: object, n: int = 24) -> str:
    """An id derived from its parts, so a retried writer produces the same one."""
    return prefix + hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:n]




# -- files --------------------------------------------------------------------------
#
# A file's row is the projection of its stream's events: `file_created` (the row, its
# payload what it has always been), `file_expires` (when it stops being served: a fact of
# its own, so that no payload of an existing type changes) and `file_deleted` (the row
# goes; whoever deleted it removes the object). The two newer types are projected here,
# beside the only code that writes them.
# A batch in one of these still reads its input file (the `batches_open_input` index's).
OPEN_BATCH = ("validating", "in_progress", "finalizing", "cancelling")
_OPEN_BATCH_SQL = f"status IN ({', '.join(repr(s) for s in OPEN_BATCH)})"  # as the index states it



async def create_file(conn: AsyncConnection, row: dict[str, Any], expires_at: int | None = None) -> None:
    """Journal the file's row (`row`: the `files` columns but `expires_at`), and when it
    expires if it does."""
    stream = keys.file_stream(row["id"])
    new = [NewEvent(stream, EventType.FILE_CREATED, row, f"{stream}:created", row["tenant"])]
    if expires_at is not None:
        new.append(NewEvent(stream, EventType.FILE_EXPIRES, dict(id=row["id"], expires_at=int(expires_at)),
                            f"{stream}:expires", row["tenant"]))
    await append(conn, new)


def _live(now: float) -> ColumnElement[bool]:
    """Not expired at `now`: an expired file is answered as a deleted one until the sweep
    removes it."""
    return or_(files.c.expires_at.is_(None), files.c.expires_at > int(now))


async def get_file(conn: AsyncConnection, file_id: str, tenant: str, *, now: float | None = None,
                   lock: bool = False) -> dict[str, Any] | None:
    """The tenant's file; with `now`, only if it has not expired by then (what a tenant may
    see: the work that already holds a file reads it without). `lock`: FOR KEY SHARE, so that
    no DELETE removes it before the caller's transaction ends (a batch being created on it)."""
    q = select(files).where(files.c.id == file_id, files.c.tenant == tenant)
    if now is not None:
        q = q.where(_live(now))
    if lock:
        q = q.with_for_update(read=True, key_share=True)
    row = (await conn.execute(q)).first()
    return dict(row._mapping) if row else None


async def list_files(conn: AsyncConnection, tenant: str, *, now: float, limit: int, after: str | None = None,
                     order: Literal["asc", "desc"] = "desc", purpose: str | None = None) -> list[dict[str, Any]]:
    """The tenant's live files by (created_at, id), after the cursor `after`.

    The cursor is found by its `file_created` event, so a file deleted or expired since the
    page that named it still places the next one (a client deleting what it lists pages on);
    another tenant's id, or an unknown one, pages like the end of the list.
    """
    q = select(files).where(files.c.tenant == tenant, _live(now))
    if purpose is not None:
        q = q.where(files.c.purpose == purpose)
    if after is not None:
        created = (
            select(cast(events.c.payload["created_at"].astext, BigInteger))
            .where(events.c.idempotency_key == f"{keys.file_stream(after)}:created", events.c.tenant == tenant,
                   events.c.type == EventType.FILE_CREATED)
            .scalar_subquery()
        )
        here, cursor = tuple_(files.c.created_at, files.c.id), tuple_(created, literal(after))
        q = q.where(here < cursor if order == "desc" else here > cursor)
    if order == "desc":
        q = q.order_by(files.c.created_at.desc(), files.c.id.desc())
    else:
        q = q.order_by(files.c.created_at, files.c.id)
    return [dict(r._mapping) for r in (await conn.execute(q.limit(limit))).all()]


async def lock_tenant_files(conn: AsyncConnection, tenant: str) -> None:
    """Serialise the tenant's storage quota decisions until the transaction ends: two
    uploads cannot both take its last file or its last bytes."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended('ballast.files:' || :t, 0))"),
                       dict(t=tenant))


async def storage_used(conn: AsyncConnection, tenant: str, now: float) -> tuple[int, int]:
    """(files, bytes) the tenant keeps: every live file, uploads and the files its batches and
    fine-tuning jobs wrote alike."""
    q = select(func.count(), func.coalesce(func.sum(files.c.bytes), 0)).where(files.c.tenant == tenant, _live(now))
    n, size = (await conn.execute(q)).one()
    return int(n), int(size)


def _open_batch_reads(file_id: Any, tenant: Any):
    return (select(batches.c.id, batches.c.status)
            .where(batches.c.input_file_id == file_id, batches.c.tenant == tenant, text(_OPEN_BATCH_SQL)))


def _unfinished_job_reads(file_id: Any, tenant: Any):
    return (select(fine_tuning_jobs.c.id, fine_tuning_jobs.c.status)
            .where(fine_tuning_jobs.c.tenant == tenant, fine_tuning_jobs.c.status.not_in(FINE_TUNE_FINAL),
                   or_(fine_tuning_jobs.c.training_file == file_id, fine_tuning_jobs.c.validation_file == file_id)))


async def file_user(conn: AsyncConnection, file_id: str, tenant: str) -> str | None:
    """What still needs the file: a batch not yet ended that reads it as its input, or a
    fine-tuning job not yet finished that trains or validates on it (as "batch batch_… (in_progress)");
    None when nothing does."""
    for what, q in (("batch", _open_batch_reads(file_id, tenant)),
                    ("fine-tuning job", _unfinished_job_reads(file_id, tenant))):
        row = (await conn.execute(q.limit(1))).first()
        if row is not None:
            return f"{what} {row.id} ({row.status})"
    return None


class FileInUse(Exception):
    def __init__(self, file_id: str, user: str):
        super().__init__(f"file {file_id} is still needed by {user}")
        self.file_id, self.user = file_id, user


async def delete_file(conn: AsyncConnection, file_id: str, tenant: str, now: float) -> dict[str, Any] | None:
    """Journal the deletion of the tenant's live file and return its row (whose object the
    caller removes once this commits: a row never points at an object already gone); None
    where there is no such file. Raises FileInUse where an open batch or an unfinished
    fine-tuning job still needs it.

    Call inside a transaction: the row lock orders it against a batch being created on the
    file (which holds it FOR KEY SHARE) and against another deletion.
    """
    q = select(files).where(files.c.id == file_id, files.c.tenant == tenant, _live(now)).with_for_update()
    found = (await conn.execute(q)).first()
    if found is None:
        return None
    if (user := await file_user(conn, file_id, tenant)) is not None:
        raise FileInUse(file_id, user)
    row = dict(found._mapping)
    await forget_files(conn, [row], "deleted")
    return row


async def forget_files(conn: AsyncConnection, rows: Sequence[dict[str, Any]], reason: str) -> None:
    """Journal that these files are gone (their rows go with the events)."""
    await append(conn, [NewEvent(keys.file_stream(r["id"]), EventType.FILE_DELETED, dict(id=r["id"], reason=reason),
                                 f"{keys.file_stream(r['id'])}:deleted", r["tenant"]) for r in rows])


async def expired_files(conn: AsyncConnection, now: float, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` files expired at `now` that nothing still needs (see file_user: those
    wait until their batch or job ends), locked until the transaction ends. Rows another
    sweep holds are skipped, so sweeps may run side by side."""
    q = (
        select(files)
        .where(files.c.expires_at <= int(now),
               ~exists(_open_batch_reads(files.c.id, files.c.tenant)),
               ~exists(_unfinished_job_reads(files.c.id, files.c.tenant)))
        .order_by(files.c.expires_at)
        .limit(limit)
        .with_for_update(of=files, skip_locked=True)
    )
    return [dict(r._mapping) for r in (await conn.execute(q)).all()]


async def expire_files(conn: AsyncConnection, now: float, limit: int = 500) -> list[str]:
    """Delete up to `limit` expired rows (as expired_files picks them) and return their
    object keys, for the caller to remove (ObjectStore.delete) before it commits: a crash in
    between leaves rows that are expired, so invisible, and the next sweep finishes them.
    Idempotent: what it deleted is not found again."""
    rows = await expired_files(conn, now, limit)
    await forget_files(conn, rows, "expired")
    return [r["object_key"] for r in rows]


async def sweep_expired_files(db: AsyncEngine, store: ObjectStore, *, now: float | None = None, page: int = 500,
                              most: int = 5000) -> int:
    """Remove expired files, rows and objects, `page` per transaction and at most `most` a
    call (the next call takes the rest); returns how many. Idempotent, and safe to run in
    several processes at once. Meant for a periodic caller (the control worker's)."""
    done = 0
    while done < most:
        async with db.begin() as conn:
            object_keys = await expire_files(conn, time.time() if now is None else now, min(page, most - done))
            if not object_keys:
                break
            # Objects first, rows when this commits: see expire_files.
            await asyncio.to_thread(store.delete, object_keys)
        done += len(object_keys)
        if len(object_keys) < page:
            break
    if done:
        log.info("removed %d expired files", done)
    return done


# -- batches ------------------------------------------------------------------------


async def create_batch(conn: AsyncConnection, row: dict[str, Any], output_expires_after: int | None = None,
                       model: str | None = None) -> None:
    """Journal the batch; `output_expires_after`: seconds its output and error files live
    once written (None: until deleted); `model`: the model it runs."""
    stream = keys.batch(row["id"])
    new = [NewEvent(stream, EventType.BATCH_CREATED, row, f"{stream}:created", row["tenant"])]
    if model is not None:
        new.append(NewEvent(stream, EventType.BATCH_MODEL, dict(batch_id=row["id"], model=model),
                            f"{stream}:model", row["tenant"]))
    if output_expires_after is not None:
        new.append(NewEvent(stream, EventType.BATCH_OUTPUT_EXPIRY,
                            dict(batch_id=row["id"], seconds=int(output_expires_after)),
                            f"{stream}:output_expiry", row["tenant"]))
    await append(conn, new)


async def output_expiry(conn: AsyncConnection, batch_id: str) -> int | None:
    """Seconds the batch's output and error files live once written; None: until deleted."""
    q = select(events.c.payload).where(events.c.idempotency_key == f"{keys.batch(batch_id)}:output_expiry")
    payload = (await conn.execute(q)).scalar_one_or_none()
    return None if payload is None else int(payload["seconds"])


async def get_batch(conn: AsyncConnection, batch_id: str, tenant: str | None = None, *,
                    lock: bool = False) -> dict[str, Any] | None:
    q = select(batches).where(batches.c.id == batch_id)
    if tenant is not None:
        q = q.where(batches.c.tenant == tenant)
    if lock:
        q = q.with_for_update()
    row = (await conn.execute(q)).first()
    return dict(row._mapping) if row else None


async def list_batches(conn: AsyncConnection, tenant: str, after: str | None, limit: int) -> list[dict[str, Any]]:
    q = select(batches).where(batches.c.tenant == tenant)
    if after is not None:
        # The cursor is the tenant's own batch or none: another tenant's id pages like an unknown one.
        cursor = select(batches.c.seq).where(batches.c.id == after, batches.c.tenant == tenant).scalar_subquery()
        q = q.where(batches.c.seq < cursor)
    q = q.order_by(batches.c.seq.desc()).limit(limit)
    return [dict(r._mapping) for r in (await conn.execute(q)).all()]


async def request_counts(conn: AsyncConnection, batch_id: str) -> dict[str, int]:
    return (await progress(conn, batch_id)).request_counts()


@dataclass(frozen=True)
class Progress:
    """A batch's items so far, in one read of them: OpenAI's `request_counts`, how often
    they yielded to interactive work, and the tokens of those completed (OpenAI's `usage`)."""

    total: int = 0
    completed: int = 0
    failed: int = 0
    preemptions: int = 0  # times its items yielded to interactive work
    items_preempted: int = 0
    input_tokens: int = 0  # of the completed items, from their responses' usage
    output_tokens: int = 0
    cached_tokens: int = 0  # of input_tokens, served from the prefix cache

    def request_counts(self) -> dict[str, int]:
        return dict(total=self.total, completed=self.completed, failed=self.failed)


async def progress(conn: AsyncConnection, batch_id: str) -> Progress:
    i = batch_items.c
    q = select(func.count(), func.count().filter(i.status == "completed"), func.count().filter(i.status == "failed"),
               func.coalesce(func.sum(i.preemptions), 0), func.count().filter(i.preemptions > 0),
               func.coalesce(func.sum(i.input_tokens), 0), func.coalesce(func.sum(i.output_tokens), 0),
               func.coalesce(func.sum(i.cached_tokens), 0))
    return Progress(*(int(n) for n in (await conn.execute(q.where(i.batch_id == batch_id))).one()))


async def move_status(conn: AsyncConnection, batch_id: str, status: str, at: float, **fields: Any) -> bool:
    """Move the batch to `status` if the lifecycle allows it from where it is now.

    Call inside a transaction: the row lock orders racing writers.
    """
    current = await get_batch(conn, batch_id, lock=True)
    if current is None:
        raise LookupError(f"no batch {batch_id}")
    if current["status"] == status:
        return True  # a retried writer
    if not can_move(current["status"], status):
        return False
    payload = dict(batch_id=batch_id, status=status, at=int(at), **fields)
    stream = keys.batch(batch_id)
    await append_one(conn, NewEvent(stream, EventType.BATCH_STATUS, payload, f"{stream}:status:{status}",
                                    current["tenant"]))
    return True


# -- items --------------------------------------------------------------------------


async def add_items(conn: AsyncConnection, batch_id: str, tenant: str, items: Sequence[Any]) -> None:
    """Journal the parsed requests; those invalid on their own fail right away."""
    new = [
        NewEvent(keys.item(batch_id, it.idx), EventType.ITEM_CREATED,
                 dict(batch_id=batch_id, idx=it.idx, line=it.line, custom_id=it.custom_id, body=it.body,
                      **({"body_json": it.body_json} if it.body_json is not None else {})),
                 f"{keys.item(batch_id, it.idx)}:created", tenant)
        for it in items
    ]
    invalid = [it for it in items if it.error is not None]
    # A result is an attempt's last word, and the database takes none without a fence:
    # validation is this item's one attempt, under a lease of its own.
    streams = [keys.item(batch_id, it.idx) for it in invalid]
    fences = await acquire_many(conn, streams, "validation") if streams else {}
    new += [
        item_failed_event(batch_id, it.idx, tenant, it.error.status_code, it.error.body(),
                          fence=fences[keys.item(batch_id, it.idx)])
        for it in invalid
    ]
    await append(conn, new)


def result_key(stream: str) -> str:
    """One key for an item's result, whichever it is: a second, different result for the
    same item is an idempotency conflict, never a silent second answer."""
    return f"{stream}:result"


def item_completed_event(batch_id: str, idx: int, tenant: str, body: dict[str, Any],
                         fence: int | None = None) -> NewEvent:
    s = keys.item(batch_id, idx)
    done = ItemCompleted(batch_id, idx, body_json(body))
    return NewEvent(s, EventType.ITEM_COMPLETED, asdict(done), result_key(s), tenant, fence=fence)


def item_failed_event(batch_id: str, idx: int, tenant: str, status_code: int, body: dict[str, Any],
                      fence: int | None = None) -> NewEvent:
    s = keys.item(batch_id, idx)
    failed = ItemFailed(batch_id, idx, status_code, body_json(body))
    return NewEvent(s, EventType.ITEM_FAILED, asdict(failed), result_key(s), tenant, fence=fence)


def body_json(body: dict[str, Any]) -> str:
    """A response body kept as JSON text inside the event: generated text may hold NUL,
    which a JSONB string cannot, and the text keeps the body's key order."""
    return json.dumps(body, ensure_ascii=False)


async def get_item(conn: AsyncConnection, batch_id: str, idx: int) -> dict[str, Any] | None:
    q = select(batch_items).where(batch_items.c.batch_id == batch_id, batch_items.c.idx == idx)
    row = (await conn.execute(q)).first()
    return dict(row._mapping) if row else None


async def load_for_generation(conn: AsyncConnection, batch_id: str,
                              idxs: Sequence[int]) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The batch, and each item with `choices`: for each of its choices that earlier
    attempts journaled tokens of, those tokens and their `logprobs` (each token's
    alternatives, where the request asked for them)."""
    batch = await get_batch(conn, batch_id)
    if batch is None:
        raise LookupError(f"no batch {batch_id}")
    q = select(batch_items).where(batch_items.c.batch_id == batch_id, batch_items.c.idx.in_(idxs))
    items: dict[int, dict[str, Any]] = {r.idx: dict(r._mapping, choices={}) for r in (await conn.execute(q)).all()}
    for it in items.values():
        if it["body_json"] is not None:  # as written: its keys in the order given
            it["body"] = json.loads(it["body_json"])
    missing = set(idxs) - set(items)
    if missing:
        raise LookupError(f"batch {batch_id} has no items {sorted(missing)}")
    streams = [keys.item(batch_id, i) for i, it in items.items() if it["status"] == "pending"]
    if streams:
        q = select(events.c.payload).where(events.c.stream.in_(streams), events.c.type == EventType.ITEM_CHUNK)
        chunks: dict[tuple[int, int], list[dict]] = {}
        for (p,) in (await conn.execute(q)).all():
            chunks.setdefault((p["idx"], p.get("choice", 0)), []).append(p)
        for (i, choice), cs in chunks.items():
            items[i]["choices"][choice] = journaled(cs)
    return batch, items


def journaled(chunks: Sequence[dict[str, Any]]) -> tuple[list[int], list[Any]]:
    """One choice's contiguous run of checkpointed tokens from offset 0, and their
    logprobs (one entry per token where the chunks carry them)."""
    tokens: list[int] = []
    logprobs: list[Any] = []
    for c in sorted(chunks, key=lambda c: c["offset"]):
        if c["offset"] != len(tokens):
            break  # a gap (a commit that failed): what follows is regenerated
        tokens += c["token_ids"]
        logprobs += c.get("logprobs") or []
    return tokens, logprobs


async def pending_items(conn: AsyncConnection, batch_id: str, after_idx: int, limit: int) -> list[int]:
    """The next `limit` pending items after `after_idx`, ordered by their prompts' text
    (bytewise, then by index): items sharing a prefix come out side by side, so the
    workflow's groups (one engine worker each) hold them together and vLLM's prefix cache
    serves the shared part to all but the first."""
    return [idx for idx, _ in await pending_page(conn, batch_id, after_idx, limit, 0)]


async def pending_page(conn: AsyncConnection, batch_id: str, after_idx: int, limit: int,
                       head_chars: int) -> list[tuple[int, str]]:
    """As pending_items, with the first `head_chars` characters of each prompt's text."""
    page = (
        select(batch_items.c.idx, batch_items.c.body)
        .where(batch_items.c.batch_id == batch_id, batch_items.c.status == "pending", batch_items.c.idx > after_idx)
        .order_by(batch_items.c.idx)
        .limit(limit)
        .subquery()
    )
    whole = func.coalesce(page.c.body["messages"].astext, page.c.body["prompt"].astext, "")
    prompt = func.left(whole, PREFIX_SORT_CHARS)
    q = select(page.c.idx, func.left(whole, head_chars)).order_by(prompt.collate("C"), page.c.idx)
    return [(idx, head) for idx, head in (await conn.execute(q)).all()]


async def results(conn: AsyncConnection, batch_id: str) -> AsyncIterator[tuple[dict[str, Any], Event | None]]:
    """Every item in input order with the event that settled it (None: never ran)."""
    q = (
        select(batch_items, events.c.type.label("ev_type"), events.c.payload.label("ev_payload"))
        .select_from(batch_items.outerjoin(events, events.c.position == batch_items.c.result_position))
        .where(batch_items.c.batch_id == batch_id)
        .order_by(batch_items.c.idx)
    )
    result = await conn.stream(q.execution_options(yield_per=2000))
    async for r in result:
        m = dict(r._mapping)
        ev = None
        if m["result_position"] is not None:
            ev = Event(m["result_position"], keys.item(batch_id, m["idx"]), 0, m.pop("ev_type"),
                       m.pop("ev_payload"), "", "")
        yield m, ev
