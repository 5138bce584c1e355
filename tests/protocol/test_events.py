"""The journal's event types have one home: what the migrations' fencing trigger refuses
unfenced, and what the projections read, are all names it defines."""

import importlib
import re

from journal import projections
from protocol.events import EventType


def test_the_fenced_types_of_the_migrations_are_event_types():
    migration = importlib.import_module("migrations.versions.0011_fences_enforced")
    fenced = set(re.findall(r"'(\w+)'", migration._ATTEMPT_EVENTS))
    assert fenced and fenced <= set(EventType)


def test_every_projected_type_is_an_event_type():
    assert projections._projectors and set(projections._projectors) <= set(EventType)


def test_item_payloads_keep_the_keys_the_journal_holds():
    """A retried append compares payloads with the row already there: the keys an item
    event has always had (written out here, not read from the classes) stay exactly so."""
    from dataclasses import asdict

    from protocol.events import (
        ItemChunk,
        ItemCompleted,
        ItemFailed,
        ItemPreempted,
        choice_key,
        chunk_payload,
        item_payload,
        item_result,
        preempted_payload,
    )

    held = {
        EventType.ITEM_CHUNK: {"batch_id", "idx", "offset", "token_ids", "runner"},
        EventType.ITEM_PREEMPTED: {"batch_id", "idx", "offset"},
        EventType.ITEM_COMPLETED: {"batch_id", "idx", "body_json"},
        EventType.ITEM_FAILED: {"batch_id", "idx", "status_code", "body_json"},
    }
    made = {
        EventType.ITEM_CHUNK: ItemChunk("b", 1, 0, [1, 2], "r"),
        EventType.ITEM_PREEMPTED: ItemPreempted("b", 1, 2),
        EventType.ITEM_COMPLETED: ItemCompleted("b", 1, "{}"),
        EventType.ITEM_FAILED: ItemFailed("b", 1, 400, "{}"),
    }
    for type_, p in made.items():
        d = (chunk_payload(p) if isinstance(p, ItemChunk) else preempted_payload(p) if isinstance(p, ItemPreempted)
             else asdict(p))
        assert set(d) == held[type_]
        assert item_payload(type_, d) == p
    with_logprobs = ItemChunk("b", 1, 0, [1], "r", [[[1, -0.5]]])
    assert set(chunk_payload(with_logprobs)) == held[EventType.ITEM_CHUNK] | {"logprobs"}
    assert item_payload(EventType.ITEM_CHUNK, chunk_payload(with_logprobs)) == with_logprobs
    # A second choice's events say which; its keys never meet the first choice's.
    second = ItemChunk("b", 1, 0, [1], "r", choice=1)
    assert set(chunk_payload(second)) == held[EventType.ITEM_CHUNK] | {"choice"}
    assert item_payload(EventType.ITEM_CHUNK, chunk_payload(second)) == second
    assert set(preempted_payload(ItemPreempted("b", 1, 2, 3))) == held[EventType.ITEM_PREEMPTED] | {"choice"}
    keys = {choice_key("item:b:1", "chunk", c, off) for c in range(3) for off in (0, 1, 10, 11)}
    assert len(keys) == 12 and choice_key("item:b:1", "chunk", 0, 5) == "item:b:1:chunk:5"
    assert item_result(EventType.ITEM_FAILED, asdict(made[EventType.ITEM_FAILED])).status_code == 400
    try:
        item_result(EventType.ITEM_CHUNK, asdict(made[EventType.ITEM_CHUNK]))
    except ValueError:
        pass
    else:
        raise AssertionError("a chunk is not a result")
