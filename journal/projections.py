"""Read models as projections of events, applied in the appending transaction.

Each projector handles one event type for a list of events (so a 50,000-line batch's
items project as a few bulk statements). `journal.events.rebuild` replays the whole
journal into empty read models and must give the same rows: the read models hold nothing
events do not.

One projection is not a read model: an item's result (`item_completed`, `item_failed`)
settles the item in the quota ledger, in the same transaction, whichever path journals it
(a generation's checkpoint, `fail_item`, an item refused at validation). The ledger is
append-only and its rows idempotent, so a replay adds nothing that is there already.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from itertools import groupby
from typing import TYPE_CHECKING

from sqlalchemy import bindparam, delete, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from journal import ledger
from journal.schema import batch_items, batches, files, fine_tuning_jobs, reservations
from protocol.events import EventType, ItemPayload, item_payload, item_result

if TYPE_CHECKING:
    from journal.events import Event

Projector = Callable[[AsyncConnection, Sequence["Event"]], Awaitable[None]]
_projectors: dict[str, Projector] = {}


def projects(event_type: str):
    def register(fn: Projector) -> Projector:
        _projectors[event_type] = fn
        return fn

    return register


async def project(conn: AsyncConnection, new: Sequence[Event]) -> None:
    # Consecutive runs of one type keep the journal's order between the types that have
    # read models; events without one (an item's chunks, between its neighbours' results)
    # do not split a run, so a checkpoint's results project as one statement, not one each.
    for event_type, run in groupby((e for e in new if e.type in _projectors), key=lambda e: e.type):
        fn = _projectors.get(event_type)
        if fn is not None:
            await fn(conn, list(run))


@projects(EventType.FILE_CREATED)
async def _file_created(conn, evs):
    await conn.execute(insert(files).on_conflict_do_nothing(), [e.payload for e in evs])


@projects(EventType.FILE_EXPIRES)
async def _file_expires(conn, evs):
    stmt = update(files).where(files.c.id == bindparam("b_id")).values(expires_at=bindparam("b_at"))
    await conn.execute(stmt, [dict(b_id=e.payload["id"], b_at=e.payload["expires_at"]) for e in evs])


@projects(EventType.FILE_DELETED)
async def _file_deleted(conn, evs):
    await conn.execute(delete(files).where(files.c.id.in_([e.payload["id"] for e in evs])))


@projects(EventType.BATCH_CREATED)
async def _batch_created(conn, evs):
    await conn.execute(insert(batches).on_conflict_do_nothing(), [dict(e.payload, seq=e.position) for e in evs])


@projects(EventType.BATCH_MODEL)
async def _batch_model(conn, evs):
    stmt = update(batches).where(batches.c.id == bindparam("b_id")).values(model=bindparam("b_model"))
    await conn.execute(stmt, [dict(b_id=e.payload["batch_id"], b_model=e.payload["model"]) for e in evs])


@projects(EventType.RESERVATION_SET)
async def _reservation_set(conn, evs):
    for e in evs:  # in journal order: the last change of a tenant's model wins
        p = e.payload
        region = p.get("region", "")  # changes made before regions: the whole pool
        key = ((reservations.c.tenant == p["tenant"]) & (reservations.c.model == p["model"])
               & (reservations.c.region == region))
        tokens_per_s = p.get("tokens_per_s", 0)  # changes made before tokens a second: slots
        if not p["slots"] and not tokens_per_s:
            await conn.execute(delete(reservations).where(key, reservations.c.position < e.position))
            continue
        row = dict(tenant=p["tenant"], model=p["model"], region=region, slots=p["slots"], tokens_per_s=tokens_per_s,
                   set_at=p["at"], position=e.position)
        stmt = insert(reservations).values(row)
        await conn.execute(stmt.on_conflict_do_update(
            index_elements=[reservations.c.tenant, reservations.c.model, reservations.c.region], set_=row,
            where=reservations.c.position < e.position))


# A status change carries its own timestamp (`at`) so replay reproduces it exactly.
_STATUS_FIELDS = ("errors", "output_file_id", "error_file_id")


@projects(EventType.BATCH_STATUS)
async def _batch_status(conn, evs):
    for e in evs:
        p = e.payload
        values = {"status": p["status"], f"{p['status']}_at": p["at"]}
        values.update({k: p[k] for k in _STATUS_FIELDS if k in p})
        await conn.execute(update(batches).where(batches.c.id == p["batch_id"]).values(**values))


@projects(EventType.ITEM_CREATED)
async def _item_created(conn, evs):
    rows = [dict(e.payload, status="pending", body_json=e.payload.get("body_json")) for e in evs]
    await conn.execute(insert(batch_items).on_conflict_do_nothing(), rows)


async def _item_finished(conn, used: Sequence[tuple[Event, ledger.ItemUsage, int]], status: str):
    """`used`: each result with its usage and its cached input tokens."""
    stmt = (
        update(batch_items)
        .where(batch_items.c.batch_id == bindparam("b_batch"), batch_items.c.idx == bindparam("b_idx"))
        .values(status=status, result_position=bindparam("b_pos"), input_tokens=bindparam("b_in"),
                output_tokens=bindparam("b_out"), cached_tokens=bindparam("b_cached"))
    )
    await conn.execute(stmt, [dict(b_batch=u.batch_id, b_idx=u.idx, b_pos=e.position, b_in=u.input_tokens,
                                   b_out=u.output_tokens, b_cached=cached) for e, u, cached in used])
    await ledger.settle_items(conn, [u for _, u, _ in used])


@projects(EventType.ITEM_COMPLETED)
async def _item_completed(conn, evs):
    used = []
    for e in evs:
        p = item_result(e.type, e.payload)
        usage = _usage(p.body_json)
        used.append((e, _used(e, p, usage), _cached(usage)))
    await _item_finished(conn, used, "completed")


@projects(EventType.ITEM_FAILED)
async def _item_failed(conn, evs):
    await _item_finished(conn, [(e, _used(e, p, {}), 0) for e, p in _items(evs)], "failed")


def _usage(body_json: str | None) -> dict:
    """The response body's `usage` (OpenAI's: prompt_tokens, completion_tokens)."""
    try:
        body = json.loads(body_json) if body_json else {}
    except ValueError:
        return {}
    usage = body.get("usage") if isinstance(body, dict) else None
    return usage if isinstance(usage, dict) else {}


def _cached(usage: dict) -> int:
    """Of the prompt's tokens, those the prefix cache served (OpenAI's
    `usage.prompt_tokens_details.cached_tokens`); 0 where the engine did not say."""
    details = usage.get("prompt_tokens_details")
    return int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0


def _items(evs: Sequence[Event]) -> list[tuple[Event, ItemPayload]]:
    return [(e, item_payload(e.type, e.payload)) for e in evs]


def _used(e: Event, p: ItemPayload, usage: dict) -> ledger.ItemUsage:
    return ledger.ItemUsage(e.tenant, p.batch_id, p.idx, int(usage.get("prompt_tokens", 0)),
                            int(usage.get("completion_tokens", 0)))


@projects(EventType.ITEM_PREEMPTED)
async def _item_preempted(conn, evs):
    stmt = (
        update(batch_items)
        .where(batch_items.c.batch_id == bindparam("b_batch"), batch_items.c.idx == bindparam("b_idx"))
        .values(preemptions=batch_items.c.preemptions + 1)
    )
    await conn.execute(stmt, [dict(b_batch=p.batch_id, b_idx=p.idx) for _, p in _items(evs)])


@projects(EventType.FT_JOB_CREATED)
async def _ft_job_created(conn, evs):
    await conn.execute(insert(fine_tuning_jobs).on_conflict_do_nothing(),
                       [dict(e.payload, seq=e.position) for e in evs])


_FT_STATUS_FIELDS = ("error", "fine_tuned_model", "trained_tokens", "result_files", "finished_at")


@projects(EventType.FT_MODEL_DELETED)
async def _ft_model_deleted(conn, evs):
    for e in evs:
        await conn.execute(update(fine_tuning_jobs).where(fine_tuning_jobs.c.id == e.payload["job_id"])
                           .values(model_deleted_at=e.payload["at"]))


@projects(EventType.FT_STATUS)
async def _ft_status(conn, evs):
    for e in evs:
        p = e.payload
        values = dict(status=p["status"], **{k: p[k] for k in _FT_STATUS_FIELDS if k in p})
        await conn.execute(update(fine_tuning_jobs).where(fine_tuning_jobs.c.id == p["job_id"]).values(**values))
