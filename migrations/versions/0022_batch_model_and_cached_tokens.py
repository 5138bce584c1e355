"""A batch's model and its cached input tokens, so the batch object has OpenAI's `model`
and `usage` from its row and one read of its items.

- `batches.model`: the model the batch runs, projected from its `batch_model` event
  (journaled beside `batch_created`). Batches created before have no such event, so none
  (the read models hold nothing the events do not).
- `batch_items.cached_tokens`: of a completed item's input tokens, those served from the
  prefix cache (its response's `usage.prompt_tokens_details.cached_tokens`; absent: 0),
  projected with `input_tokens` and `output_tokens` (0020). Items completed before this
  migration are filled from their responses here.

No grant changes: the roles that write these tables' rows have table-wide rights there.

Revision ID: 0022
Revises: 0021
"""

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

# The response as jsonb, each escaped NUL (\u0000 not itself escaped) taken out of its text
# (generated text may hold one, which jsonb refuses). As 0020 has it.
_RESPONSE = r"""regexp_replace(e.payload->>'body_json', '(?<!\\)((?:\\\\)*)\\u0000', '\1', 'g')::jsonb"""


def upgrade() -> None:
    op.execute(
        f"""
        ALTER TABLE batches ADD COLUMN model text;
        ALTER TABLE batch_items ADD COLUMN cached_tokens bigint;
        UPDATE batch_items i
           SET cached_tokens = coalesce(({_RESPONSE}->'usage'->'prompt_tokens_details'->>'cached_tokens')::bigint, 0)
          FROM events e
         WHERE e.position = i.result_position AND i.status = 'completed' AND e.type = 'item_completed'
           AND coalesce(e.payload->>'body_json', '') <> '';
        UPDATE batch_items SET cached_tokens = 0 WHERE status <> 'pending' AND cached_tokens IS NULL;
        """
    )


def downgrade() -> None:
    op.execute("ALTER TABLE batch_items DROP COLUMN cached_tokens; ALTER TABLE batches DROP COLUMN model;")
