"""The API's placement hashes a prompt into the blocks vLLM's prefix cache keys: the same
token ids as the engine renders (vLLM's own tokenizer, in the engine), the engine's block
size; and the blocks it predicts a second request shares with a first are the tokens vLLM
itself then reports as prefix-cache hits."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from api.services.placer import HEAD_CHARS_PER_TOKEN, Placer
from config import Settings
from engine.sampling import Sampling
from policy.placement import EngineView
from policy.prefix import MAX_BLOCKS, block_hashes
from protocol.requests import CHAT, COMPLETIONS, GenerationRequest, Message

SYSTEM = "You are the ship's navigator. " * 12  # a long shared prefix: several blocks


def chat(*turns: str) -> GenerationRequest:
    roles = ["system"] + ["user", "assistant"] * len(turns)
    return GenerationRequest(CHAT, "ballast-tiny", tuple(Message(r, t) for r, t in zip(roles, (SYSTEM, *turns),
                                                                                       strict=False)))


def placer(tiny_model) -> Placer:
    p = Placer(Settings(model=tiny_model.path, served_model_name=tiny_model.name,
                        max_model_len=tiny_model.max_model_len))
    assert p.load() is not None
    return p


def test_the_blocks_are_those_of_the_engines_own_rendering(tiny_model, engine):
    p = placer(tiny_model)
    req = chat("Where are we?")
    ids = engine.render_chat([dict(role=m.role, content=m.content) for m in req.messages])  # vLLM's tokenizer
    assert len(ids) > 2 * engine.block_size  # vLLM CPU: 128-token blocks
    assert p.blocks(req, engine.block_size) == block_hashes(ids, engine.block_size)
    assert p.prompt(req).tokens == len(ids)  # the reservation's size: what the engine will count
    text = GenerationRequest(COMPLETIONS, "ballast-tiny", prompt=SYSTEM)
    assert p.blocks(text, engine.block_size) == block_hashes(engine.render_text(SYSTEM), engine.block_size)
    assert p.prompt(text).tokens == len(engine.render_text(SYSTEM))


def test_a_fine_tuned_models_blocks_are_its_own(tiny_model):
    """A request naming a fine-tuned model runs with its adapter, whose cache vLLM keeps
    apart: its blocks match neither the base model's nor another adapter's."""
    p = placer(tiny_model)
    base = chat("Where are we?")
    tuned, other = (replace(base, model=f"ft:ballast-tiny:x:ftjob-{n}") for n in (1, 2))
    a, b, c = (p.blocks(r, 16) for r in (base, tuned, other))
    assert len(a) == len(b) == len(c) > 2 and not set(a) & set(b) and not set(b) & set(c)
    assert p.blocks(replace(tuned), 16) == b


def test_a_giant_text_prompt_is_cut_to_its_head_and_not_counted(tiny_model):
    p = placer(tiny_model)
    giant = GenerationRequest(COMPLETIONS, "ballast-tiny", prompt="a " * (HEAD_CHARS_PER_TOKEN * MAX_BLOCKS * 128))
    prompt = p.prompt(giant)
    assert len(prompt.ids) >= MAX_BLOCKS * 128 and prompt.tokens is None  # estimated; the engine refuses it


async def test_the_predicted_shared_blocks_are_vllms_own_prefix_cache_hits(tiny_model, engine):
    p = placer(tiny_model)
    me = EngineView("e1", "http://e1", "ballast-tiny", 0, 0, 8, block_size=engine.block_size)
    run = uuid.uuid4().hex  # a prefix this engine has never seen, whatever ran before
    first, second = chat(f"{run}: where are we?"), chat(f"{run}: where are we?", "North.", "How far?")
    ranked, blocks = p.rank(first, [me])
    assert ranked == [me] and not p.index.matched(blocks)
    await generate(engine, first)
    p.sent(me, blocks)

    ranked, blocks = p.rank(second, [me])
    predicted = p.index.matched(blocks)["e1"] * engine.block_size
    before = engine.load.prefix_hits
    await generate(engine, second)
    assert predicted > 0 and engine.load.prefix_hits - before == predicted


async def generate(engine, req: GenerationRequest) -> None:
    ids = engine.render_chat([dict(role=m.role, content=m.content) for m in req.messages])
    async for _ in engine.generate(f"placer-{uuid.uuid4().hex}", ids, Sampling(1, temperature=0.0)):
        pass


def test_the_baseline_strategies_the_bench_compares_with(tiny_model):
    pool = [EngineView(x, f"http://{x}", "ballast-tiny", 0, 0, 8, block_size=16) for x in "abc"]
    req = chat("Where are we?")

    def picks(strategy: str, n: int = 6) -> list[str]:
        p = Placer(Settings(model=tiny_model.path, served_model_name=tiny_model.name, placement=strategy))
        p.load()
        out = []
        for _ in range(n):
            ranked, blocks = p.rank(req, pool)
            p.sent(ranked[0], blocks)
            p.done(ranked[0].id)  # finished before the next: only affinity keeps it in place
            out.append(ranked[0].id)
        return out

    assert len(set(picks("affinity"))) == 1
    assert picks("round_robin") == ["b", "c", "a", "b", "c", "a"]
    assert len(set(picks("least_loaded"))) == 1  # all idle: the same tiebreak, but no affinity in it
    p = Placer(Settings(model=tiny_model.path, served_model_name=tiny_model.name, placement="least_loaded"))
    p.load()
    ranked, blocks = p.rank(req, pool)
    p.sent(ranked[0], blocks)  # still in flight: the others are less loaded
    assert p.rank(req, pool)[0][0].id != ranked[0].id


def test_the_request_path_never_waits_for_the_tokenizer(tiny_model):
    p = Placer(Settings(model=tiny_model.path, served_model_name=tiny_model.name))
    pool = [EngineView("a", "http://a", "ballast-tiny", 0, 0, 8)]
    ranked, blocks = p.rank(chat("first"), pool)  # not loaded yet: placed by load, the load started
    assert ranked == pool and blocks == ()
    deadline = time.monotonic() + 30
    while p.rank(chat("later"), pool)[1] == ():
        assert time.monotonic() < deadline, "the tokenizer never loaded in the background"
        time.sleep(0.05)


def test_load_is_this_processs_streams_now_plus_the_others_as_reported(tiny_model):
    """An engine's own `interactive` is a peak over recent reports (the fleet controller's):
    placed by it, a burst that has ended would push every request elsewhere for seconds."""
    p = Placer(Settings(model=tiny_model.path, served_model_name=tiny_model.name, placement="least_loaded"))
    was_busy = EngineView("a", "http://a", "ballast-tiny", 5, 0, 8, others=0)  # its burst (ours) has ended
    quiet = EngineView("b", "http://b", "ballast-tiny", 0, 0, 8, others=0)
    assert p.in_flight(was_busy) == 0
    ranked, blocks = p.rank(chat("one"), [was_busy, quiet])
    p.sent(ranked[0], blocks)
    assert p.rank(chat("two"), [was_busy, quiet])[0][0].id != ranked[0].id  # ours, counted now
    shared = EngineView("c", "http://c", "ballast-tiny", 5, 0, 8, others=3)  # another API's three streams
    assert p.in_flight(shared) == 3
    old = EngineView("d", "http://d", "ballast-tiny", 5, 0, 8)  # a worker that does not count by API
    assert p.in_flight(old) == 5


def test_a_request_of_several_choices_is_that_many_sequences_of_load(tiny_model):
    p = Placer(Settings(model=tiny_model.path, served_model_name=tiny_model.name, placement="least_loaded"))
    a = EngineView("a", "http://a", "ballast-tiny", 0, 0, 8, others=0)
    p.sent(a, (), seqs=4)
    assert p.in_flight(a) == 4
    p.done("a", seqs=4)
    assert p.in_flight(a) == 0 and "a" not in p.inflight
