"""Interactive requests' records, many to an event: `served_requests` and
`finished_requests`, one row per request whichever shape its event has.

An engine worker recorded each request it served as an event of its own
(`request_served`), and an API process's window each request's outcome
(`request_finished`): two journal rows per request, beside its two ledger rows. Now an
engine worker writes one `request_served` a checkpointer tick per tenant, and a window one
`request_finished` per tenant, each with the list of its requests (`requests`; a served
event names its engine once, `engine_id`). Whether a request was journaled is its settle
row in the ledger (`settle:request:<id>`, unique), written in the same transaction. These
views read either shape, so earlier journals read the same:

- `served_requests`: request_id, engine_id, tenant, committed_at and `record` (the engine
  worker's record: tier, model, prompt and completion tokens, finish reason…).
- `finished_requests`: request_id, status, tenant, committed_at and `record` (the request
  and its outcome as the API saw it, or as the reconciler took it from the engine's
  record).

Read by the API's console, the control worker (the reconciler's sweep) and `ballast
verify`, as the other views, and by the auditor; `security_invoker`, so the events table's
row policies hold (the auditor sees its tenant's requests only).

Revision ID: 0025
Revises: 0024
"""

from alembic import op

from migrations.helpers import grant_role, grant_services

AUDITOR = "ballast_auditor"  # 0005
revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def _view(name: str, type_: str, extra: str, merge: str) -> str:
    return f"""
        CREATE VIEW {name} WITH (security_invoker = true) AS
        SELECT e.position, e.committed_at, e.tenant, r.record->>'request_id' AS request_id{extra}, r.record
          FROM events e
         CROSS JOIN LATERAL (
           SELECT CASE WHEN e.payload ? 'requests' THEN x{merge} ELSE x END AS record
             FROM jsonb_array_elements(CASE WHEN e.payload ? 'requests' THEN e.payload->'requests'
                                            ELSE jsonb_build_array(e.payload) END) AS x
         ) r
         WHERE e.type = '{type_}'
    """


def upgrade() -> None:
    op.execute(_view("served_requests", "request_served", ", r.record->>'engine_id' AS engine_id",
                     " || jsonb_build_object('engine_id', e.payload->'engine_id')"))
    op.execute(_view("finished_requests", "request_finished", ", r.record->>'status' AS status", ""))
    grant_services("SELECT", "served_requests", "finished_requests")
    op.execute(f"GRANT SELECT ON served_requests, finished_requests TO {AUDITOR}")
    for view in ("served_requests", "finished_requests"):
        grant_role("api", "SELECT", view)
        grant_role("control", "SELECT", view)


def downgrade() -> None:
    op.execute("DROP VIEW finished_requests; DROP VIEW served_requests")
