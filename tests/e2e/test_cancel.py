"""Cancel at any point, end to end: the answer is a 2xx or a 4xx, the batch ends in one
final status, and every item is in the output or the error file exactly once. Where a
cancel must land before items finish, the engine gate holds them: not a race with the engine."""

from __future__ import annotations

import openai
import pytest

from protocol import keys
from tests.e2e.test_batch import chat_line, read_jsonl, submit, wait_for

pytestmark = pytest.mark.e2e


def cancel(client, batch_id) -> str:
    """The status a cancel reports, or `refused: <status>` for its 400."""
    try:
        return client.batches.cancel(batch_id).status
    except openai.BadRequestError as err:
        assert isinstance(err.body, dict), err
        message = err.body["message"]
        assert err.body["code"] == "invalid_state" and message.startswith("Cannot cancel a batch with status "), err
        return "refused: " + message.removeprefix("Cannot cancel a batch with status ").rstrip(".")


def each_item_once(client, batch, custom_ids) -> tuple[list[str], list[dict]]:
    out = read_jsonl(client, batch.output_file_id) if batch.output_file_id else []
    err = read_jsonl(client, batch.error_file_id) if batch.error_file_id else []
    assert sorted(o["custom_id"] for o in out + err) == sorted(custom_ids)
    return [o["custom_id"] for o in out], err


def test_cancel_twice_right_after_create(client, gate):
    gate.hold(0)  # however fast the engine, nothing finishes before the cancel lands
    lines = [chat_line(f"r{i}", f"right away {i}", 4) for i in range(3)]
    batch = submit(client, lines)
    first = cancel(client, batch.id)
    second = cancel(client, batch.id)
    assert first in ("cancelling", "cancelled"), first
    # The workflow may have finished the cancel in between: then it is a 400 saying so.
    assert second in ("cancelling", "cancelled", "refused: cancelled"), second
    done = wait_for(client, batch.id, timeout=120)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at, done
    out, err = each_item_once(client, done, [ln["custom_id"] for ln in lines])
    assert all(e["error"]["code"] == "batch_cancelled" for e in err if e["custom_id"] not in out)
    assert cancel(client, batch.id) == "refused: cancelled"


def test_cancel_twice_mid_run(client, stack, gate):
    gate.hold(10)  # the short items finish below it; the long ones are held mid-run
    lines = [chat_line(f"short-{i}", f"short {i}", 2) for i in range(2)]
    lines += [chat_line(f"long-{i}", f"long {i}", 200, ignore_eos=True) for i in range(2)]
    batch = submit(client, lines)
    wait_for(client, batch.id, until=lambda b: b.request_counts.completed >= 2, timeout=120)
    stack.wait_held({keys.item(batch.id, i): 10 for i in (2, 3)})
    assert cancel(client, batch.id) in ("cancelling", "cancelled")
    assert cancel(client, batch.id) in ("cancelling", "cancelled", "refused: cancelled")
    done = wait_for(client, batch.id, timeout=120)
    assert done.status == "cancelled", done
    out, err = each_item_once(client, done, [ln["custom_id"] for ln in lines])
    assert set(out) == {"short-0", "short-1"}
    assert [e["custom_id"] for e in err] == ["long-0", "long-1"]
    assert all(e["error"]["code"] == "batch_cancelled" for e in err)


def test_cancel_after_completion_is_refused_and_changes_nothing(client):
    lines = [chat_line(f"d{i}", f"done {i}", 2) for i in range(2)]
    done = wait_for(client, submit(client, lines).id, timeout=120)
    assert done.status == "completed", done
    assert cancel(client, done.id) == "refused: completed"
    assert cancel(client, done.id) == "refused: completed"
    again = client.batches.retrieve(done.id)
    assert again.status == "completed" and again.cancelling_at is None
    out, err = each_item_once(client, again, [ln["custom_id"] for ln in lines])
    assert out == ["d0", "d1"] and not err
