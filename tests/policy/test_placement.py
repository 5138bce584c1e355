from policy.placement import EngineView, load_score, rank


def ev(id, interactive=0, batch=0, model="m", max_seqs=8):
    return EngineView(id, f"http://{id}", model, interactive, batch, max_seqs)


def test_filters_by_model_and_prefers_the_least_interactive_load():
    engines = [ev("a", interactive=3), ev("b", interactive=1), ev("c", model="other")]
    assert [e.id for e in rank(engines, "m")] == ["b", "a"]  # the best, then the fallback
    assert [e.id for e in rank(engines, "other")] == ["c"]
    assert rank(engines, "nope") == []


def test_ties_break_on_batch_load_then_id():
    assert [e.id for e in rank([ev("b", batch=2), ev("a", batch=2), ev("c", batch=1)], "m")] == ["c", "a", "b"]
    assert rank([ev("b"), ev("a")], "m")[0].id == "a"


def test_load_score_is_normalised():
    assert load_score(ev("a")) == 1.0
    assert load_score(ev("a", interactive=8)) == 0.0
    assert load_score(ev("a", interactive=20)) == 0.0
