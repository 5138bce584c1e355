"""A batch's tokens so far, and engine drains over HTTP.

- `batch_items.input_tokens` / `output_tokens`: a completed item's usage, projected from its
  `item_completed` response in the same transaction, so the batch object states the tokens
  done (and its pace) from one indexed read of its items, not from their events. Items
  completed before this migration are filled from their responses here.
- The admin API drains and undrains engine workers (`/admin/engines/{id}/drain`), so an
  operator needs no database credentials for it: the API's role may change an engine row's
  `draining` flag, and nothing else of it.

Revision ID: 0020
Revises: 0019
"""

from alembic import op

from migrations.helpers import SERVICE_ROLES

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

API = SERVICE_ROLES["api"]
# The response as jsonb, each escaped NUL (\u0000 not itself escaped) taken out of its text
# (generated text may hold one, which jsonb refuses).
_RESPONSE = r"""regexp_replace(e.payload->>'body_json', '(?<!\\)((?:\\\\)*)\\u0000', '\1', 'g')::jsonb"""


def upgrade() -> None:
    op.execute(
        f"""
        ALTER TABLE batch_items ADD COLUMN input_tokens bigint, ADD COLUMN output_tokens bigint;
        UPDATE batch_items i
           SET input_tokens = coalesce(({_RESPONSE}->'usage'->>'prompt_tokens')::bigint, 0),
               output_tokens = coalesce(({_RESPONSE}->'usage'->>'completion_tokens')::bigint, 0)
          FROM events e
         WHERE e.position = i.result_position AND i.status = 'completed' AND e.type = 'item_completed'
           AND coalesce(e.payload->>'body_json', '') <> '';
        UPDATE batch_items SET input_tokens = 0, output_tokens = 0
         WHERE status <> 'pending' AND input_tokens IS NULL;
        GRANT UPDATE (draining) ON engines TO {API};
        CREATE POLICY engines_{API}_drains ON engines FOR UPDATE TO {API} USING (true) WITH CHECK (true);
        """
    )


def downgrade() -> None:
    op.execute(
        f"""
        DROP POLICY engines_{API}_drains ON engines;
        REVOKE UPDATE (draining) ON engines FROM {API};
        ALTER TABLE batch_items DROP COLUMN input_tokens, DROP COLUMN output_tokens;
        """
    )
