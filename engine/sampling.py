"""Checked requests (`protocol.requests.GenerationRequest`) to engine inputs, and engine
outputs back to text. Shared by batch items and interactive requests so both render
prompts and finish texts alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.text import detokenize
from protocol.errors import ProtocolError
from protocol.requests import CHAT, GenerationRequest, check_prompt_ids, fit_context


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    adapter: str | None = None  # a fine-tuned model's name: its LoRA adapter on the base model


@dataclass(frozen=True)
class Prepared:
    prompt: list[int]
    sampling: Sampling


def prepare(engine, req: GenerationRequest) -> Prepared | ProtocolError:
    """Render the prompt with the engine's own tokenizer and fit it to the context: the
    checks that need the model."""
    if req.endpoint == CHAT:
        prompt = engine.render_chat([dict(role=m.role, content=m.content) for m in req.messages])
    elif isinstance(req.prompt, tuple):
        prompt = list(req.prompt)
        if err := check_prompt_ids(prompt, engine.max_token_id):
            return err
    else:
        prompt = engine.render_text(req.prompt)
    room = fit_context(req, len(prompt), engine.spec.max_model_len)
    if isinstance(room, ProtocolError):
        return room
    adapter = req.model if req.model != engine.spec.name else None
    return Prepared(prompt, Sampling(room, req.temperature, req.top_p, req.seed, req.stop, req.ignore_eos, adapter))


def finish(engine, prompt: list[int], token_ids: list[int], s: Sampling,
           engine_reason: str | None) -> tuple[str, str, int]:
    """Text, finish_reason and completion-token count of a (possibly resumed) generation,
    from all its tokens: what vLLM's own detokenizer gives over one uninterrupted run (no
    trailing half character; stop strings found as vLLM finds them, also one that
    straddles a resume point)."""
    eos = bool(token_ids) and token_ids[-1] == engine.tokenizer.eos_token_id and not s.ignore_eos
    d = detokenize(engine.tokenizer, prompt, token_ids, stop=s.stop, stop_terminated=eos)
    if d.stop is not None:
        return d.text, "stop", d.num_tokens
    if eos:
        return d.text, "stop", len(token_ids)
    if len(token_ids) >= s.max_tokens:
        return d.text, "length", len(token_ids)
    return d.text, "stop" if engine_reason in (None, "stop") else engine_reason, len(token_ids)


def stopped(engine, prompt: list[int], token_ids: list[int], s: Sampling) -> bool:
    """Whether a stop string already ended these tokens (a resume must not run on)."""
    return bool(s.stop) and detokenize(engine.tokenizer, prompt, token_ids, stop=s.stop).stop is not None
