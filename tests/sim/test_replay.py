import dataclasses

import pytest

from ballast.cli import main
from policy.placement import rendezvous
from sim import replay as rp
from sim.replay import ArmRecord, Figures, Fit, Recording, Served, dump, fit, imbalance, load, relabel, replay_arm

# A decode step of 1 ms, prefill of 1 µs a token: every request below is done within 0.03 s,
# long before the next one arrives a second later, so no decision reads a load.
FIT = Fit(prefill_s_per_token=1e-6, ttft_intercept_s=0.0, step_s=0.001, seq_s=0.0, samples=0)
ENGINES = ("eng-a", "eng-b")
NONE = Figures(0, 0.0, 1.0, 0.0, 0.0)


def first_pick(block: int) -> str:
    """Where a new prefix goes with nothing in flight: the higher rendezvous hash (policy/placement.py)."""
    return max(ENGINES, key=lambda e: rendezvous(block, e))


def served(i: int, blocks: tuple[int, ...], engine: str, trace: str = "prefix_heavy", tenant: int = 0) -> Served:
    at = float(i)
    return Served(f"r{i}", trace, at, tenant, tenant, 128 * len(blocks) + 10, 16, blocks, engine, 0.02, at + 0.05)


def recording(arm: str, requests: list[Served], engines: tuple[str, ...] = ENGINES) -> Recording:
    traces = dict.fromkeys(r.trace for r in requests)
    return Recording(128, 8192, 200_000, 16, 40.0, 3.0,
                     (ArmRecord(arm, engines, 256, tuple(requests), tuple((t, NONE) for t in traces)),))


def test_round_robin_alternates_from_the_second_engine_as_the_placer_turns():
    # The placer's turn starts at 0 and moves before it picks: the first request goes to the
    # second engine by id, then they alternate, whatever the prompts.
    expected = ["eng-b", "eng-a", "eng-b", "eng-a"]
    rec = recording("round_robin", [served(i, (100 + i,), e) for i, e in enumerate(expected)])
    out = replay_arm(rec, rec.arms[0], FIT)
    assert [e for _, e in out.placed] == expected
    assert out.same_engine == 1.0 and not out.relabelled


def test_affinity_keeps_each_prefix_where_it_first_went():
    # Two tenants, each a conversation whose later turns extend the first turn's blocks.
    one, two = first_pick(1), first_pick(7)
    turns = [((1, 2), one), ((7, 8), two), ((1, 2, 3), one), ((7, 8, 9), two), ((1, 2, 3, 4), one)]
    rec = recording("affinity", [served(i, b, e, tenant=int(b[0] == 7)) for i, (b, e) in enumerate(turns)])
    out = replay_arm(rec, rec.arms[0], FIT)
    assert [e for _, e in out.placed] == [e for _, e in turns]
    # Hits: the follow-ups find their leading blocks cached (and vLLM recomputes a last token).
    sim = out.trace("prefix_heavy").sim
    queried = sum(128 * len(b) + 10 for b, _ in turns)
    assert sim.hit_rate == round((2 * 128 + 2 * 128 + 3 * 128) / queried, 3)


def test_engines_are_matched_up_to_relabelling():
    # The real run's ids are the sim's; swap them in the record and the matching swaps back.
    expected = ["eng-b", "eng-a", "eng-b", "eng-a"]
    swap = {"eng-a": "eng-b", "eng-b": "eng-a"}
    rec = recording("round_robin", [served(i, (100 + i,), swap[e]) for i, e in enumerate(expected)])
    out = replay_arm(rec, rec.arms[0], FIT)
    assert out.same_engine == 1.0 and out.relabelled
    assert dict(out.labels) == swap
    # Most agreement wins: two of three say sim p is real q.
    assert relabel([("q", "p"), ("q", "p"), ("p", "p")], ["p", "q"]) == {"p": "q", "q": "p"}


def test_imbalance_is_the_benchs_measure():
    assert imbalance([(0.0, 1.0, "a"), (0.0, 1.0, "b")], 2) == (1.0, 200)
    assert imbalance([(0.0, 1.0, "a"), (0.0, 1.0, "a"), (0.0, 1.0, "b")], 2)[0] == pytest.approx(4 / 3, abs=1e-3)
    assert imbalance([(0.0, 1.0, "a")], 2) == (1.0, 0)  # one in flight: no moment counts


def test_fit_recovers_a_linear_engine():
    def ttft(i: int) -> float:
        return 0.03 + 2e-5 * (200 + 100 * i)

    plain = [Served(f"p{i}", "no_reuse", 10.0 * i, -1, -1, 200 + 100 * i, 16, (), "eng-a", ttft(i),
                    10.0 * i + ttft(i) + 15 * 0.012) for i in range(5)]
    rec = recording("affinity", plain)
    f = fit(rec)
    assert f.prefill_s_per_token == pytest.approx(2e-5) and f.ttft_intercept_s == pytest.approx(0.03)
    assert f.step_s == pytest.approx(0.012) and f.seq_s == 0.0  # one in flight at a time: no slope to fit


def test_replay_is_deterministic_and_the_recording_round_trips(tmp_path):
    reqs = [served(i, (i % 3, 50 + i), ENGINES[i % 2]) for i in range(8)]
    plain = [dataclasses.replace(served(20 + i, (900 + i,), ENGINES[i % 2], trace="no_reuse", tenant=-1),
                                 ttft=0.01 + 0.001 * i) for i in range(4)]
    rec = recording("affinity", plain + reqs)
    dump(rec, tmp_path / "rec.json")
    assert load(tmp_path / "rec.json") == rec
    first, second = rp.replay(rec), rp.replay(load(tmp_path / "rec.json"))
    assert first == second
    assert {c.what for c in rp.verdict(first)} >= {"affinity: same engine ≥ 90%"}


def test_ballast_sim_replay_prints_the_table(tmp_path, capsys):
    expected = ["eng-b", "eng-a", "eng-b", "eng-a"]
    rec = recording("round_robin", [served(i, (100 + i,), e) for i, e in enumerate(expected)])
    dump(rec, tmp_path / "rec.json")
    assert main(["sim", "replay", str(tmp_path / "rec.json")]) == 0
    out = capsys.readouterr().out
    assert "| round_robin | prefix_heavy | 0 | 100.0% |" in out and "round_robin: same engine ≥ 100% | met" in out
    with pytest.raises(SystemExit):
        main(["sim", "replay", str(tmp_path / "missing.json")])
