"""The batch workflow pages through pending items with `pending_items`, cursor = the
largest index of the last page: every pending item comes out exactly once, each page is
the next `limit` by index, and inside a page the items sharing a system prompt sit side by
side (so a group of them runs on one engine worker, sharing vLLM's prefix cache)."""

from __future__ import annotations

import itertools
import json
import uuid

from sqlalchemy import text

from journal import batch_store

SYSTEMS = ["You are a pirate. " * 40, "You are a poet. " * 40, "You translate to French. " * 40]


async def make_batch(owner_db, n: int, done: set[int]) -> tuple[str, dict[int, str]]:
    bid = "batch_" + uuid.uuid4().hex[:10]
    system_of = {idx: SYSTEMS[idx % len(SYSTEMS)] for idx in range(n)}  # interleaved, as users write them
    async with owner_db.begin() as c:
        await c.execute(text("INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, "
                             "created_at, seq) VALUES (:b, 't', '/v1/chat/completions', 'f', '24h', "
                             "'in_progress', 0, 0)"), dict(b=bid))
        for idx in range(n):
            body = dict(model="m", messages=[dict(role="system", content=system_of[idx]),
                                             dict(role="user", content=f"question {n - idx}")])
            await c.execute(text("INSERT INTO batch_items (batch_id, idx, line, custom_id, body, status) "
                                 "VALUES (:b, :i, :i, :c, CAST(:body AS jsonb), :s)"),
                            dict(b=bid, i=idx, c=f"c{idx}", body=json.dumps(body),
                                 s="completed" if idx in done else "pending"))
    return bid, system_of


async def test_pages_cover_every_pending_item_once_clustered_by_prompt(owner_db, db):
    done = {3, 4, 17, 40}
    bid, system_of = await make_batch(owner_db, 50, done)
    pending = [i for i in range(50) if i not in done]
    seen: list[int] = []
    after, limit = -1, 12
    async with db.connect() as c:
        while page := await batch_store.pending_items(c, bid, after, limit):
            assert sorted(page) == pending[len(seen):len(seen) + limit]  # the next `limit` by index
            runs = [s for s, _ in itertools.groupby(system_of[i] for i in page)]
            assert len(runs) == len(set(runs))  # each system prompt in one run
            for _, same in itertools.groupby(page, key=system_of.__getitem__):
                idxs = list(same)
                assert idxs == sorted(idxs, key=lambda i: f"question {50 - i}")  # then by the rest of the prompt
            seen += page
            after = max(page)
    assert sorted(seen) == pending and len(seen) == len(set(seen))


async def test_a_page_sends_each_prompts_run_to_one_live_worker_of_the_batchs_queue(owner_db, db):
    """The page as the workflow gets it (BatchActivities.pending_items, given the queue the
    batch runs on): each system prompt's items go, whole, to the own queue of one engine
    worker polling that queue; a worker draining, gone quiet, or in another region gets
    none."""
    from activities.batch import BatchActivities
    from journal import engine_registry
    from policy.placement import region_queue
    from protocol.temporal import Page, PendingInput

    pool = "pool-" + uuid.uuid4().hex[:8]
    async with owner_db.begin() as c:
        for id_, region in (("eu-1", "eu"), ("eu-2", "eu"), ("eu-3", "eu"), ("eu-drained", "eu"), ("eu-quiet", "eu"),
                            ("us-1", "us")):
            await engine_registry.announce(c, f"{pool}-{id_}", "http://x", "m", pool, dict(region=region))
        await engine_registry.drain(c, f"{pool}-eu-drained")
        await c.execute(text("UPDATE engines SET seen_at = now() - interval '1 minute' WHERE id = :i"),
                        dict(i=f"{pool}-eu-quiet"))
    bid, system_of = await make_batch(owner_db, 30, set())
    acts = BatchActivities(db, None, None, 0)  # paging reads neither the store nor the limits

    page = await acts.pending_items(PendingInput(bid, -1, 100, queue=region_queue(pool, "eu")))
    assert isinstance(page, Page) and sorted(page.idxs) == list(range(30))
    assert sum(n for n, _ in page.runs) == 30
    on: dict[int, str] = {}
    at = 0
    for n, queue in page.runs:
        on.update(dict.fromkeys(page.idxs[at:at + n], queue))
        at += n
    eu = {f"{pool}@eu/{pool}-eu-{n}" for n in (1, 2, 3)}
    assert set(on.values()) == eu  # 3 runs of 10, each worker ≤ ceil(1.25 · 10) = 13: one run each
    for system in SYSTEMS:
        assert len({on[i] for i in on if system_of[i] == system}) == 1  # each prompt on one worker

    anywhere = await acts.pending_items(PendingInput(bid, -1, 100, queue=pool))
    assert isinstance(anywhere, Page) and {q for _, q in anywhere.runs} <= eu | {f"{pool}@us/{pool}-us-1"}
    assert await acts.pending_items(PendingInput(bid, -1, 100)) == page.idxs  # an old workflow: a bare list
