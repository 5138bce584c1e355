"""A tenant reads what an activity chose to say of its failure, never an exception's text."""

from __future__ import annotations

from temporalio.exceptions import ActivityError, ApplicationError, RetryState, TimeoutError, TimeoutType

from workflows.reasons import INTERNAL, told


def failed(cause: BaseException) -> ActivityError:
    err = ActivityError("activity failed", scheduled_event_id=1, started_event_id=2, identity="w", activity_type="a",
                        activity_id="1", retry_state=RetryState.MAXIMUM_ATTEMPTS_REACHED)
    err.__cause__ = cause
    return err


def test_what_an_activity_chose_to_say_is_told():
    assert told(failed(ApplicationError("The input file file-abc is missing.", non_retryable=True))) == \
        "The input file file-abc is missing."
    assert len(told(failed(ApplicationError("x" * 900)))) == 500


def test_an_exceptions_own_text_is_not():
    # What Temporal makes of an unexpected exception: its class name as the type.
    leak = ApplicationError('connection to server at "10.0.0.7", port 5432 failed: password authentication',
                            type="OperationalError")
    assert told(failed(leak)) == INTERNAL
    assert told(failed(TimeoutError("timeout", type=TimeoutType.START_TO_CLOSE,
                                    last_heartbeat_details=[]))) == "it timed out"
