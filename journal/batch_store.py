"""Files, batches and their items: the journal operations the API and activities share.

Every write is an event (`journal.events.append`); reads go to the read models.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from journal.events import Event, NewEvent, append, append_one
from journal.leases import acquire_many
from journal.schema import batch_items, batches, events, files
from policy.lifecycle import can_move
from protocol import keys
from protocol.events import EventType, ItemCompleted, ItemFailed

PREFIX_SORT_CHARS = 16_384  # of a prompt, to cluster a page by: a 4k-token system prompt


def stable_id(prefix: str, *parts: object, n: int = 24) -> str:
    """An id derived from its parts, so a retried writer produces the same one."""
    return prefix + hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:n]




# -- files --------------------------------------------------------------------------


async def create_file(conn: AsyncConnection, row: dict[str, Any]) -> None:
    stream = keys.file_stream(row["id"])
    await append_one(conn, NewEvent(stream, EventType.FILE_CREATED, row, f"{stream}:created", row["tenant"]))


async def get_file(conn: AsyncConnection, file_id: str, tenant: str) -> dict[str, Any] | None:
    row = (await conn.execute(select(files).where(files.c.id == file_id, files.c.tenant == tenant))).first()
    return dict(row._mapping) if row else None


# -- batches ------------------------------------------------------------------------


async def create_batch(conn: AsyncConnection, row: dict[str, Any]) -> None:
    stream = keys.batch(row["id"])
    await append_one(conn, NewEvent(stream, EventType.BATCH_CREATED, row, f"{stream}:created", row["tenant"]))


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
    q = (select(batch_items.c.status, func.count()).where(batch_items.c.batch_id == batch_id)
         .group_by(batch_items.c.status))
    by_status: dict[str, int] = dict((await conn.execute(q)).all())
    return dict(
        total=sum(by_status.values()),
        completed=by_status.get("completed", 0),
        failed=by_status.get("failed", 0),
    )


async def preemptions(conn: AsyncConnection, batch_id: str) -> dict[str, int]:
    """How often the batch's items yielded to interactive work, and how many did."""
    q = select(func.coalesce(func.sum(batch_items.c.preemptions), 0),
               func.count().filter(batch_items.c.preemptions > 0))
    total, items = (await conn.execute(q.where(batch_items.c.batch_id == batch_id))).one()
    return dict(preemptions=int(total), items_preempted=int(items))


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
                 dict(batch_id=batch_id, idx=it.idx, line=it.line, custom_id=it.custom_id, body=it.body),
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
    """The batch, and each item with `tokens`: what its earlier attempts journaled."""
    batch = await get_batch(conn, batch_id)
    if batch is None:
        raise LookupError(f"no batch {batch_id}")
    q = select(batch_items).where(batch_items.c.batch_id == batch_id, batch_items.c.idx.in_(idxs))
    items = {r.idx: dict(r._mapping, tokens=[]) for r in (await conn.execute(q)).all()}
    missing = set(idxs) - set(items)
    if missing:
        raise LookupError(f"batch {batch_id} has no items {sorted(missing)}")
    streams = [keys.item(batch_id, i) for i, it in items.items() if it["status"] == "pending"]
    if streams:
        q = select(events.c.payload).where(events.c.stream.in_(streams), events.c.type == EventType.ITEM_CHUNK)
        chunks: dict[int, list[dict]] = {}
        for (p,) in (await conn.execute(q)).all():
            chunks.setdefault(p["idx"], []).append(p)
        for i, cs in chunks.items():
            items[i]["tokens"] = journaled_tokens(cs)
    return batch, items


def journaled_tokens(chunks: Sequence[dict[str, Any]]) -> list[int]:
    """The contiguous run of checkpointed tokens from offset 0."""
    tokens: list[int] = []
    for c in sorted(chunks, key=lambda c: c["offset"]):
        if c["offset"] != len(tokens):
            break  # a gap (a commit that failed): what follows is regenerated
        tokens += c["token_ids"]
    return tokens


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
