"""engine.text against vLLM itself: the text vLLM's own detokenizer streams for a request
(Engine.generate(detokenize=True), the deltas joined) is the oracle for the text Ballast
derives from the token ids afterwards.

The tiny model writes bytes, about half of them outside ASCII, so generations that end
(or are resumed, or hit a stop string) inside a multi-byte UTF-8 character are common;
the cases below are picked so that many do.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from engine.sampling import Sampling
from engine.text import _check_stop_strings, completion_text, detokenize
from engine.vllm_engine import Engine

pytestmark = pytest.mark.engine

TOPICS = ["cats", "the sea", "Zürich", "привет", "日本語テキスト", "emoji 🚀🧪", "def f(x):", "", "résumé", "x" * 40]
N = 64  # tokens of each reference generation


async def run(engine: Engine, prompt: list[int], max_tokens: int,
              stop: list[str] | None = None) -> tuple[list[int], str, str | None]:
    """Tokens, vLLM's text (its deltas joined) and finish reason of one greedy request."""
    tokens, text, reason = [], "", None
    sampling = Sampling(max_tokens, temperature=0.0, stop=tuple(stop or ()))
    async for step in engine.generate(uuid.uuid4().hex, prompt, sampling, detokenize=True):
        tokens += step.token_ids
        text += step.text
        reason = step.finish_reason
    return tokens, text, reason


def prompts(engine: Engine) -> list[list[int]]:
    chat = [engine.render_chat([{"role": "user", "content": t}]) for t in TOPICS]
    plain = [engine.render_text(f"Request {i}: {t}") for i, t in enumerate(TOPICS)]
    # Token prompts (the completions endpoint takes them) that end inside a character:
    # vLLM primes its decoder with the prompt, so its first output bytes may complete it.
    cut = [engine.render_text(t)[:-1] for t in ("héllo é", "日本", "🚀🚀")]
    return chat + plain + cut


def mid_character(engine: Engine, tokens: list[int]) -> bool:
    return engine.decode(tokens).endswith("\ufffd")


async def references(engine: Engine) -> list[tuple[list[int], list[int], str]]:
    ps = prompts(engine)
    outs = await asyncio.gather(*(run(engine, p, N) for p in ps))
    return [(p, toks, text) for p, (toks, text, _) in zip(ps, outs, strict=True)]


async def test_text_equals_vllms_for_every_length(engine):
    refs = await references(engine)
    # For each prompt: lengths that stop inside a character, and some that do not.
    cases = []
    for p, toks, _ in refs:
        inside = [k for k in range(1, len(toks) + 1) if mid_character(engine, toks[:k])]
        clean = [k for k in range(1, len(toks) + 1) if k not in inside]
        cases += [(p, k) for k in inside[:: max(1, len(inside) // 5)][:5] + clean[::13][:2]]
    outs = await asyncio.gather(*(run(engine, p, k) for p, k in cases))

    stopped_inside = 0
    for (p, k), (toks, want, _) in zip(cases, outs, strict=True):
        got = completion_text(engine.tokenizer, p, toks)
        assert got == want, (p, k, toks)
        assert not want.endswith("\ufffd")  # vLLM holds a partial character back, for good
        stopped_inside += mid_character(engine, toks)
    assert stopped_inside >= 40, stopped_inside  # the cases that tell the two decodes apart
    # And the whole references (some of which end on EOS: decoded as "" either way).
    for p, toks, want in refs:
        assert completion_text(engine.tokenizer, p, toks) == want


async def test_resumed_text_equals_the_uninterrupted_run(engine):
    refs = await references(engine)
    resumed = []
    for p, toks, want in refs[:12]:
        # Resume inside a character where there is one: the first run ends with part of it.
        k = next((k for k in range(8, len(toks) - 1) if mid_character(engine, toks[:k])), len(toks) // 2)
        first, _, _ = await run(engine, p, k)
        rest, _, _ = await run(engine, p + first, N - k)  # what a retried activity submits
        assert first + rest == toks  # greedy resumes exactly (tests/engine/test_engine.py)
        resumed.append((p, first + rest, want))
    for p, toks, want in resumed:
        assert completion_text(engine.tokenizer, p, toks) == want


async def test_stop_strings_as_vllm_applies_them(engine):
    refs = await references(engine)
    cases = []
    for p, _, text in refs:
        wide = [c for c in text[4:] if len(c.encode()) > 1]
        if wide:  # completed by the last byte of a character
            cases += [(p, [wide[0]]), (p, ["\x00never", wide[0]])]
        if len(text) > 12:
            cases.append((p, [text[9:12], text[5:7]]))  # the earlier-completing one wins
    outs = await asyncio.gather(*(run(engine, p, N, stop=stop) for p, stop in cases))
    hits = 0
    for (p, stop), (toks, want, reason) in zip(cases, outs, strict=True):
        d = detokenize(engine.tokenizer, p, toks, stop=stop)
        assert d.text == want, (p, stop, toks)
        assert d.num_tokens == len(toks)  # vLLM stopped on the token that completed it
        if d.stop is not None:
            hits += 1
            assert reason == "stop" and d.stop in stop
    assert hits >= len(cases) - 2 and hits >= 20


async def test_a_stop_string_split_by_a_resume_point(engine):
    """A resumed vLLM request never sees a stop string begun before the resume point and
    generates on; the stop string is found over all the tokens, and `num_tokens` says how
    many the uninterrupted run would have kept."""
    checked = 0
    for p, _, text in (await references(engine))[:10]:
        # A 4-character stop string first found at character i >= 10. (Not one with U+FFFD:
        # vLLM emits a run of invalid bytes together with the next character, so such a
        # stop string may come out whole from one token, leaving nowhere to split it.)
        i = next((i for i in range(10, len(text) - 8)
                  if text.find(text[i : i + 4]) == i and "\ufffd" not in text[i - 1 : i + 5]), None)
        if i is None:
            continue
        stop = [text[i : i + 4]]
        want_toks, want, reason = await run(engine, p, N, stop=stop)
        assert reason == "stop" and want == text[:i]
        # Resume inside the stop string: after the token that adds its first character.
        k = next(k for k in range(1, len(want_toks)) if len(completion_text(engine.tokenizer, p, want_toks[:k])) > i)
        first, _, _ = await run(engine, p, k, stop=stop)
        assert first == want_toks[:k]
        rest, _, _ = await run(engine, p + first, N - k, stop=stop)
        tokens = first + rest
        assert len(tokens) > len(want_toks)  # the resumed request ran past it
        d = detokenize(engine.tokenizer, p, tokens, stop=stop)
        assert (d.text, d.num_tokens, d.stop) == (want, len(want_toks), stop[0])
        checked += 1
    assert checked >= 3


def test_stop_check_is_vllms():
    from vllm.v1.engine.detokenizer import check_stop_strings

    texts = ["", "a", "abc", "xxabcxx", "日本語abc", "ab" * 10]
    stops = [["b"], ["bc", "ab"], ["c", "abc"], ["x"], ["本語", "z"], ["bab", "aba"]]
    for t in texts:
        for s in stops:
            for new in range(0, len(t) + 1):
                for inc in (False, True):
                    assert _check_stop_strings(t, new, s, inc) == check_stop_strings(t, new, s, inc), (t, new, s)


def test_every_option_against_vllms_detokenizer_offline(tiny_model):
    """What Engine.generate does not expose (include_stop_str_in_output, specials kept,
    spaces_between_special_tokens, a stop-token ending), against vLLM's own
    FastIncrementalDetokenizer driven a token per step, on random byte soup."""
    import random
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    tok = get_tokenizer(tiny_model.path)
    rng = random.Random(1)

    def ids(n: int) -> list[int]:
        out = tok.encode("".join(rng.choice("ab é日🚀\n") for _ in range(n)), add_special_tokens=False)
        for _ in range(rng.randint(0, 3)):  # stray bytes and special tokens
            out.insert(rng.randrange(len(out) + 1), rng.choice([rng.randrange(256), 256 + rng.randrange(5)]))
        return out

    stopped = 0
    for _ in range(1500):
        prompt, out = ids(rng.randint(0, 12)), ids(rng.randint(0, 30))
        skip, spaces, include = (rng.random() < 0.5 for _ in range(3))
        terminated = bool(out) and rng.random() < 0.3
        whole = tok.decode(out, skip_special_tokens=False)
        stop = []
        if len(whole) > 2 and rng.random() < 0.6:
            stop = [whole[(i := rng.randrange(len(whole))) : i + rng.randint(1, 3)] for _ in range(rng.randint(1, 2))]
        params = SamplingParams(max_tokens=100, stop=stop or None, include_stop_str_in_output=include,
                                skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        vllm = FastIncrementalDetokenizer(tok, SimpleNamespace(request_id="r", prompt_token_ids=prompt,
                                                               sampling_params=params))
        hit = None
        for j, t in enumerate(out):
            if hit := vllm.update([t], terminated and j == len(out) - 1):
                break
        want = (vllm.get_next_output_text(finished=True, delta=False), len(vllm.output_token_ids), hit)
        d = detokenize(tok, prompt, out, stop=stop, include_stop_str_in_output=include, stop_terminated=terminated,
                       skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        assert (d.text, d.num_tokens, d.stop) == want, (prompt, out, stop, skip, spaces, include, terminated)
        stopped += hit is not None
    assert stopped > 300


def test_cost_per_token(tiny_model):
    """Batch finalisation calls this once per item: a few microseconds a token."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    rng = random.Random(0)
    prompt = tok.encode("héllo wörld 日本語")
    text = "".join(rng.choice("abc dé日本🚀\n") for _ in range(4000))
    ids = tok.encode(text, add_special_tokens=False)
    items = [ids[i : i + 500] for i in range(0, 20000, 500)]
    n = sum(map(len, items))
    t0 = time.perf_counter()
    for it in items:
        completion_text(tok, prompt, it)
    per_token = (time.perf_counter() - t0) / n
    assert per_token < 50e-6, per_token  # generous: shared CI cores; measured ~2–3 µs
