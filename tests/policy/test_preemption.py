from policy.preemption import Running, SlotDemand, SlotState, batch_slots, floor_pause, resume_after, victims


def r(id, tier=10, unsaved=0, generated=0, started=0.0):
    return Running(id, tier, unsaved, generated, started)


def test_cap_drops_at_once_and_recovers_only_after_cool_down():
    calm = SlotDemand(interactive=0, max_seqs=8, busy_cap=1)
    busy = SlotDemand(interactive=2, max_seqs=8, busy_cap=1)
    s = SlotState(cap=8)
    s = batch_slots(busy, s, now=0.0)
    assert s.cap == 1
    s = batch_slots(calm, s, now=0.5)
    assert s.cap == 1 and s.calm_since == 0.5  # not yet: hysteresis
    s = batch_slots(busy, s, now=1.0)  # demand again: the calm period restarts
    assert s.cap == 1 and s.calm_since is None
    s = batch_slots(calm, s, now=1.2)
    s = batch_slots(calm, s, now=2.0, cool_down_s=2.0)
    assert s.cap == 1
    s = batch_slots(calm, s, now=3.2, cool_down_s=2.0)
    assert s.cap == 8 and s.calm_since is None


def test_reserved_slots_left_unused_are_lent_at_once_the_rest_after_the_calm():
    busy = SlotDemand(interactive=6, max_seqs=8, busy_cap=0, lendable=2)
    s = batch_slots(SlotDemand(interactive=8, max_seqs=8, busy_cap=0), SlotState(cap=0), now=0.0)
    s = batch_slots(busy, s, now=0.1)  # the reserved tenant's two requests ended: lent now
    assert s.cap == 2
    calm = SlotDemand(interactive=0, max_seqs=8, busy_cap=0, lendable=2)
    s = batch_slots(calm, s, now=0.2)
    assert s.cap == 2 and s.calm_since == 0.2  # the other six wait for the calm
    assert batch_slots(calm, s, now=2.3).cap == 8
    # Its request takes one back: the cap falls at once.
    assert batch_slots(SlotDemand(interactive=7, max_seqs=8, busy_cap=0, lendable=1), s, now=0.3).cap == 1


def test_interactive_is_never_capped_but_batch_never_goes_negative():
    s = batch_slots(SlotDemand(interactive=20, max_seqs=8, busy_cap=4), SlotState(8), now=0)
    assert s.cap == 0


def test_a_static_partition_holds_batch_to_its_share_idle_or_busy():
    assert batch_slots(SlotDemand(0, max_seqs=8, busy_cap=8, batch_max=4), SlotState(8), now=0).cap == 4
    assert batch_slots(SlotDemand(3, max_seqs=8, busy_cap=8, batch_max=4), SlotState(4), now=0).cap == 4
    # chat beyond its half takes slots from batch
    assert batch_slots(SlotDemand(6, max_seqs=8, busy_cap=8, batch_max=4), SlotState(4), now=0).cap == 2


def test_victims_lowest_tier_then_least_progress_then_newest_then_id():
    running = [
        r("a", tier=10, generated=50, started=1),
        r("b", tier=10, generated=5, started=1),
        r("c", tier=2, generated=0, started=9),  # a flex-tier request outranks batch
        r("d", tier=10, generated=5, started=3),  # newer than b, same progress
        r("e", tier=10, generated=5, started=3),  # same as d: id breaks the tie
    ]
    assert victims(running, cap=5) == []
    assert victims(running, cap=4) == ["d"]
    assert victims(running, cap=2) == ["d", "e", "b"]
    assert victims(running, cap=0) == ["d", "e", "b", "a", "c"]


def test_unsaved_tokens_count_as_progress_at_risk():
    assert victims([r("x", unsaved=10), r("y", generated=3)], cap=1) == ["y"]


def test_starvation_floor_holds_batch_to_its_share_only_after_the_grace():
    from policy.preemption import Floor, min_slots, starvation_floor

    assert min_slots(0.05, 256) == 12 and min_slots(0.01, 8) == 1 and min_slots(0.0, 8) == 0
    floor = Floor(min_slots=2)
    cap, floor = starvation_floor(0, floor, now=100.0, starve_after_s=30.0)
    assert cap == 0 and floor.squeezed_since == 100.0  # a surge begins: chat takes every slot
    cap, floor = starvation_floor(0, floor, now=129.9, starve_after_s=30.0)
    assert cap == 0
    cap, floor = starvation_floor(0, floor, now=130.0, starve_after_s=30.0)
    assert cap == 2 and floor.squeezed_since == 100.0  # starved long enough: the floor
    cap, floor = starvation_floor(1, floor, now=200.0, starve_after_s=30.0)
    assert cap == 2  # still squeezed: the floor stays
    cap, floor = starvation_floor(5, floor, now=201.0, starve_after_s=30.0)
    assert cap == 5 and floor.squeezed_since is None  # chat calmed: the squeeze is over
    cap, floor = starvation_floor(0, floor, now=202.0, starve_after_s=30.0)
    assert cap == 0  # a new squeeze waits out the grace again
    assert starvation_floor(0, Floor(0), now=0.0, starve_after_s=0.0)[0] == 0  # no floor: nothing kept


def test_resume_waits_the_fixed_cool_down_until_enough_spells_are_seen():
    assert resume_after([5.0] * 7, penalty_s=0.5, default_s=2.0) == 2.0


def test_resume_is_at_once_when_the_calm_spells_are_long():
    assert resume_after([3.0, 4.0, 2.5, 6.0, 3.5, 5.0, 2.8, 4.2], penalty_s=0.5, default_s=2.0) == 0.0


def test_resume_waits_out_the_short_spells_of_a_surge_and_takes_the_long_ones():
    # A surge's 0.2 s gaps cost more to resume into than they yield; the 3 s ones pay.
    spells = [0.2] * 20 + [3.0] * 5
    assert resume_after(spells, penalty_s=0.5, default_s=2.0) == 0.2


def test_resume_waits_longer_than_any_spell_when_none_pays_for_its_resumption():
    assert resume_after([0.1, 0.3, 0.2, 0.4] * 3, penalty_s=0.5, default_s=2.0) == 0.4


def test_resume_prices_the_same_spells_dearer_with_a_dearer_resumption():
    spells = [0.3] * 10 + [2.0] * 4
    assert resume_after(spells, penalty_s=0.1, default_s=2.0) == 0.0
    assert resume_after(spells, penalty_s=0.5, default_s=2.0) == 0.3


def test_a_training_step_on_the_floor_keeps_to_the_floor_s_share_of_the_time():
    # 40 ms steps at a 5 % share: 760 ms after each, so 40 of every 800 ms train.
    assert abs(floor_pause(0.040, 0.05) - 0.760) < 1e-9
    assert floor_pause(0.5, 1.0) == 0.0 and floor_pause(0.5, 0.0) == 0.0  # no floor: nothing to keep to
