"""A running fine-tuning job's estimated finish: its steps left at its last chunk's pace."""

from __future__ import annotations

from journal.finetune_store import estimated_finish

LATEST = dict(step=10, total_steps=50, losses=[1.0] * 4, timing=dict(train_s=2.0), at_s=1_000.0)


def test_the_steps_left_at_the_last_chunks_pace_from_its_checkpoint():
    # 4 steps in 2 s: 0.5 s a step; 40 steps left → 20 s after the checkpoint.
    assert estimated_finish("running", LATEST, now=1_005.0) == 1_020


def test_an_overdue_estimate_is_now_not_the_past():
    assert estimated_finish("running", LATEST, now=1_030.4) == 1_030


def test_no_estimate_without_a_pace_or_unless_running():
    assert estimated_finish("running", None, now=0) is None
    assert estimated_finish("running", dict(LATEST, timing={}), now=0) is None
    assert estimated_finish("running", {k: v for k, v in LATEST.items() if k != "total_steps"}, now=0) is None
    for status in ("paused", "queued", "succeeded", "cancelled", "failed", "validating_files"):
        assert estimated_finish(status, LATEST, now=0) is None
