"""The batch workflow pages through pending items with `pending_items`, cursor = the
largest index of the last page: every pending item comes out exactly once, each page is
the next `limit` by index, and inside a page the items sharing a system prompt sit side by
side (so a group of them runs on one engine worker, sharing vLLM's prefix cache)."""

from __future__ import annotations

import itertools
import json
import uuid

from sqlalchemy import text

from journal import batches as jb

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
        while page := await jb.pending_items(c, bid, after, limit):
            assert sorted(page) == pending[len(seen):len(seen) + limit]  # the next `limit` by index
            runs = [s for s, _ in itertools.groupby(system_of[i] for i in page)]
            assert len(runs) == len(set(runs))  # each system prompt in one run
            for _, same in itertools.groupby(page, key=system_of.__getitem__):
                idxs = list(same)
                assert idxs == sorted(idxs, key=lambda i: f"question {50 - i}")  # then by the rest of the prompt
            seen += page
            after = max(page)
    assert sorted(seen) == pending and len(seen) == len(set(seen))
