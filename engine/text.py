"""A completion's text from its token ids, exactly as vLLM's own detokenizer makes it.

Ballast deals in token ids (a preempted generation resumes from prompt + journaled
tokens), so the text is derived at the end, from all the tokens. It must be the text
vLLM's output processor would have produced over one uninterrupted run, which is not
`tokenizer.decode(token_ids)`:

- vLLM (v1, `vllm/v1/engine/detokenizer.py`, `FastIncrementalDetokenizer`) feeds the
  output tokens one at a time to a `tokenizers.decoders.DecodeStream` primed with the
  prompt's ids. A step that leaves an incomplete character (a multi-byte UTF-8 sequence
  split across tokens) yields nothing until a later token completes it; a generation
  that ends inside a character therefore simply lacks it, where `decode` ends in U+FFFD.
  The prompt priming matters too: decoders that strip a leading space decode the first
  output tokens in the prompt's context; and a (token-id) prompt that ends inside a
  character makes DecodeStream's first complete step return the prompt's own text as
  well ("héllo " + "é"), which vLLM passes on as output. Reproduced here, as it is.
- After each token, stop strings are searched in the text that token added (plus a
  stop string's length before it); the first to complete wins, the text is cut before
  it (or after it, with include_stop_str_in_output) and the request ends there: the
  tokens it counts are those up to and including the one that completed the stop string.
- A request that ends on a stop token (EOS, or a stop_token_id) does not detokenize
  that last token unless include_stop_str_in_output.

This module drives the same primitive, `DecodeStream`, the same way (including vLLM's
recovery when the stream reports an invalid prefix), and re-implements vLLM's 20-line
stop-string check so that it needs nothing of vLLM at import. Slow (pure-Python)
tokenizers, which vLLM detokenizes with `SlowIncrementalDetokenizer`, go through vLLM's
own helpers for that path.

- With min_tokens, stop strings are searched only in the text of tokens past the first
  min_tokens.

Output is one token per engine step, as without speculative
decoding; vLLM trims a multi-token step at the stop string to the same result.

Cost: one DecodeStream step per token, about 3 µs a token (tokenizer.decode: under 1 µs).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# The error tokenizers raises when its decode output stops being a prefix of the text so far.
_INVALID_PREFIX = "Invalid prefix encountered"


@dataclass(frozen=True)
class Detokenized:
    text: str
    # How many of the output tokens the request keeps: all of them, unless a stop string
    # completed before the last one (possible only when a resume point split the stop
    # string, since vLLM stops at the token that completes it).
    num_tokens: int
    stop: str | None = None  # the stop string that ended the text, if any


def completion_text(tokenizer: Any, prompt_ids: Sequence[int], token_ids: Sequence[int], *,
                    skip_special_tokens: bool = True) -> str:
    """The text vLLM's detokenizer gives `token_ids` generated after `prompt_ids` (no stop
    strings; the last token is decoded like any other)."""
    return detokenize(tokenizer, prompt_ids, token_ids, skip_special_tokens=skip_special_tokens).text


def detokenize(
    tokenizer: Any,
    prompt_ids: Sequence[int],
    token_ids: Sequence[int],
    *,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
    stop_terminated: bool = False,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    min_tokens: int = 0,
) -> Detokenized:
    """vLLM's final text for a request, with its stop strings applied.

    `stop_terminated`: the request ended on a stop token (its last token is EOS while
    EOS is not ignored, or one of stop_token_ids); vLLM then leaves that token out of
    the text unless include_stop_str_in_output.
    """
    tokens = list(token_ids)
    if stop_terminated and tokens and not include_stop_str_in_output:
        decoded = tokens[:-1]
    else:
        decoded = tokens
    step = _stepper(tokenizer, list(prompt_ids), skip_special_tokens, spaces_between_special_tokens)
    stops = [stop] if isinstance(stop, str) else [s for s in stop if s]

    if not stops:
        return Detokenized("".join(step(t) for t in decoded), len(tokens))

    text = ""
    for i, t in enumerate(decoded):
        new = step(t)
        if not new:
            continue
        text += new
        if i < min_tokens:
            continue
        hit = _check_stop_strings(text, len(new), stops, include_stop_str_in_output)
        if hit is not None:
            matched, truncate_to = hit
            if truncate_to != -1:
                text = text[:truncate_to]
            return Detokenized(text, i + 1, matched)
    return Detokenized(text, len(tokens))


CONTEXT = 4  # preceding sampled tokens vLLM rebuilds a split character from (enough for any UTF-8 one)


def decode_alternatives(tokenizer: Any, token_ids: Sequence[int], alternatives: Sequence[Sequence[Sequence[Any]]],
                        start: int = 0) -> list[list[Any]]:
    """Each logprob alternative's text (protocol/logprobs.py), as vLLM's LogprobsProcessor
    decodes them: token by token, a text that ends in U+FFFD (a character split across
    byte tokens) rebuilt from up to 4 preceding sampled tokens. `alternatives[i]` is the
    position `start + i` of `token_ids` (all the generation's tokens: the context is the
    whole run's, across resumes, as in one uninterrupted vLLM request)."""
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

    vllm = LogprobsProcessor(tokenizer=tokenizer, logprobs=[], prompt_logprobs=None, cumulative_logprob=0.0,
                             num_logprobs=0, num_prompt_logprobs=None)
    out = []
    for i, alts in enumerate(alternatives, start):
        ids = [int(a[0]) for a in alts]
        texts = vllm._verify_tokens(decoded_tokens_list=convert_ids_list_to_tokens(tokenizer, ids), tokens=ids,
                                    context_token_ids=list(token_ids[max(0, i - CONTEXT):i]))
        out.append([(t, float(a[1])) for t, a in zip(texts, alts, strict=True)])
    return out


def _stepper(tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool, spaces_between: bool):
    """A function token id -> the text that token adds, as vLLM's detokenizer steps it."""
    fast = _fast_tokenizer(tokenizer)
    if fast is None:
        return _slow_stepper(tokenizer, prompt_ids, skip_special_tokens, spaces_between)

    stream = DecodeStream(ids=prompt_ids, skip_special_tokens=skip_special_tokens)
    # vLLM: spaces between special tokens are suppressed only when specials are kept
    # and the caller asked for it.
    added: dict[int, str] = {}
    if not (skip_special_tokens or spaces_between):
        added = {tid: tok.content for tid, tok in fast.get_added_tokens_decoder().items()}
    last_special = False

    def step(token_id: int) -> str:
        nonlocal stream, last_special
        try:
            piece = stream.step(fast, token_id)
        except (OverflowError, TypeError):  # vLLM logs these and yields nothing
            piece = None
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            # vLLM restarts the stream, without the prompt, at this token.
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            piece = stream.step(fast, token_id)
        if added:
            special = added.get(token_id)
            if special is not None and last_special:
                piece = special
            last_special = special is not None
        return piece or ""

    return step


def _fast_tokenizer(tokenizer: Any) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` vLLM would stream with, or None for a slow tokenizer."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    try:  # what vLLM tests for (uses_fast_detokenizer); transformers < 5 calls it this
        from transformers import TokenizersBackend as Fast
    except ImportError:
        from transformers import PreTrainedTokenizerFast as Fast

    if isinstance(tokenizer, Fast):
        return tokenizer._tokenizer
    return None


def _slow_stepper(tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool, spaces_between: bool):
    from vllm.tokenizers.detokenizer_utils import convert_prompt_ids_to_tokens, detokenize_incrementally

    all_ids = list(prompt_ids)
    prev, prefix_offset, read_offset = convert_prompt_ids_to_tokens(
        tokenizer=tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)

    def step(token_id: int) -> str:
        nonlocal prefix_offset, read_offset
        all_ids.append(token_id)
        new_tokens, piece, prefix_offset, read_offset = detokenize_incrementally(
            tokenizer=tokenizer, all_input_ids=all_ids, prev_tokens=prev, prefix_offset=prefix_offset,
            read_offset=read_offset, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between)
        prev.extend(new_tokens)
        return piece

    return step


def _check_stop_strings(text: str, new_chars: int, stop: list[str], include: bool) -> tuple[str, int] | None:
    """vLLM's `check_stop_strings`: the stop string completing earliest in the new text
    (ties by list order), and where to cut (-1: nowhere)."""
    if not new_chars or not stop:
        return None
    best, best_index, best_end = None, 0, sys.maxsize
    for s in stop:
        i = text.find(s, 1 - new_chars - len(s))
        if i != -1 and i + len(s) < best_end:
            best, best_index, best_end = s, i, i + len(s)
    if best is None:
        return None
    if include:
        return best, (-1 if best_end >= len(text) else best_end)
    return best, best_index
