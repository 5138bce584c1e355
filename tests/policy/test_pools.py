"""Model pools: which models are callable, with which context, and which pool a name is."""

from __future__ import annotations

from policy.placement import EngineView
from policy.pools import base_model, downgrade, embedding_models, pool_queue, served_models


def view(id: str, model: str, max_model_len: int = 0, draining: bool = False) -> EngineView:
    return EngineView(id, f"http://{id}", model, 0, 0, 8, draining=draining, max_model_len=max_model_len)


def test_the_own_model_is_listed_before_any_engine_and_first_after():
    assert served_models([], "tiny", 1024) == {"tiny": 1024}
    got = served_models([view("b", "zeta", 512), view("a", "alpha", 256), view("c", "tiny", 99)], "tiny", 1024)
    assert list(got.items()) == [("tiny", 1024), ("alpha", 256), ("zeta", 512)]  # the own's context is its settings'


def test_a_pool_takes_the_shortest_context_its_engines_announce_and_draining_ones_do_not_count():
    engines = [view("a", "m", 512), view("b", "m", 256), view("c", "m", 128, draining=True), view("d", "old")]
    assert served_models(engines, "tiny", 1024) == {"tiny": 1024, "m": 256, "old": 1024}
    assert "m" not in served_models([view("c", "m", 128, draining=True)], "tiny", 1024)


def test_embedding_models_are_the_own_by_its_settings_and_others_by_their_engines():
    embed = EngineView("e", "http://e", "emb", 0, 0, 8, task="embed")
    gone = EngineView("g", "http://g", "old-emb", 0, 0, 8, task="embed", draining=True)
    assert embedding_models([embed, gone, view("a", "chat")], "tiny", "generate") == {"emb"}
    assert embedding_models([view("a", "chat")], "tiny", "embed") == {"tiny"}
    # The own model's task is the deployment's setting, whatever an engine of it says.
    assert embedding_models([EngineView("t", "http://t", "tiny", 0, 0, 8, task="embed")], "tiny", "generate") == set()


def test_a_name_finds_its_pool_and_a_fine_tune_its_base():
    models = {"tiny": 1024, "org/m": 512, "org/m:v2": 512}
    assert base_model("org/m", models) == "org/m"
    assert base_model("ft:tiny:sfx:ftjob-1", models) == "tiny"
    assert base_model("ft:org/m:v2::ftjob-2", models) == "org/m:v2"  # the longest base it carries
    assert base_model("ft:org/m::ftjob-3", models) == "org/m"
    for unknown in ("gpt-9", "ft:gpt-9::ftjob-1", None, 7, ["tiny"]):
        assert base_model(unknown, models) is None


def test_each_model_has_its_own_queue():
    assert pool_queue("ballast-engine", "a") != pool_queue("ballast-engine", "b")
    assert pool_queue("ballast-engine", "a").startswith("ballast-engine")


def test_flex_for_a_busy_model_is_downgraded_once_to_a_served_calm_smaller_one():
    to, models = {"big": "small", "small": "tiny"}, {"big": 4096, "small": 2048, "tiny": 1024}

    def busy(*pools):
        return lambda p: p in pools

    assert downgrade("big", "flex", to, models, busy("big")) == "small"
    assert downgrade("big", "flex", to, models, busy("big", "small")) is None  # not on to "tiny": one step
    assert downgrade("big", "flex", to, models, busy()) is None  # calm: served as asked
    assert downgrade("big", "default", to, models, busy("big")) is None  # only flex is downgraded
    assert downgrade("big", "flex", to, {"big": 4096}, busy("big")) is None  # "small" not served here
    assert downgrade("other", "flex", to, models, busy("other")) is None  # nothing configured for it
