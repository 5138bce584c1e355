from policy.lifecycle import TERMINAL, can_move, cancellable, estimated_completion, finalize_plan, pace_end


def test_happy_path_and_cancel_path():
    assert can_move("validating", "in_progress") and can_move("in_progress", "finalizing")
    assert can_move("finalizing", "completed")
    assert can_move("in_progress", "cancelling") and can_move("cancelling", "cancelled")


def test_stale_and_terminal_moves_are_refused():
    assert not can_move("cancelling", "in_progress")  # the workflow lost the race to the API
    assert not can_move("finalizing", "cancelling")
    for status in TERMINAL:
        assert not cancellable(status)
        assert not any(can_move(status, s) for s in ("in_progress", "cancelling", "completed"))


def test_cancel_is_a_move_only_before_finalizing():
    assert cancellable("validating") and cancellable("in_progress")
    # `cancelling` is answered again by the API, but it is no move.
    for status in ("cancelling", "finalizing", *TERMINAL):
        assert not cancellable(status)


def test_finalize_ends_a_run_as_the_workflow_says_through_finalizing():
    assert finalize_plan("in_progress", "completed") == ("finalizing", "completed")
    assert finalize_plan("in_progress", "expired") == ("finalizing", "expired")
    assert finalize_plan("finalizing", "completed") == ("finalizing", "completed")  # a retry
    for interim, final in (("finalizing", "completed"), ("finalizing", "expired")):
        assert can_move("in_progress", interim) and can_move(interim, final)
        assert not cancellable(interim)  # a cancel during finalization cannot strand it


def test_finalize_ends_a_cancelled_batch_cancelled_whatever_the_run_reached():
    # The cancel landed after every item was done: the workflow says completed.
    assert finalize_plan("cancelling", "completed") == ("cancelling", "cancelled")
    assert finalize_plan("cancelling", "expired") == ("cancelling", "cancelled")
    assert finalize_plan("cancelling", "cancelled") == ("cancelling", "cancelled")
    assert finalize_plan("in_progress", "cancelled") == ("cancelling", "cancelled")
    assert can_move("in_progress", "cancelling") and can_move("cancelling", "cancelled")
    assert not can_move("cancelling", "completed")  # why the plan must say cancelled


def test_finalize_leaves_a_final_batch_alone():
    for status in TERMINAL:
        for outcome in ("completed", "cancelled", "expired"):
            assert finalize_plan(status, outcome) is None


def test_a_batchs_estimated_completion_follows_its_measured_pace():
    # 40 of 100 items ended in the 20 s since it started: 50 s in all, 30 s from now.
    assert estimated_completion("in_progress", 1000.0, 40, 100, now=1020.0) == 1050
    assert estimated_completion("in_progress", 1000.0, 0, 100, now=1020.0) is None  # no pace yet
    assert estimated_completion("validating", None, 0, 100, now=1020.0) is None
    assert estimated_completion("finalizing", 1000.0, 100, 100, now=1020.0) is None  # no longer running
    assert estimated_completion("in_progress", 1000.0, 100, 100, now=1020.0) == 1020  # all ended: now
    assert estimated_completion("in_progress", 1000.0, 50, 100, now=999.0) == 1000  # never before now
    assert pace_end(dict(finalizing_at=1030, completed_at=1040), now=2000.0) == 1030
    assert pace_end(dict(cancelling_at=1010, cancelled_at=1015), now=2000.0) == 1010
    assert pace_end(dict(in_progress_at=1000), now=2000.0) == 2000
