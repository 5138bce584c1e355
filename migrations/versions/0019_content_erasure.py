"""Erasing a tenant's content while the journal keeps its audit trail.

The journal stays append-only for every role and every statement but one: the owner's
`ballast_erase_content(tenant)`, which masks the content fields of the tenant's events in
place (as event stores mask events for erasure requests) and leaves every other column,
every row and every count as it was:

- `item_created`: the request `body` becomes `{"erased": true}`;
- `item_chunk`: each token id becomes -1 (the count of tokens, which audits and the
  journal's invariants read, stays);
- `item_completed` / `item_failed`: `body_json` keeps only the response's `usage`;
- `file_created`: the `filename` becomes "erased"; `batch_created` / `ft_job_created`:
  `metadata` becomes null;

and the read models beside them (batch_items.body, files' and jobs' names and metadata).
Only the items of batches that have ended are touched: an item still generating keeps its
request. The trigger lets an UPDATE through only inside that function (a transaction-local
setting it alone sets, on the rows of the tenant it names, with nothing but `payload`
changed); no service role may UPDATE events at all, and only the API's role may call it.

Revision ID: 0019
Revises: 0018
"""

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_ENDED = "('completed', 'failed', 'expired', 'cancelled')"
# The response as jsonb, each escaped NUL (\u0000 not itself escaped) taken out of its text.
_RESPONSE = r"""regexp_replace(payload->>'body_json', '(?<!\\)((?:\\\\)*)\\u0000', '\1', 'g')::jsonb"""


def upgrade() -> None:
    op.execute(
        """
        CREATE OR REPLACE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql
          SET search_path = pg_catalog, pg_temp AS $$
        BEGIN
          -- Nested: the ledger shares this trigger, and its rows have no such columns.
          IF TG_OP = 'UPDATE' AND TG_TABLE_NAME = 'events' THEN
            IF current_setting('ballast.erasing', true) = OLD.tenant
               AND (NEW.position, NEW.stream, NEW.version, NEW.type, NEW.idempotency_key, NEW.tenant,
                    NEW.committed_at, NEW.fence)
               IS NOT DISTINCT FROM (OLD.position, OLD.stream, OLD.version, OLD.type, OLD.idempotency_key,
                                     OLD.tenant, OLD.committed_at, OLD.fence) THEN
              RETURN NEW;
            END IF;
          END IF;
          RAISE EXCEPTION 'the journal is append-only: % on % is not allowed', TG_OP, TG_TABLE_NAME
            USING ERRCODE = 'insufficient_privilege';
        END $$;
        """
    )
    op.execute(
        f"""
        CREATE FUNCTION public.ballast_erase_content(p_tenant text) RETURNS jsonb LANGUAGE plpgsql
          SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $$
        DECLARE
          n_requests bigint; n_chunks bigint; n_results bigint; n_files bigint; n_metadata bigint;
          ended text[];
        BEGIN
          IF p_tenant IS NULL OR p_tenant = '' THEN
            RAISE EXCEPTION 'ballast_erase_content: name a tenant' USING ERRCODE = 'invalid_parameter_value';
          END IF;
          SELECT coalesce(array_agg(id), '{{}}') INTO ended FROM batches
            WHERE tenant = p_tenant AND status IN {_ENDED};
          PERFORM set_config('ballast.erasing', p_tenant, true);

          UPDATE events SET payload = jsonb_set(payload, '{{body}}', '{{"erased": true}}')
            WHERE tenant = p_tenant AND type = 'item_created' AND payload->>'batch_id' = ANY (ended)
              AND payload->'body' IS DISTINCT FROM '{{"erased": true}}';
          GET DIAGNOSTICS n_requests = ROW_COUNT;
          UPDATE batch_items SET body = '{{"erased": true}}' WHERE batch_id = ANY (ended)
            AND body IS DISTINCT FROM '{{"erased": true}}';

          UPDATE events SET payload = jsonb_set(payload, '{{token_ids}}',
              (SELECT coalesce(jsonb_agg(-1), '[]') FROM jsonb_array_elements(payload->'token_ids')))
            WHERE tenant = p_tenant AND type = 'item_chunk' AND payload->>'batch_id' = ANY (ended)
              AND EXISTS (SELECT 1 FROM jsonb_array_elements(payload->'token_ids') t WHERE t <> '-1');
          GET DIAGNOSTICS n_chunks = ROW_COUNT;

          -- The text of a response may hold an escaped NUL, which jsonb refuses: dropped before the cast.
          UPDATE events SET payload = jsonb_set(payload, '{{body_json}}', to_jsonb(
              jsonb_strip_nulls(jsonb_build_object('erased', true, 'usage', {_RESPONSE}->'usage'))::text))
            WHERE tenant = p_tenant AND type IN ('item_completed', 'item_failed')
              AND payload->>'batch_id' = ANY (ended)
              AND coalesce(payload->>'body_json', '') <> ''
              AND {_RESPONSE}->>'erased' IS DISTINCT FROM 'true';
          GET DIAGNOSTICS n_results = ROW_COUNT;

          UPDATE events SET payload = jsonb_set(payload, '{{filename}}', '"erased"')
            WHERE tenant = p_tenant AND type = 'file_created' AND payload->>'filename' <> 'erased';
          GET DIAGNOSTICS n_files = ROW_COUNT;
          UPDATE files SET filename = 'erased' WHERE tenant = p_tenant AND filename <> 'erased';

          UPDATE events SET payload = jsonb_set(payload, '{{metadata}}', 'null')
            WHERE tenant = p_tenant AND type IN ('batch_created', 'ft_job_created')
              AND payload->'metadata' IS NOT NULL AND payload->'metadata' <> 'null';
          GET DIAGNOSTICS n_metadata = ROW_COUNT;
          UPDATE batches SET metadata = NULL WHERE tenant = p_tenant AND metadata IS NOT NULL;
          UPDATE fine_tuning_jobs SET metadata = NULL WHERE tenant = p_tenant AND metadata IS NOT NULL;

          PERFORM set_config('ballast.erasing', '', true);
          RETURN jsonb_build_object('requests', n_requests, 'chunks', n_chunks, 'results', n_results,
                                    'filenames', n_files, 'metadata', n_metadata);
        END $$;
        REVOKE ALL ON FUNCTION public.ballast_erase_content(text) FROM PUBLIC;
        GRANT EXECUTE ON FUNCTION public.ballast_erase_content(text) TO ballast_api;
        """
    )


def downgrade() -> None:
    op.execute(
        """
        DROP FUNCTION public.ballast_erase_content(text);
        CREATE OR REPLACE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql
          SET search_path = pg_catalog, pg_temp AS $$
        BEGIN
          RAISE EXCEPTION 'the journal is append-only: % on % is not allowed', TG_OP, TG_TABLE_NAME
            USING ERRCODE = 'insufficient_privilege';
        END $$;
        """
    )
