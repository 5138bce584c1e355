"""Batch items whose meaning depends on the order of their keys keep their request as
written, and erasure masks that text and the logprobs journaled with generated tokens.

- `batch_items.body_json`: the request as its line wrote it, where a key's place matters
  (a JSON schema's properties are generated in the order given, and jsonb keeps keys in
  an order of its own); projected from the `item_created` event's `body_json`. Null for
  every other item, and for every item created before.
- `ballast_erase_content` (0019) masks those too: `body_json` leaves the `item_created`
  payload and the row, and `logprobs` (each token's alternatives: token ids and their
  probabilities) leaves the `item_chunk` payload, as its token ids become -1.

No grant changes: the roles that write these rows have table-wide rights there.

Revision ID: 0023
Revises: 0022
"""

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

_ENDED = "('completed', 'failed', 'expired', 'cancelled')"
_ERASED = """'{"erased": true}'"""
# The response as jsonb, each escaped NUL (\u0000 not itself escaped) taken out of its text.
_RESPONSE = r"""regexp_replace(payload->>'body_json', '(?<!\\)((?:\\\\)*)\\u0000', '\1', 'g')::jsonb"""


def _erase(ordered: bool) -> str:
    """ballast_erase_content as 0019 made it, and (`ordered`) as this migration makes it."""
    body = f"jsonb_set(payload, '{{body}}', {_ERASED}) - 'body_json'" if ordered else \
        f"jsonb_set(payload, '{{body}}', {_ERASED})"
    body_left = "OR payload ? 'body_json'" if ordered else ""
    row_json = ", body_json = NULL" if ordered else ""
    row_left = "OR body_json IS NOT NULL" if ordered else ""
    chunk = "- 'logprobs'" if ordered else ""
    chunk_left = "OR payload ? 'logprobs'" if ordered else ""
    return f"""
        CREATE OR REPLACE FUNCTION public.ballast_erase_content(p_tenant text) RETURNS jsonb LANGUAGE plpgsql
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

          UPDATE events SET payload = {body}
            WHERE tenant = p_tenant AND type = 'item_created' AND payload->>'batch_id' = ANY (ended)
              AND (payload->'body' IS DISTINCT FROM {_ERASED} {body_left});
          GET DIAGNOSTICS n_requests = ROW_COUNT;
          UPDATE batch_items SET body = {_ERASED}{row_json} WHERE batch_id = ANY (ended)
            AND (body IS DISTINCT FROM {_ERASED} {row_left});

          UPDATE events SET payload = jsonb_set(payload, '{{token_ids}}',
              (SELECT coalesce(jsonb_agg(-1), '[]') FROM jsonb_array_elements(payload->'token_ids'))) {chunk}
            WHERE tenant = p_tenant AND type = 'item_chunk' AND payload->>'batch_id' = ANY (ended)
              AND (EXISTS (SELECT 1 FROM jsonb_array_elements(payload->'token_ids') t WHERE t <> '-1')
                   {chunk_left});
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
        """


def upgrade() -> None:
    op.execute("ALTER TABLE batch_items ADD COLUMN body_json text;")
    op.execute(_erase(ordered=True))


def downgrade() -> None:
    op.execute(_erase(ordered=False))
    op.execute("ALTER TABLE batch_items DROP COLUMN body_json;")
