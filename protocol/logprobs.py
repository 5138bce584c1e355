"""Token logprobs: what is journaled of them, and OpenAI's two shapes made of it.

vLLM gives, per generated token, a dict of alternatives: the sampled token first, then the
top `logprobs` by rank (the sampled one once, where it is among them). Ballast keeps that
list as it is, `[token id, logprob]` pairs in vLLM's order, beside the token in the journal
(a batch item's chunks) or on the engine's stream, so that a resumed item's logprobs are
the whole run's. Texts are decoded at the end, over all the tokens, as vLLM decodes them
(engine/text.py `decode_alternatives`), and shaped here exactly as vLLM's OpenAI server
shapes them (`vllm/entrypoints/openai/chat_completion/serving.py::_create_chat_logprobs`,
`completion/serving.py::_create_completion_logprobs`): logprobs floored at -9999, chat's
`top_logprobs` the first `n` alternatives, completions' the first `n + 1`, keyed by text.
"""

from __future__ import annotations

from typing import Any

FLOOR = -9999.0  # what OpenAI (and vLLM) send for -inf

Alternatives = list[list[Any]]  # one position: [[token id, logprob], ...], the sampled token first
# One position: [text, logprob] pairs, the sampled token first. An echoed prompt's first
# token, which nothing precedes, is [[text, None]]: no logprob, no alternatives.
Decoded = list[Any]


def floor(logprob: float) -> float:
    return logprob if logprob >= FLOOR else FLOOR  # also NaN: never a JSON value Postgres refuses


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_content(positions: list[Decoded], top: int) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` of a chat completion (or of one stream chunk)."""
    return [dict(token=alts[0][0], logprob=floor(alts[0][1]), bytes=_bytes(alts[0][0]),
                 top_logprobs=[dict(token=t, logprob=floor(lp), bytes=_bytes(t)) for t, lp in alts[:top]])
            for alts in positions]


def chat(positions: list[Decoded], top: int) -> dict[str, Any]:
    return dict(content=chat_content(positions, top), refusal=None)


def completion(positions: list[Decoded], top: int, offset: int = 0) -> dict[str, Any]:
    """`choices[].logprobs` of a completion; `offset`: the text offset of its first token (a
    stream chunk's: where the previous chunk's tokens ended)."""
    text_offset: list[int] = []
    for alts in positions:
        text_offset.append(offset)
        offset += len(alts[0][0])
    return dict(tokens=[alts[0][0] for alts in positions],
                token_logprobs=[None if alts[0][1] is None else floor(alts[0][1]) for alts in positions],
                top_logprobs=[None if alts[0][1] is None else {t: floor(lp) for t, lp in alts[:top + 1]}
                              for alts in positions],
                text_offset=text_offset)


def next_offset(shaped: dict[str, Any]) -> int:
    """Where the next chunk's tokens start, after a completion chunk's `shaped` logprobs."""
    if not shaped["tokens"]:
        return 0
    return int(shaped["text_offset"][-1]) + len(shaped["tokens"][-1])
