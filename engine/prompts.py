"""A request's prompt as token ids, as the engine feeds vLLM: the engine worker renders
with these, and the API (to hash the prompt's leading blocks for placement) with the same
tokenizer files, so both get the same ids. Imports nothing heavy."""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict], template_kwargs: dict[str, Any] | None = None,
                tools: list[dict] | None = None) -> list[int]:
    # Render to text, then encode without extra specials: the template itself places BOS
    # (or whatever the model wants). `template_kwargs`: the request's chat_template_kwargs,
    # which the template reads as variables (as vLLM passes them). `tools`: as the
    # template's `tools`, which vLLM passes only where a request has some.
    kwargs = dict(add_generation_prompt=True) | (template_kwargs or {}) | dict(tokenize=False)
    if tools:
        kwargs["tools"] = tools
    text = tokenizer.apply_chat_template(messages, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_text(tokenizer: Any, prompt: str) -> list[int]:
    # The tokenizer's own special-token rule adds BOS where the model expects it.
    return list(tokenizer.encode(prompt, add_special_tokens=True))
