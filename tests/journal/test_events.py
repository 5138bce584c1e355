import asyncio

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError

from journal import events as j
from journal.events import rebuild
from journal.leases import acquire
from journal.migrate import upgrade
from journal.schema import batch_items, batches, files


def ev(stream, key, type="note", **payload):
    return j.NewEvent(stream=stream, type=type, payload=payload or {"k": key}, key=key)


async def test_append_is_idempotent_and_versions_per_stream(db):
    async with db.begin() as c:
        first = await j.append(c, [ev("s-idem", "idem-1"), ev("s-idem", "idem-2"), ev("s-other", "idem-3")])
    async with db.begin() as c:
        again = await j.append(c, [ev("s-idem", "idem-2"), ev("s-idem", "idem-4")])
    assert all(p is not None for p in first)
    assert again[0] is None and again[1] is not None
    async with db.connect() as c:
        stream = await j.read_stream(c, "s-idem")
    assert [(e.key, e.version) for e in stream] == [("idem-1", 1), ("idem-2", 2), ("idem-4", 3)]


async def test_concurrent_appenders_never_share_a_version(db):
    async def writer(n):
        async with db.begin() as c:
            await j.append(c, [ev("s-race", f"race-{n}")])

    await asyncio.gather(*(writer(n) for n in range(8)))
    async with db.connect() as c:
        versions = [e.version for e in await j.read_stream(c, "s-race")]
    assert sorted(versions) == list(range(1, 9))


@pytest.mark.parametrize(
    "sql",
    ["UPDATE events SET type = 'x'", "DELETE FROM events", "TRUNCATE events"],
)
async def test_journal_rejects_rewrites_even_by_its_owner(owner_db, sql):
    # The services' role is refused these by its grants (test_roles); the trigger refuses
    # them to every role, the owner included.
    async with owner_db.begin() as c:
        await j.append(c, [ev("s-ro", f"ro-{sql}")])
    with pytest.raises(DBAPIError, match="append-only"):
        async with owner_db.begin() as c:
            await c.execute(text(sql))
    async with owner_db.connect() as c:
        assert await j.read_stream(c, "s-ro")


async def test_same_key_same_event_is_a_no_op(db):
    async with db.begin() as c:
        [first] = await j.append(c, [ev("s-same", "same-1", type="t", a=1, b=[1, 2])])
    async with db.begin() as c:
        again = await j.append(c, [ev("s-same", "same-1", type="t", b=[1, 2], a=1), ev("s-same", "same-2")])
    assert first is not None and again[0] is None and again[1] is not None
    async with db.connect() as c:
        assert [e.key for e in await j.read_stream(c, "s-same")] == ["same-1", "same-2"]


@pytest.mark.parametrize("change", [
    dict(payload={"a": 2}),
    dict(type="other"),
    dict(stream="s-conflict-elsewhere"),
    dict(tenant="someone-else"),
])
async def test_same_key_other_content_is_a_conflict_and_writes_nothing(db, change):
    key = f"conflict-{next(iter(change))}"
    original = j.NewEvent(f"s-{key}", "t", {"a": 1}, key)
    async with db.begin() as c:
        await j.append(c, [original])
    clash = j.NewEvent(**dict(vars(original), **change))
    with pytest.raises(j.IdempotencyConflict, match=key) as raised:
        async with db.begin() as c:  # the caller's transaction rolls back: the new event too
            await j.append(c, [ev(f"s-{key}-new", f"{key}-new"), clash])
    assert raised.value.keys == (key,)
    async with db.connect() as c:
        assert [(e.key, e.type, e.payload) for e in await j.read_stream(c, f"s-{key}")] == [(key, "t", {"a": 1})]
        assert await j.read_stream(c, f"s-{key}-new") == []


async def test_follow_never_skips_a_late_commit(db):
    async with db.connect() as c:
        tail = await j.follow(c, limit=100000)
    cursor = tail[-1][0] if tail else (0, 0)

    slow = await db.connect()
    slow_tx = await slow.begin()
    await j.append(slow, [ev("s-follow-a", "follow-slow")])  # takes its txid first, commits last
    async with db.begin() as c:
        await j.append(c, [ev("s-follow-b", "follow-fast")])
    async with db.connect() as c:
        seen = [e.key for _, e in await j.follow(c, cursor)]
    assert "follow-fast" not in seen and "follow-slow" not in seen  # both wait for the slow one

    await slow_tx.commit()
    await slow.close()
    async with db.connect() as c:
        seen = [e.key for _, e in await j.follow(c, cursor)]
    # The cursor can sit before an earlier test's commit that a concurrent transaction
    # anywhere on the server held below xmin; only this test's two events are in question.
    assert [k for k in seen if k.startswith("follow-")] == ["follow-slow", "follow-fast"]


def test_upgrade_head_twice_is_a_no_op(db_url):
    upgrade(db_url)
    upgrade(db_url)


async def test_read_models_rebuild_from_events(db, owner_db):
    async with db.begin() as c:
        fence = await acquire(c, "item:batch_rebuild:1", "test")
    batch = dict(id="batch_rebuild", tenant="t", endpoint="/v1/completions", input_file_id="file-x",
                 completion_window="24h", metadata={}, status="validating", created_at=1, expires_at=2)
    async with db.begin() as c:
        await j.append(c, [
            j.NewEvent("file:file-x", "file_created", dict(id="file-x", tenant="t", purpose="batch", filename="a",
                                                          bytes=3, object_key="k", created_at=1), "rb-file"),
            j.NewEvent("batch:batch_rebuild", "batch_created", batch, "rb-batch"),
            j.NewEvent("batch:batch_rebuild", "batch_model", dict(batch_id="batch_rebuild", model="m"), "rb-model"),
            j.NewEvent("batch:batch_rebuild", "batch_status",
                       dict(batch_id="batch_rebuild", status="in_progress", at=5), "rb-s1"),
            *[j.NewEvent(f"item:batch_rebuild:{i}", "item_created",
                         dict(batch_id="batch_rebuild", idx=i, line=i + 1, custom_id=f"c{i}", body={}), f"rb-i{i}")
              for i in range(3)],
            j.NewEvent("item:batch_rebuild:1", "item_completed", dict(batch_id="batch_rebuild", idx=1), "rb-done",
                       fence=fence),
        ])

    async def snapshot():
        async with db.connect() as c:
            return [
                sorted(map(tuple, (await c.execute(select(t))).all()), key=repr)
                for t in (files, batches, batch_items)
            ]

    before = await snapshot()
    assert next(r for r in before[1] if r[0] == "batch_rebuild")[-2] == "m"  # the model, before `seq`
    item = next(r for r in before[2] if r[0] == "batch_rebuild" and r[1] == 1)
    assert item[:6] == ("batch_rebuild", 1, 2, "c1", {}, "completed")
    async with owner_db.begin() as c:  # rebuilding empties the read models: the owner's job
        await rebuild(c)
    assert await snapshot() == before
