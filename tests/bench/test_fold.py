"""`ballast bench fold` on a small ledger: each tick writes the ~400 rows it says (counted
in SQL over the ledger, by kind), both arms are timed, and the incremental fold's rows
equal a full refold's."""

from __future__ import annotations

from sqlalchemy import text

from bench import fold
from config import Settings
from journal.db import connect
from tests.conftest import migrated_database


async def test_the_fold_bench_measures_both_arms_on_the_ledger_it_builds(pg_server_url):
    with migrated_database(pg_server_url, "ballast_bench_fold") as owner_url:
        service_url = Settings().model_copy(update=dict(database_url=owner_url, service_database_url=None)
                                            ).require("service_db_url")
        figures = await fold.run(owner_url, service_url, sizes=(1_500, 8_000), ticks=10)
        db = connect(owner_url)
        try:
            async with db.connect() as conn:
                kinds = dict((await conn.execute(text("SELECT kind, count(*) FROM ledger GROUP BY kind"))).all())
                total = sum(kinds.values())
        finally:
            await db.dispose()
    small, large = figures["1500"], figures["8000"]
    assert 1_500 <= small["ledger_rows"] < 1_510 and 8_000 <= large["ledger_rows"] < 8_010
    assert large["ledger_rows_end"] == total and kinds.get("expire", 0) == 0
    for f in (small, large):
        # 200 reservations a tick, and the tick before's settled: ~400 rows
        # (the first tick settles none).
        per_tick = (f["ledger_rows_end"] - f["ledger_rows"]) / 10
        assert 360 <= per_tick <= 3 * fold.PER_TICK and f["new_rows_per_tick"] == round(per_tick)
        assert f["incremental_ticks"] == 8 and f["full_ticks"] == 2
        assert 0 < f["incremental_p50_ms"] <= f["incremental_p99_ms"]
        assert 0 < f["full_p50_ms"] <= f["full_p99_ms"]
        assert f["same_rows_as_full"] is True
