"""What a resumed generation would lose of vLLM's per-request state, carried across the resume.

Ballast resumes a preempted batch item by submitting `prompt + produced` as a new request
with the remaining max_tokens (engine/vllm_engine.py). Greedy decoding then continues
token for token, except where vLLM keeps state about a request's *output*, which the new
request starts without:

- Structured outputs. vLLM's grammar starts at the first output token
  (vllm/v1/structured_output/), so the continuation would be constrained as if the JSON
  began after the produced tokens. Here the grammar is compiled by vLLM's own
  `XgrammarBackend` (the engine's structured-outputs config, the request's stop tokens),
  advanced over the produced tokens when the request joins the batch, and then, as
  `StructuredOutputManager` does, each step masks the logits with the matcher's bitmask
  and accepts each new token. Termination is the matcher's, as in vLLM: once the grammar
  is complete only stop tokens are allowed, and once one is accepted nothing is masked.
- Penalties. presence_penalty and frequency_penalty count output tokens only
  (vllm/model_executor/layers/utils.py::apply_penalties); on the resumed request the
  produced tokens are prompt. Here vLLM's own `apply_penalties` runs with the original
  prompt as prompt and produced + new tokens as output, while the request's native
  penalties are neutral. repetition_penalty acts on prompt | output, which a resume does
  not change, but apply_penalties applies it before the other two, so it moves with them.

Where this runs (vllm/v1/sample/sampler.py, logits_processor/__init__.py): vLLM masks a
grammar's logits before sampling (the model runner), then applies allowed_token_ids, bad
words, its non-argmax-invariant logits processors (min_tokens, logit_bias, then custom
ones such as this), then penalties. The mask here comes after logit_bias instead of before
it; setting a logit to -inf commutes with adding a finite bias and with every penalty
(-inf stays -inf), so the same logits reach argmax. The penalties here follow logit_bias,
as vLLM's do, and vLLM's penalty step after this one is an identity for these rows.

A fresh request needs none of this: `resume_params` gives it vLLM's own structured
outputs and penalties, and a resumed one this processor (`LOGITS_PROCESSORS`).

Limits: vLLM takes custom logits processors only without speculative decoding, and this
one is for its V1 model runner (on GPUs vLLM defaults to the V2 runner, whose processors
have another interface: set VLLM_USE_V2_MODEL_RUNNER=0). Grammars are xgrammar's: a spec
that vLLM would hand to another backend is refused, as is a grammar with min_tokens (the
minimum would count from the resume) or with a reasoning parser. A grammar is compiled in
the step its request joins the batch, holding that step up (xgrammar caches compiled
grammars, so only a new one costs).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger(__name__)

# The engine's `logits_processors` argument (vLLM's FQCN form, module:class).
LOGITS_PROCESSORS = ["engine.logits:Resumable"]
KEY = "ballast"  # of SamplingParams.extra_args
NEUTRAL = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)


def resume_params(base: Mapping[str, Any], grammar: Mapping[str, Any] | None = None,
                  resumed: Sequence[int] = ()) -> dict[str, Any]:
    """`SamplingParams` keywords for a request whose `base` keywords are its own (max_tokens
    already less what was produced) and whose prompt ends with the `resumed` tokens that
    earlier requests of the same generation produced.

    `grammar`: `StructuredOutputsParams` keywords (json, json_object, regex, choice,
    grammar). Fresh, the request gets vLLM's own structured outputs and penalties; resumed,
    this module's processor carries both (in extra_args[KEY]: the grammar, the penalties
    and how many tokens were resumed), and vLLM's own penalties are neutral.
    """
    params = dict(base)
    if not resumed:
        if grammar:
            from vllm.sampling_params import StructuredOutputsParams

            params["structured_outputs"] = StructuredOutputsParams(**grammar)
        return params
    ours: dict[str, Any] = {}
    if grammar:
        ours["grammar"] = dict(grammar)
    if params.get("presence_penalty") or params.get("frequency_penalty"):
        ours["penalties"] = {k: params.get(k, v) for k, v in NEUTRAL.items()}
        params.update(NEUTRAL)
    if ours:
        # A count, not the tokens: they are the prompt's last ones.
        params["extra_args"] = {**(params.get("extra_args") or {}), KEY: {**ours, "resumed": len(resumed)}}
    return params


def structured_outputs(grammar: Mapping[str, Any]) -> StructuredOutputsParams:
    """`grammar` as vLLM's xgrammar backend takes it: checked as vLLM checks it (raising
    where vLLM would refuse the request), a choice rewritten as the grammar vLLM compiles
    for it."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(**grammar))
    except TypeError as e:
        raise ValueError(f"extra_args[{KEY!r}].grammar: {e}") from None
    validate_xgrammar_grammar(params)
    assert params.structured_outputs is not None
    return params.structured_outputs


def check_params(params: SamplingParams) -> None:
    """Raise for a request whose extra_args[KEY] the processor cannot honour (its
    `validate_params`: vLLM refuses the request, a 400 at its API)."""
    ours = (params.extra_args or {}).get(KEY)
    if ours is None:
        return
    if not isinstance(ours, dict) or not set(ours) <= {"grammar", "penalties", "resumed"}:
        raise ValueError(f"extra_args[{KEY!r}] takes grammar, penalties and resumed")
    resumed = ours.get("resumed", 0)
    if not isinstance(resumed, int) or resumed < 0:
        raise ValueError(f"extra_args[{KEY!r}].resumed is a count of tokens")
    if grammar := ours.get("grammar"):
        if not isinstance(grammar, dict):
            raise ValueError(f"extra_args[{KEY!r}].grammar takes StructuredOutputsParams' keywords")
        if params.structured_outputs is not None:
            raise ValueError("a request has vLLM's structured outputs or Ballast's grammar, not both")
        if params.min_tokens:
            raise ValueError("min_tokens with a resumed grammar is not supported")
        structured_outputs(grammar)
    if penalties := ours.get("penalties"):
        from vllm.sampling_params import SamplingParams

        if any(getattr(params, k) != v for k, v in NEUTRAL.items()):
            raise ValueError("a request's penalties are vLLM's or Ballast's, not both")
        if not isinstance(penalties, dict) or set(penalties) - NEUTRAL.keys():
            raise ValueError(f"extra_args[{KEY!r}].penalties takes {', '.join(NEUTRAL)}")
        SamplingParams(**penalties)  # vLLM's own bounds


@dataclass
class _State:
    """What the processor keeps of one request in the batch."""

    output: list[int]  # vLLM's running list of the request's output tokens
    prompt: list[int]  # the prompt before the resumed tokens
    resumed: list[int]
    grammar: Any = None  # vLLM's XgrammarGrammar, advanced over resumed + output[:seen]
    seen: int = 0
    penalties: tuple[float, float, float] | None = None  # presence, frequency, repetition

    def advance(self) -> None:
        new = self.output[self.seen:]
        if -1 in new:  # async scheduling's placeholders, filled in before sampling
            new = new[:new.index(-1)]
        if new and not self.grammar.accept_tokens(KEY, new):
            log.error("the grammar rejected generated tokens %s; the rest of the request is unconstrained", new)
            self.grammar = None
        self.seen += len(new)


@functools.cache
def _processor() -> type:
    """The processor class, made on first use: subclassing vLLM's base class imports
    vLLM and torch, which `import engine.logits` should not."""
    import torch
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.tokenizers import cached_tokenizer_from_config
    from vllm.utils.torch_utils import make_tensor_with_pad
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend
    from vllm.v1.structured_output.request import get_structured_output_key

    class Resumable(LogitsProcessor):
        """Masks a resumed request's logits with its grammar's state and applies its
        penalties as its uninterrupted run would have had them (this module's docstring)."""

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            so = vllm_config.structured_outputs_config
            if so.backend not in ("auto", "xgrammar") or so.reasoning_parser:
                raise ValueError(f"{LOGITS_PROCESSORS[0]} needs vLLM's xgrammar backend without a reasoning parser")
            self.config = vllm_config
            self.requests: dict[int, _State] = {}  # by batch index
            self.backend: XgrammarBackend | None = None
            self.bitmask: torch.Tensor | None = None

        @classmethod
        def validate_params(cls, sampling_params: SamplingParams) -> None:
            check_params(sampling_params)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            process_dict_updates(self.requests, batch_update, self._add)

        def _add(self, params: SamplingParams, prompt: list[int] | None, output: list[int]) -> _State | None:
            ours = (params.extra_args or {}).get(KEY)
            if not ours:
                return None
            prompt = prompt or []
            split = len(prompt) - ours.get("resumed", 0)
            if split < 0:
                log.error("a request resumes %d tokens but has %d", ours["resumed"], len(prompt))
                return None
            state = _State(output, prompt[:split], prompt[split:])
            if spec := ours.get("grammar"):
                try:  # never raise here: it would take the engine down, not fail the request
                    state.grammar = self._compile(spec, params)
                except Exception:
                    log.exception("a request's grammar did not compile; it is unconstrained")
                if state.grammar is not None and not state.grammar.accept_tokens(KEY, state.resumed):
                    log.error("a request's resumed tokens do not match its grammar; it is unconstrained")
                    state.grammar = None
            if p := ours.get("penalties"):
                state.penalties = tuple(p.get(k, v) for k, v in NEUTRAL.items())
            return state

        def _compile(self, spec: Mapping[str, Any], params: SamplingParams):
            if self.backend is None:
                # As StructuredOutputManager makes it (vllm/v1/structured_output/__init__.py).
                model = self.config.model_config
                self.backend = XgrammarBackend(self.config, tokenizer=cached_tokenizer_from_config(model_config=model),
                                               vocab_size=model.get_vocab_size())
                self.bitmask = self.backend.allocate_token_bitmask(self.config.scheduler_config.max_num_seqs)
            kind, text = get_structured_output_key(structured_outputs(spec))
            return self.backend.compile_grammar(kind, text, stop_token_ids=params.all_stop_token_ids)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.requests:
                return logits
            if masked := [i for i, s in self.requests.items() if s.grammar is not None]:
                self._mask(logits, masked)
            if penalised := [i for i, s in self.requests.items() if s.penalties]:
                self._penalise(logits, penalised)
            return logits

        def _mask(self, logits: torch.Tensor, rows: list[int]) -> None:
            import xgrammar as xgr

            assert self.bitmask is not None
            for i in rows:
                state = self.requests[i]
                state.advance()
                if state.grammar is None or state.grammar.is_terminated():
                    self.bitmask[i].fill_(-1)  # vLLM's full mask for a terminated grammar
                else:
                    state.grammar.fill_bitmask(self.bitmask, i)
            bitmask = self.bitmask[:logits.shape[0]].to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)

        def _penalise(self, logits: torch.Tensor, rows: list[int]) -> None:
            states = [self.requests[i] for i in rows]
            vocab_size, device = logits.shape[1], logits.device
            # Padded with vocab_size, as vLLM pads them (its penalty ops ignore that id).
            prompts = make_tensor_with_pad([s.prompt for s in states], pad=vocab_size, dtype=torch.int64,
                                           device=device)
            outputs = make_tensor_with_pad([s.resumed + s.output for s in states], pad=vocab_size,
                                           dtype=torch.int64, device=device)
            outputs.masked_fill_(outputs == -1, vocab_size)
            presence, frequency, repetition = torch.tensor([s.penalties for s in states], dtype=torch.float32,
                                                           device=device).T.contiguous()
            index = torch.tensor(rows, device=device)
            logits[index] = apply_penalties(logits[index], prompts, outputs, presence, frequency, repetition)

    Resumable.__qualname__ = "Resumable"
    return Resumable


def __getattr__(name: str) -> Any:
    if name == "Resumable":
        return _processor()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
