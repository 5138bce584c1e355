"""The restart policy of `ballast up`'s supervision, alone."""

from policy.restarts import RestartPolicy, Streak, after_exit

P = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=8.0, healthy_after_s=30.0, max_quick_crashes=5)


def test_a_crash_after_a_healthy_run_restarts_at_once_and_starts_no_streak():
    r = after_exit(P, Streak(3), ran_s=120.0)
    assert (r.restart, r.delay_s, r.streak) == (True, 1.0, Streak(0))


def test_quick_crashes_back_off_doubling_to_the_cap_then_give_up():
    streak, delays = Streak(), []
    for _ in range(4):
        r = after_exit(P, streak, ran_s=2.0)
        assert r.restart
        delays.append(r.delay_s)
        streak = r.streak
    assert delays == [1.0, 2.0, 4.0, 8.0]
    r = after_exit(P, streak, ran_s=2.0)  # the fifth quick crash in a row: a loop
    assert not r.restart and r.streak == Streak(5)


def test_a_healthy_run_in_between_forgives_the_streak():
    r = after_exit(P, Streak(4), ran_s=45.0)
    assert r.restart and r.streak == Streak(0)
    assert after_exit(P, r.streak, ran_s=1.0).delay_s == 1.0


def test_a_process_killed_soon_after_it_said_it_was_ready_is_always_restarted():
    streak = Streak()
    for _ in range(10):  # killed from outside every few seconds, each time after it served
        r = after_exit(P, streak, ran_s=3.0, ready=True)
        assert (r.restart, r.delay_s) == (True, 1.0)
        streak = r.streak
    assert streak == Streak(0)
