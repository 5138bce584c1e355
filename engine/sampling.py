"""Checked requests (`protocol.requests.GenerationRequest`) to engine inputs, and engine
outputs back to text. Shared by batch items and interactive requests so both render
prompts and finish texts alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine import tools
from engine.text import decode_alternatives, detokenize
from protocol import responses
from protocol.errors import ProtocolError, storable
from protocol.requests import CHAT, MIN_OVER_MAX, GenerationRequest, check_prompt_ids, fit_context


@dataclass(frozen=True)
class Sampling:
    """What vLLM's SamplingParams get (by the same names), and the detokenizer's options."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    adapter: str | None = None  # a fine-tuned model's name: its LoRA adapter on the base model
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None  # alternatives per token (None: no logprobs)
    # Structured outputs: vLLM's StructuredOutputsParams keywords (json, json_object, regex,
    # choice, grammar); None: free text.
    grammar: dict[str, Any] | None = None
    prompt_logprobs: int | None = None  # alternatives per prompt token (an echo's; None: none)

    def stop_token(self, engine, token_id: int) -> bool:
        """Whether vLLM ends a request on this token: EOS (unless ignored) or a stop token id."""
        return (token_id == engine.tokenizer.eos_token_id and not self.ignore_eos) or token_id in self.stop_token_ids


@dataclass(frozen=True)
class Prepared:
    prompt: list[int]
    sampling: Sampling
    calls: tools.Calls | None = None  # where its output is read for tool calls


def prepare(engine, req: GenerationRequest) -> Prepared | ProtocolError:
    """Render the prompt with the engine's own tokenizer and fit it to the context: the
    checks that need the model."""
    if req.endpoint == CHAT:
        try:
            messages, tool_dicts = req.chat_inputs()
            prompt = engine.render_chat(messages, req.chat_template_kwargs, tool_dicts)
        except Exception as err:  # a template that cannot take what the request gave it
            if not req.chat_template_kwargs:
                raise
            return ProtocolError(400, "invalid_value", storable(f"The chat template failed with the given "
                                 f"`chat_template_kwargs`: {err}"), "chat_template_kwargs")
    elif isinstance(req.prompt, tuple):
        prompt = list(req.prompt)
        if bad := check_prompt_ids(prompt, engine.max_token_id):
            return bad
    else:
        prompt = engine.render_text(req.prompt)
    room = fit_context(req, len(prompt), engine.spec.max_model_len)
    if isinstance(room, ProtocolError):
        return room
    if bad := check_token_ids(engine, req):
        return bad
    if req.echo and req.logprobs is not None and getattr(engine, "adapters", None) is not None:
        # vLLM 0.32 computes prompt logprobs through its LoRA logits layer, which fails (on
        # CPU, with max_loras set) and takes the engine core down with it: every request on it.
        return ProtocolError(400, "unsupported_value", "`echo` with `logprobs` is not served by engines that serve "
                             "fine-tuned models (vLLM's prompt logprobs fail with LoRA enabled); `echo` alone is.",
                             "echo")
    if req.max_tokens == 0:  # an echo of the prompt alone: vLLM generates (and counts) one token, unshown
        room = 1
    if req.min_tokens > room:  # as vLLM refuses it, against the room the context leaves
        return ProtocolError(400, MIN_OVER_MAX, f"`min_tokens` is {req.min_tokens}, more than the "
                             f"{room} tokens the completion may take.", "min_tokens")
    if no := tools.refusal(engine, req):
        return no
    try:
        calls = tools.Calls(engine, req) if tools.parsing(req) else None
    except ValueError as err:  # tools vLLM's parser cannot take (a pydantic error is one)
        return ProtocolError(400, "invalid_value", storable(f"The tools were refused: {err}"), "tools")
    adapter = req.model if req.model != engine.spec.name else None
    s = Sampling(
        room, req.temperature, req.top_p, req.seed, req.stop, req.ignore_eos, adapter,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, top_k=req.top_k, min_p=req.min_p,
        min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens, logprobs=req.logprobs,
        grammar=req.grammar, prompt_logprobs=req.logprobs if req.echo else None)
    if calls is not None:
        s = calls.constrain(s)
        if s.grammar and s.min_tokens:  # as with structured outputs (protocol/requests.py)
            return ProtocolError(400, "unsupported_value", "`min_tokens` with tools that constrain the output (a "
                                 "forced call, or a strict tool) is not supported.", "min_tokens")
    return Prepared(prompt, s, calls)


def check_token_ids(engine, req: GenerationRequest) -> ProtocolError | None:
    """Token ids a request names must be in the vocabulary, as vLLM requires."""
    for param, ids in (("logit_bias", [t for t, _ in req.logit_bias]), ("stop_token_ids", req.stop_token_ids)):
        if ids and max(ids) > engine.max_token_id:
            return ProtocolError(400, "invalid_value", f"`{param}` names token id {max(ids)}, out of vocabulary "
                                 f"(the largest is {engine.max_token_id}).", param)
    return None


def finish(engine, prompt: list[int], token_ids: list[int], s: Sampling,
           engine_reason: str | None) -> tuple[str, str, int]:
    """Text, finish_reason and completion-token count of a (possibly resumed) generation,
    from all its tokens: what vLLM's own detokenizer gives over one uninterrupted run (no
    trailing half character; stop strings found as vLLM finds them, also one that
    straddles a resume point)."""
    eos = bool(token_ids) and s.stop_token(engine, token_ids[-1])
    d = detokenize(engine.tokenizer, prompt, token_ids, stop=s.stop, stop_terminated=eos,
                   include_stop_str_in_output=s.include_stop_str_in_output, min_tokens=s.min_tokens,
                   skip_special_tokens=s.skip_special_tokens,
                   spaces_between_special_tokens=s.spaces_between_special_tokens)
    if d.stop is not None:
        return d.text, "stop", d.num_tokens
    if eos:
        return d.text, "stop", len(token_ids)
    if len(token_ids) >= s.max_tokens:
        return d.text, "length", len(token_ids)
    return d.text, "stop" if engine_reason in (None, "stop") else engine_reason, len(token_ids)


def stopped(engine, prompt: list[int], token_ids: list[int], s: Sampling) -> bool:
    """Whether a stop string already ended these tokens (a resume must not run on)."""
    return bool(s.stop) and detokenize(
        engine.tokenizer, prompt, token_ids, stop=s.stop, include_stop_str_in_output=s.include_stop_str_in_output,
        min_tokens=s.min_tokens, skip_special_tokens=s.skip_special_tokens,
        spaces_between_special_tokens=s.spaces_between_special_tokens).stop is not None


def choice(s: Sampling, index: int) -> Sampling:
    """The sampling of a request's choice `index`: vLLM's parallel sampling gives child i
    the parent's seed + i (vllm/v1/engine/parallel_sampling.py), so seeded choices differ
    and each is vLLM's own."""
    return s if s.seed is None or index == 0 else replace(s, seed=s.seed + index)


def resumed(s: Sampling, tokens: list[int]) -> Sampling:
    """The sampling of a generation that goes on after `tokens` (now in its prompt)."""
    if not tokens:
        return s
    return replace(s, max_tokens=s.max_tokens - len(tokens), min_tokens=max(0, s.min_tokens - len(tokens)))


def logprobs(engine, req: GenerationRequest, tokens: list[int], alternatives: list[Any],
             echoed: list[Any] | None = None) -> dict[str, Any] | None:
    """A whole choice's logprobs from every token's journaled alternatives; `echoed`: the
    prompt's (decoded, protocol/logprobs.py), before them."""
    if req.logprobs is None:
        return None
    shown = decode_alternatives(engine.tokenizer, tokens, alternatives) if req.max_tokens != 0 else []
    return responses.shaped_logprobs(req.endpoint, (echoed or []) + shown, req.logprobs)


def echo_text(engine, req: GenerationRequest, prompt: list[int]) -> str:
    """The prompt as an echo shows it: as given, or token ids decoded (as vLLM decodes them)."""
    return req.prompt if isinstance(req.prompt, str) else engine.tokenizer.decode(prompt)


async def prompt_logprobs(engine, request_id: str, prompt: list[int], s: Sampling) -> list[Any]:
    """An echo's prompt logprobs on their own (a batch item's, which may have run in several
    requests): one more request over the prompt, as vLLM computes them in the first."""
    async for step in engine.generate(request_id, prompt, replace(s, max_tokens=1, min_tokens=0, grammar=None)):
        if step.prompt_logprobs is not None:
            return step.prompt_logprobs
    raise RuntimeError("vLLM gave no prompt logprobs")
