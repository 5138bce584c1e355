from policy.lifecycle import TERMINAL, can_move, cancellable


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
