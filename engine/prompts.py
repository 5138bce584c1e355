"""A request's prompt as token ids, as the engine feeds vLLM: the engine worker renders
with these, and the API (to hash the prompt's leading blocks for placement) with the same
tokenizer files, so both get the same ids. Imports nothing heavy."""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict]) -> list[int]:
    # Render to text, then encode without extra specials: the template itself places BOS
    # (or whatever the model wants).
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_text(tokenizer: Any, prompt: str) -> list[int]:
    # The tokenizer's own special-token rule adds BOS where the model expects it.
    return list(tokenizer.encode(prompt, add_special_tokens=True))
