"""Tool calls, as vLLM's OpenAI server makes them: its own tool parsers, configured per
model (`tool_call_parser`), read the model's output, whole or as it streams.

What a request with tools asks of the engine, beyond its prompt:
- `required` or a named function: the output is constrained to calls (the JSON schema or
  structural tag vLLM's parser derives from the tools), a grammar like any structured
  output, so a preempted item resumes it where it was (engine/logits.py);
- the parser may ask for special tokens to stay in the text (a model whose tool-call
  markers are special tokens);
- and at the end (or at every delta of a stream) the parser splits the text into content
  and tool calls.

A model with no tool parser serves `tools` only with `tool_choice` "none": anything else
is a 400 naming the setting, as vLLM refuses it without `--tool-call-parser`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from protocol.errors import ProtocolError
from protocol.requests import GenerationRequest


def parsing(req: GenerationRequest) -> bool:
    """Whether the request's output is read for tool calls."""
    return bool(req.tools) and req.tool_choice != "none"


def refusal(engine, req: GenerationRequest) -> ProtocolError | None:
    """Why this engine cannot serve the request's tools, if it cannot."""
    if not parsing(req) or engine.tool_parser is not None:
        return None
    return ProtocolError(400, "unsupported_value", f"The model {engine.spec.name!r} has no tool parser configured, so "
                         f"it serves `tools` only with `tool_choice` \"none\" (an operator sets one: "
                         f"BALLAST_TOOL_CALL_PARSER, vLLM's --tool-call-parser).", "tool_choice")


# StructuredOutputsParams' kinds of constraint: a parser may set any (a JSON schema of the
# calls, or a structural tag that wraps each call in the model's own markers).
CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class Message:
    """A choice's message once parsed, and its finish reason as OpenAI gives it."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str


class Calls:
    """One request's tool-call parsing: vLLM's parser (stateful, so one per request) and
    the vLLM request object its methods read."""

    def __init__(self, engine, req: GenerationRequest):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.named = isinstance(req.tool_choice, dict)
        self.required = req.tool_choice == "required"
        self.request = ChatCompletionRequest.model_validate(dict(
            model=req.model, messages=[_openai(m) for m in req.messages], tools=list(req.tools),
            tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
            **({"structured_outputs": req.grammar} if req.grammar else {})))
        self.parser = engine.tool_parser(engine.tokenizer, self.request.tools, model_config=engine.model_config,
                          chat_template_kwargs=req.chat_template_kwargs or {})
        self.request = self.parser.adjust_request(self.request)
        self.streamed = False  # whether a delta has carried tool calls

    def constrain(self, sampling):
        """The sampling as the parser adjusted the request: the calls' grammar where the
        output must be calls, special tokens kept where the parser reads them."""
        so = self.request.structured_outputs
        grammar = {k: v for k in CONSTRAINTS if (v := getattr(so, k, None)) is not None} or None
        return replace(sampling, grammar=grammar,
                       skip_special_tokens=sampling.skip_special_tokens and self.request.skip_special_tokens)

    def whole(self, text: str, reason: str) -> Message:
        """The finished text as a message (vLLM's chat_completion_full_generator)."""
        from vllm.renderers.chat_utils import make_tool_call_id

        _, content, calls = self.parser.parse(text, self.request, enable_auto_tools=True)
        calls = [dict(id=c.id or make_tool_call_id(), type="function",
                      function=dict(name=c.name, arguments=c.arguments)) for c in calls or []]
        if self.named or self.required:
            content = content or ""
        if self.request.parallel_tool_calls is False:
            calls = calls[:1]
        called = bool(calls) and not self.named
        return Message(content, calls, "tool_calls" if called and reason == "stop" else reason)

    def delta(self, text: str, token_ids: list[int], prompt: list[int], finished: bool) -> dict[str, Any] | None:
        """One streamed delta as the parser sends it: {content?, tool_calls?}, or None
        when it holds the text back (a half-written call)."""
        d = self.parser.parse_delta(delta_text=text, delta_token_ids=token_ids, request=self.request,
                                    prompt_token_ids=prompt, finished=finished)
        if d is None:
            return None
        out = d.model_dump(mode="json", exclude_none=True, include={"content", "tool_calls"})
        if calls := out.get("tool_calls"):
            self.streamed = True
            if self.request.parallel_tool_calls is False:
                out["tool_calls"] = [c for c in calls if c.get("index", 0) == 0]
        return out

    def stream_reason(self, reason: str) -> str:
        """A streamed choice's finish reason (vLLM's: "tool_calls" once it streamed calls
        and stopped, but for a named function)."""
        return "tool_calls" if self.streamed and not self.named and reason == "stop" else reason


def _openai(m) -> dict[str, Any]:
    out: dict[str, Any] = dict(role=m.role, content=m.content)
    if m.tool_calls:
        out["tool_calls"] = list(m.tool_calls)
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out
