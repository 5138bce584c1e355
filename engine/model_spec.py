"""Which model an engine serves: the configured one, or the locally built tiny one."""

from __future__ import annotations

from dataclasses import dataclass

from config import Settings


@dataclass(frozen=True)
class ModelSpec:
    path: str  # local directory (or hub id where the network allows)
    name: str  # the name clients ask for
    max_model_len: int
    tool_call_parser: str | None = None  # vLLM's name for the parser of its tool calls
    task: str = "generate"  # "embed": vLLM's pooling runner, embeddings only

    @property
    def embeds(self) -> bool:
        return self.task == "embed"


def resolve_model(settings: Settings) -> ModelSpec:
    if settings.model:
        return ModelSpec(settings.model, settings.model_name, settings.max_model_len,
                         settings.tool_call_parser or None, settings.model_task)
    from engine.tiny import TOOL_CALL_PARSER, build_tiny_model  # imports torch; only needed here

    path = build_tiny_model(settings.models_dir, settings.max_model_len)
    embeds = settings.model_task == "embed"
    return ModelSpec(str(path), settings.model_name, settings.max_model_len,
                     None if embeds else settings.tool_call_parser or TOOL_CALL_PARSER, settings.model_task)


def tokenizer_path(settings: Settings) -> str | None:
    """Where the served model's tokenizer is, building nothing: the configured model, or
    the tiny model once an engine worker has built it (None until then)."""
    if settings.model:
        return settings.model
    from engine.tiny import tiny_model_dir

    built = tiny_model_dir(settings.models_dir, settings.max_model_len)
    return str(built) if built.is_dir() else None
