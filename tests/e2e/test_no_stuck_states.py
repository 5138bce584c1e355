"""Every step that can fail ends the batch in a terminal state with a reason."""

from __future__ import annotations

import pytest

from tests.e2e.test_batch import chat_line, jsonl, wait_for

pytestmark = pytest.mark.e2e


def test_an_input_file_lost_by_the_object_store_fails_the_batch_with_a_reason(client, stack):
    f = client.files.create(file=("lost.jsonl", jsonl([chat_line("a", "hi", 4)])), purpose="batch")
    (stack.root / "objects" / "files" / f.id).unlink()  # the store lost it after the upload
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, b.id)
    assert done.status == "failed", done
    [error] = done.errors.data
    assert error.code == "validation_failed" and f.id in error.message


def test_a_batch_of_only_unstorable_lines_still_ends(client):
    """Valid JSON that Postgres cannot store: refused line by line, the batch completes."""
    raw = (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "ballast-tiny", '
           b'"messages": [{"role": "user", "content": "\\ud800"}]}}\n'
           b'{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "ballast-tiny", '
           b'"messages": [{"role": "user", "content": "nul \\u0000"}], "metadata": {"k": "\\udfff"}}}\n')
    f = client.files.create(file=("odd.jsonl", raw), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, b.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (0, 2)
    errs = client.files.content(done.error_file_id).text.splitlines()
    assert len(errs) == 2 and all('"unsupported_character"' in e for e in errs)
