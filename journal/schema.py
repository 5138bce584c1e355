"""The journal's tables (SQLAlchemy Core). Migrations in `migrations/` create them.

`events` is append-only and the source of truth. The other tables are read models:
projections of events (`journal/projections.py`), rebuildable from `events` at any time.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

metadata = MetaData()

events = Table(
    "events",
    metadata,
    Column("position", BigInteger, primary_key=True, autoincrement=True),
    Column("stream", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("type", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("idempotency_key", Text, nullable=False),
    Column("tenant", Text, nullable=False, server_default="default"),
    Column("committed_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # The lease token of the attempt that wrote it (migration 0004); NULL: unfenced.
    Column("fence", BigInteger, nullable=True),
    # txid (xid8, default pg_current_xact_id()) exists in the table for followers; it is
    # read through SQL text in `journal.events.follow` and so is not mapped here.
    UniqueConstraint("stream", "version", name="events_stream_version_key"),
    UniqueConstraint("idempotency_key", name="events_idempotency_key_key"),
    # The reconciler's sweep for requests no API reported (journal/served.py; migration 0007).
    Index("events_served", "committed_at", postgresql_where=text("type = 'request_served'")),
)

files = Table(
    "files",
    metadata,
    Column("id", Text, primary_key=True),
    Column("tenant", Text, nullable=False),
    Column("purpose", Text, nullable=False),
    Column("filename", Text, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("object_key", Text, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    # When it stops being served, unix seconds; NULL: kept until deleted (migration 0014).
    # Set by a `file_expires` event (journal/batch_store.py).
    Column("expires_at", BigInteger, nullable=True),
    # A tenant's files newest first (GET /v1/files, its quota's count), and the expiry sweep's.
    Index("files_tenant_created", "tenant", "created_at", "id"),
    Index("files_expiry", "expires_at", postgresql_where=text("expires_at IS NOT NULL")),
)

batches = Table(
    "batches",
    metadata,
    Column("id", Text, primary_key=True),
    Column("tenant", Text, nullable=False),
    Column("endpoint", Text, nullable=False),
    Column("input_file_id", Text, nullable=False),
    Column("completion_window", Text, nullable=False),
    Column("metadata", JSONB),
    Column("status", Text, nullable=False),
    Column("errors", JSONB),
    Column("output_file_id", Text),
    Column("error_file_id", Text),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger),
    Column("in_progress_at", BigInteger),
    Column("finalizing_at", BigInteger),
    Column("completed_at", BigInteger),
    Column("failed_at", BigInteger),
    Column("expired_at", BigInteger),
    Column("cancelling_at", BigInteger),
    Column("cancelled_at", BigInteger),
    # The model it runs, from its `batch_model` event (migration 0022; NULL: created before).
    Column("model", Text),
    # The position of the batch_created event: listing is newest first by it.
    Column("seq", BigInteger, nullable=False),
    Index("batches_tenant_seq", "tenant", text("seq DESC")),
    # Whether a file is still an open batch's input (DELETE /v1/files refuses it; migration 0014).
    Index("batches_open_input", "input_file_id",
          postgresql_where=text("status IN ('validating', 'in_progress', 'finalizing', 'cancelling')")),
)

batch_items = Table(
    "batch_items",
    metadata,
    Column("batch_id", Text, primary_key=True),
    Column("idx", Integer, primary_key=True),
    Column("line", Integer, nullable=False),
    Column("custom_id", Text, nullable=False),
    Column("body", JSONB, nullable=False),
    Column("status", Text, nullable=False),  # pending | completed | failed
    Column("result_position", BigInteger),  # the event holding the response or error
    Column("preemptions", Integer, nullable=False, server_default="0"),
    # A completed item's usage, from its response (migration 0020): the batch's tokens so far.
    Column("input_tokens", BigInteger),
    Column("output_tokens", BigInteger),
    # Of its input tokens, those vLLM's prefix cache served (`prompt_tokens_details`; 0022).
    Column("cached_tokens", BigInteger),
    # The request as its line wrote it, where the order of its keys matters (0023).
    Column("body_json", Text),
    # The workflow pages through the items still to run: match that query exactly.
    Index("batch_items_pending", "batch_id", "idx", postgresql_where=text("status = 'pending'")),
)

# Live engine state, overwritten by each engine worker every second (migration 0002), and
# the fleet controller's batch cap for it (0003).
fine_tuning_jobs = Table(
    "fine_tuning_jobs",
    metadata,
    Column("id", Text, primary_key=True),
    Column("tenant", Text, nullable=False),
    Column("model", Text, nullable=False),
    Column("training_file", Text, nullable=False),
    Column("validation_file", Text),
    Column("hyperparameters", JSONB, nullable=False),
    Column("seed", BigInteger, nullable=False),
    Column("suffix", Text),
    Column("metadata", JSONB),
    Column("status", Text, nullable=False),
    Column("error", JSONB),
    Column("fine_tuned_model", Text),
    Column("trained_tokens", BigInteger),
    Column("result_files", JSONB, nullable=False, server_default="[]"),
    Column("created_at", BigInteger, nullable=False),
    Column("finished_at", BigInteger),
    # When its tenant deleted the fine-tuned model (migration 0016): no longer listed or callable.
    Column("model_deleted_at", BigInteger),
    # The position of the ft_job_created event: listing is newest first by it.
    Column("seq", BigInteger, nullable=False),
    Index("fine_tuning_jobs_tenant_seq", "tenant", text("seq DESC")),
    Index("fine_tuning_jobs_active", "tenant", "model",
          postgresql_where=text("status NOT IN ('succeeded', 'failed', 'cancelled')")),
)

engines = Table(
    "engines",
    metadata,
    Column("id", Text, primary_key=True),
    Column("url", Text, nullable=False),
    Column("model", Text, nullable=False),
    Column("queue", Text, nullable=False),
    Column("stats", JSONB, nullable=False),
    Column("seen_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("batch_cap", Integer, nullable=True),
    # `ballast worker drain ID` (migration 0008): no new work goes there.
    Column("draining", Boolean, nullable=False, server_default="false"),
    # The login that announced it, filled by the database (migration 0017): an engine's
    # login may touch its own rows only.
    Column("login", Text, nullable=False, server_default=text("current_user")),
)

# One lease per stream fenced by attempts (migration 0004): an attempt takes the next
# token, and the database refuses events fenced with any older one.
leases = Table(
    "leases",
    metadata,
    Column("stream", Text, primary_key=True),
    Column("token", BigInteger, nullable=False),
    Column("holder", Text, nullable=False),
    Column("acquired_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# -- tenants and their keys (migration 0005) -------------------------------------------
# Not projections: the admin API and `ballast tenants` write them directly.
tenants = Table(
    "tenants",
    metadata,
    Column("id", Text, primary_key=True),
    Column("weight", Integer, nullable=False, server_default="1"),  # fair share within a tier
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # Where its work may run (engine workers' BALLAST_REGION); NULL: anywhere (migration 0008).
    Column("regions", ARRAY(Text), nullable=True),
    # The tiers it is granted of protocol.tiers.GRANTED (migration 0012).
    Column("tiers", ARRAY(Text), nullable=False, server_default="{}"),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", Text, primary_key=True),
    # NULL: an admin key of no tenant (migration 0015), which administers and has no /v1.
    Column("tenant", Text, ForeignKey("tenants.id"), nullable=True),
    Column("hash", Text, nullable=False, unique=True),  # sha256 hex of the key; the key itself is never stored
    Column("prefix", Text, nullable=False),
    Column("name", Text, nullable=True),
    Column("admin", Boolean, nullable=False, server_default="false"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("revoked_at", DateTime(timezone=True), nullable=True),
)

# Per tenant and model ('*': every model); NULL: no limit on that dimension.
limits = Table(
    "limits",
    metadata,
    Column("tenant", Text, ForeignKey("tenants.id"), primary_key=True),
    Column("model", Text, primary_key=True, server_default="*"),
    Column("requests_per_min", BigInteger),
    Column("input_tokens_per_min", BigInteger),
    Column("output_tokens_per_min", BigInteger),
    Column("concurrent_requests", BigInteger),
    Column("tokens_per_day", BigInteger),
    Column("batch_queue_tokens", BigInteger),
    Column("concurrent_fine_tunes", BigInteger),  # active fine-tuning jobs (0010)
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# A tenant's sequence slots reserved on a model's pool (migration 0029), or output tokens a
# second there (0032, `slots` 0): the projection of its `reservation_set` events, the one
# in force; none where both went to 0.
reservations = Table(
    "reservations",
    metadata,
    Column("tenant", Text, primary_key=True),
    Column("model", Text, primary_key=True),
    Column("region", Text, primary_key=True, server_default=""),  # "": anywhere in the pool (migration 0030)
    Column("slots", Integer, nullable=False),
    Column("tokens_per_s", Integer, nullable=False, server_default="0"),
    Column("set_at", BigInteger, nullable=False),
    Column("position", BigInteger, nullable=False),
)

# -- the quota ledger (migration 0005; journal/ledger.py) ------------------------------
# Append-only, like `events`: one row per reserve / settle / refund / expire of a subject
# (request:<id>, batch:<id>, item:<id>:<idx>); `idempotency_key` is `<kind>:<subject>`.
ledger = Table(
    "ledger",
    metadata,
    Column("position", BigInteger, primary_key=True, autoincrement=True),
    Column("tenant", Text, nullable=False),
    Column("model", Text, nullable=False),
    Column("tier", Text, nullable=False),  # priority | default | flex | batch
    Column("subject", Text, nullable=False),
    Column("kind", Text, nullable=False),  # reserve | settle | refund | expire
    Column("input_tokens", BigInteger, nullable=False),
    Column("output_tokens", BigInteger, nullable=False),
    Column("holder", Text, nullable=True),  # the admitting process, for expiry
    Column("idempotency_key", Text, nullable=False, unique=True),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# The reconciler's fold of the ledger, per tenant × model × window × admitting process.
quota_usage = Table(
    "quota_usage",
    metadata,
    Column("tenant", Text, primary_key=True),
    Column("model", Text, primary_key=True),
    Column("window", Text, primary_key=True),  # minute | day
    Column("starts_at", DateTime(timezone=True), primary_key=True),
    Column("holder", Text, primary_key=True, server_default=""),
    Column("requests", BigInteger, nullable=False, server_default="0"),
    Column("input_tokens", BigInteger, nullable=False, server_default="0"),
    Column("output_tokens", BigInteger, nullable=False, server_default="0"),
    Column("in_flight", BigInteger, nullable=False, server_default="0"),
    Column("batch_queue_tokens", BigInteger, nullable=False, server_default="0"),
    Column("folded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# A cell's share of a tenant's global daily tokens (migration 0031; journal/allowances.py):
# append-only history; per tenant × model the highest id is in force.
allowances = Table(
    "allowances",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("tenant", Text, nullable=False),
    Column("model", Text, nullable=False),
    Column("tokens_per_day", BigInteger),  # None: lifted
    Column("global_tokens_per_day", BigInteger),
    Column("used", BigInteger, nullable=False, server_default="0"),
    Column("tick", Text, nullable=False),
    Column("set_by", Text, nullable=False, server_default=text("current_user")),
    Column("set_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# The allowance in force per tenant × model (migration 0031), written with its history row.
allowances_in_force = Table(
    "allowances_in_force",
    metadata,
    Column("tenant", Text, primary_key=True),
    Column("model", Text, primary_key=True),
    Column("tokens_per_day", BigInteger),
    Column("id", BigInteger, nullable=False),
    Column("set_at", DateTime(timezone=True), nullable=False),
)

# Processes that admit, and when each was last seen (its reservations expire after a TTL).
admission_holders = Table(
    "admission_holders",
    metadata,
    Column("holder", Text, primary_key=True),
    Column("seen_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# -- webhook endpoints (migration 0021; journal/webhook_store.py) ----------------------
# Not a projection: the API writes them. The API's role reads every column but `secret`
# (WEBHOOK_PUBLIC), which only the control worker reads, to sign deliveries.
webhooks = Table(
    "webhooks",
    metadata,
    Column("id", Text, primary_key=True),
    Column("tenant", Text, nullable=False),
    Column("url", Text, nullable=False),
    Column("secret", Text, nullable=False),
    Column("events", ARRAY(Text), nullable=False),
    Column("description", Text),
    Column("created_at", BigInteger, nullable=False),
    Column("deleted_at", BigInteger),  # unix seconds; NULL: live
    Index("webhooks_tenant_live", "tenant", "created_at", postgresql_where=text("deleted_at IS NULL")),
)
WEBHOOK_PUBLIC = tuple(c for c in webhooks.c if c.name != "secret")
