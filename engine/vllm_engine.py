"""A narrow adapter over vLLM v1's `AsyncLLM`: token ids in, token-id deltas out.

Ballast deals in token ids, never text, so that an interrupted generation can be
resumed exactly: with greedy decoding, resubmitting `prompt + produced` with
`max_tokens - len(produced)` continues token for token as the uninterrupted run would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from config import CPU_KV_CACHE_GIB
from engine import prompts
from engine.adapters import AdapterMissing, Adapters
from engine.logits import LOGITS_PROCESSORS, resume_params
from engine.model_spec import ModelSpec
from engine.sampling import Sampling
from protocol.logprobs import Alternatives, Decoded, floor
from telemetry import tracing

if TYPE_CHECKING:
    from config import Settings

GiB = 1 << 30
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """What one engine output step gave a request."""

    token_ids: list[int]  # new tokens since the previous Step (a delta)
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    text: str = ""  # the new text, when generate(detokenize=True)
    # Per new token, when sampling.logprobs is set: vLLM's alternatives in vLLM's own order
    # (the sampled token first, then by rank) as [token id, logprob] (protocol/logprobs.py).
    logprobs: list[Alternatives] | None = None
    cached_tokens: int = 0  # prompt tokens vLLM found in its prefix cache
    # With sampling.prompt_logprobs, on the first Step: each prompt token's alternatives as
    # vLLM decoded them (protocol/logprobs.py `Decoded`; the first token's has no logprob).
    prompt_logprobs: list[Decoded] | None = None


@dataclass
class Load:
    """The engine's scheduler as of its last step: what the fleet controller sees."""

    running: int = 0  # sequences in vLLM's running batch
    waiting: int = 0  # requests queued in vLLM, not yet scheduled
    kv_cache_usage: float = 0.0  # share of KV-cache blocks in use, 0..1
    # vLLM's own prefix-cache counters since start, in prompt tokens (new requests; a
    # preempted one's re-prefill is not counted): placement's measure of its affinity.
    prefix_queries: int = 0
    prefix_hits: int = 0
    # Output tokens vLLM generated while running full (every slot Ballast counts busy), all
    # work, and the seconds it stepped so: a slot's rate at full load, which reservations in
    # tokens a second are kept by (policy/reservations.py). Only full steps count: a rate
    # taken at a lighter load would fall as a reservation held slots idle, and raise it.
    full_tokens: int = 0
    full_s: float = 0.0


def vllm_args(
    spec: ModelSpec,
    *,
    kv_cache_gib: float | None = None,
    max_num_seqs: int = 256,
    seed: int = 0,
    max_num_batched_tokens: int | None = None,
    long_prefill_tokens: int = 0,
    lora: bool = False,
    max_loras: int = 4,
    max_lora_rank: int = 8,
    cpu: bool | None = None,
) -> dict[str, Any]:
    """vLLM's engine arguments (`AsyncEngineArgs` keywords, as `vllm serve` names its
    flags) for an engine serving `spec`: what Engine.start hands vLLM (its docstring says
    what each knob does). `cpu` None: whether vLLM's platform here is the CPU."""
    args: dict[str, Any] = dict(
        model=spec.path,
        served_model_name=spec.name,
        max_model_len=spec.max_model_len,
        dtype=_dtype(spec.path),
        seed=seed,
        enable_prefix_caching=True,  # resumed requests re-use their prompt's KV
        scheduling_policy="priority",  # lower value is served (and kept) first
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=long_prefill_tokens,
        disable_log_stats=True,
        enable_log_requests=False,
    )
    if on_cpu() if cpu is None else cpu:
        # No graph capture or compile: it halves start-up and buys nothing on CPU. An
        # explicit KV budget: gpu_memory_utilization would mean a share of all host memory.
        args.update(enforce_eager=True, kv_cache_memory_bytes=int((kv_cache_gib or CPU_KV_CACHE_GIB) * GiB))
    elif kv_cache_gib:
        args["kv_cache_memory_bytes"] = int(kv_cache_gib * GiB)
    if max_num_batched_tokens:
        args["max_num_batched_tokens"] = max_num_batched_tokens
    if spec.embeds:
        # vLLM's pooling runner (its --convert auto turns a generative model into an
        # embedding one): it samples nothing, so it takes no logits processors and no LoRA.
        args["runner"] = "pooling"
        return args
    if lora:
        args.update(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank)
    # What a resumed generation carries of its grammar and penalties (engine/logits.py).
    args["logits_processors"] = list(LOGITS_PROCESSORS)
    return args


def engine_args(spec: ModelSpec, settings: Settings) -> dict[str, Any]:
    """The vLLM engine arguments of an engine worker run with `settings`: one source for the
    product and for every benchmark arm that must compare like with like. The operator's
    own vLLM flags (`vllm_args`) win over Ballast's defaults."""
    return vllm_args(spec, kv_cache_gib=settings.kv_cache_gib, max_num_seqs=settings.max_num_seqs + settings.spare_seqs,
                     max_num_batched_tokens=settings.max_num_batched_tokens,
                     long_prefill_tokens=settings.long_prefill_tokens, lora=settings.serve_fine_tuned,
                     max_loras=settings.max_loras,
                     max_lora_rank=settings.max_lora_rank) | _tracing(settings) | parse_vllm_flags(settings.vllm_args)


def _tracing(settings: Settings) -> dict[str, Any]:
    """vLLM's own tracing, to Ballast's collector: its span of each request (llm_request, the
    engine worker's span's child through `trace_headers`) and those of its engine process."""
    return dict(otlp_traces_endpoint=settings.otlp_endpoint) if settings.otlp_endpoint else {}


# vLLM's arguments that Ballast sets from its own settings, which the API and the control
# plane read too (a request is checked against max_model_len, slots are counted against
# max_num_seqs, a fine-tuning job's lora_rank against max_lora_rank): a value given to vLLM
# alone would disagree with them.
OWNED = dict(
    model="BALLAST_MODEL", served_model_name="BALLAST_SERVED_MODEL_NAME", max_model_len="BALLAST_MAX_MODEL_LEN",
    max_num_seqs="BALLAST_MAX_NUM_SEQS", max_num_batched_tokens="BALLAST_MAX_NUM_BATCHED_TOKENS",
    long_prefill_token_threshold="BALLAST_LONG_PREFILL_TOKENS", kv_cache_memory_bytes="BALLAST_KV_CACHE_GIB",
    enable_lora="BALLAST_SERVE_FINE_TUNED", max_loras="BALLAST_MAX_LORAS", max_lora_rank="BALLAST_MAX_LORA_RANK",
    scheduling_policy="nothing: preemption needs vLLM's priority scheduling",
    runner="BALLAST_MODEL_TASK",
    logits_processors="nothing: resumed generations need Ballast's own (engine/logits.py)",
)


class BadVllmFlags(ValueError):
    pass


def parse_vllm_flags(flags: str) -> dict[str, Any]:
    """The engine arguments named in `flags` (as `vllm serve` takes them), read by vLLM's
    own parser: only those given, so Ballast's defaults stand for the rest."""
    if not flags.strip():
        return {}
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise BadVllmFlags(f"BALLAST_VLLM_ARGS: {message}")

    parser = AsyncEngineArgs.add_cli_args(Parser(prog="BALLAST_VLLM_ARGS", add_help=False))
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # what was not given stays out of the namespace
    given = vars(parser.parse_args(shlex.split(flags)))
    if owned := sorted(set(given) & OWNED.keys()):
        raise BadVllmFlags("BALLAST_VLLM_ARGS: " + "; ".join(
            f"--{k.replace('_', '-')} is Ballast's to set: use {OWNED[k]}" for k in owned))
    return given


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class Engine:
    def __init__(self, spec: ModelSpec, llm: Any, load: Load | None = None, adapters: Adapters | None = None):
        self.spec = spec
        self._llm = llm
        self.adapters = adapters  # fine-tuned models' LoRA adapters; None: the base model only
        self.tokenizer = llm.get_tokenizer()
        # Its prefix cache's unit: placement hashes prompts in blocks of it (policy/prefix.py).
        self.block_size: int = llm.vllm_config.cache_config.block_size
        # The most prompt tokens one request gets prefilled in a step (vLLM's long-prefill
        # cap, else the step's whole budget): a longer shared prefix takes its first request
        # several steps, which others sharing it would spend again (engine/prefix_leaders.py).
        sched = llm.vllm_config.scheduler_config
        self.prefill_step_tokens: int = sched.long_prefill_token_threshold or sched.max_num_batched_tokens
        self.load = load or Load()
        # vLLM's own bound (renderers/base.py): a prompt id past the tokenizer's and the
        # model's vocabulary is refused.
        self.max_token_id = max(self.tokenizer.max_token_id, llm.model_config.get_vocab_size() - 1)
        # The model's tool parser, vLLM's class for it: a name vLLM does not know fails the
        # worker's start, not each request with tools.
        self.tool_parser: type | None = None
        if spec.tool_call_parser:
            from vllm.parser import ParserManager

            try:
                self.tool_parser = ParserManager.get_parser(tool_parser_name=spec.tool_call_parser,
                                                            enable_auto_tools=True, model_name=spec.name)
            except TypeError as err:
                raise ValueError(f"BALLAST_TOOL_CALL_PARSER={spec.tool_call_parser!r} is not one of vLLM's tool "
                                 f"parsers (see vLLM's --tool-call-parser): {err}") from None

    @classmethod
    async def start(
        cls,
        spec: ModelSpec,
        *,
        kv_cache_gib: float = 1.0,
        max_num_seqs: int = 256,
        seed: int = 0,
        nice: int = 0,
        max_num_batched_tokens: int | None = None,
        long_prefill_tokens: int = 0,
        adapters: Adapters | None = None,
        max_loras: int = 4,
        max_lora_rank: int = 8,
    ) -> Engine:
        """Start an engine (async: `await Engine.start(spec)`).

        Construction blocks for ~20 s while vLLM spawns and warms its engine process,
        so it runs in a thread and the caller's event loop (heartbeats, health checks)
        keeps turning. vLLM starts its output loops lazily on the first request, in
        whichever loop makes it, so the engine must be used from one event loop.

        `nice` > 0 lowers the CPU priority of vLLM's engine-core and worker processes.
        They busy-poll each other for a second after every step; where they share cores
        with the request path (this process's streaming endpoint, the API), each hop of
        a request otherwise waits behind them.

        `max_num_batched_tokens` caps the tokens of one engine step (vLLM's default when
        None) and `long_prefill_tokens` (> 0) the prompt tokens one request may put in a
        step while others are running or waiting: a giant prompt is then prefilled in
        chunks across steps instead of making one step, and every request in it, slow.

        `adapters` (with up to `max_loras` at once, of rank up to `max_lora_rank`) serves
        fine-tuned models beside the base: vLLM's LoRA support, on CPU as on GPU.
        """
        args = vllm_args(spec, kv_cache_gib=kv_cache_gib, max_num_seqs=max_num_seqs, seed=seed,
                         max_num_batched_tokens=max_num_batched_tokens, long_prefill_tokens=long_prefill_tokens,
                         lora=adapters is not None, max_loras=max_loras, max_lora_rank=max_lora_rank)
        return await cls.from_args(spec, args, nice=nice, adapters=adapters)

    @classmethod
    async def from_args(cls, spec: ModelSpec, args: dict[str, Any], *, nice: int = 0,
                        adapters: Adapters | None = None, full_at: int = 0) -> Engine:
        """Start an engine on vLLM's own engine arguments (`vllm_args`, `engine_args`), as
        Engine.start does: the one way an engine's vLLM is configured, for the product and
        for a benchmark's raw-vLLM arm alike. The arguments are logged, one JSON line.
        `full_at`: the running sequences at which it counts as full (`Load`; 0: vLLM's
        max_num_seqs)."""
        if adapters is not None and not args.get("enable_lora"):
            raise ValueError("fine-tuned models' adapters need vLLM's LoRA support (enable_lora)")
        log.info("vLLM engine args: %s", json.dumps(args, sort_keys=True))
        before = _vllm_processes() if nice > 0 else set()
        engine = await asyncio.to_thread(cls._start_blocking, spec, args, full_at or args.get("max_num_seqs", 256))
        engine.adapters = adapters
        if nice > 0:
            _lower_priority(_vllm_processes() - before, nice)
        return engine

    @classmethod
    def _start_blocking(cls, spec: ModelSpec, args: dict[str, Any], full_at: int = 256) -> Engine:
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no phoning home
        # engine/logits.py is a processor of vLLM's V1 model runner, which vLLM's GPU default
        # (V2) does not load.
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        if args.get("otlp_traces_endpoint"):
            # vLLM's exporters speak OTLP/gRPC unless told otherwise; Ballast's endpoint is OTLP/HTTP's.
            os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        load = Load()
        return cls(spec, AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[_load_gauge(load, full_at)]),
                   load)

    @property
    def model_config(self) -> Any:
        return self._llm.model_config

    def render_chat(self, messages: list[dict], template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        """`template_kwargs`: a request's chat_template_kwargs, of which the template gets
        those it (or apply_chat_template) takes, as vLLM's OpenAI server passes them; a
        ValueError for the ones vLLM refuses."""
        if template_kwargs:
            from vllm.renderers.hf import resolve_chat_template_kwargs

            template_kwargs = resolve_chat_template_kwargs(self.tokenizer, self.tokenizer.chat_template,
                                                           template_kwargs)
        return prompts.render_chat(self.tokenizer, messages, template_kwargs, tools)

    def render_text(self, prompt: str) -> list[int]:
        return prompts.render_text(self.tokenizer, prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: Sampling,
        *,
        priority: int = 0,
        detokenize: bool = False,
        item: str | None = None,
        resumed_from: int = 0,
        resumed: int = 0,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[Step]:
        """Yield Steps until one has a finish_reason.

        Cancelling the iteration (or closing it) aborts the request in vLLM, as does
        `abort(request_id)`, after which the last Step has finish_reason "abort".

        `resumed`: how many of the prompt's last tokens an earlier request of the same
        generation produced (a resumed batch item's): its grammar and penalties go on from
        them (engine/logits.py).

        `item` and `resumed_from` say whose tokens these are (a batch item's stream) and
        how many that item had before this request; vLLM never sees them. They are for
        wrappers of the engine: the test gate (engine/gate.py) holds items at budgets of
        total tokens.

        `sampling.adapter`: a fine-tuned model's name; its LoRA adapter runs on the base
        model (AdapterMissing where this engine has no adapters or the job trained none).

        `trace_headers`: the W3C headers of the span that vLLM's own span of the request
        continues, where its tracing is on (telemetry/tracing.py); none given, the current
        span's (a batch generation's: its Temporal activity's).
        """
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(**resume_params(dict(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
            ignore_eos=sampling.ignore_eos,
            min_tokens=sampling.min_tokens,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty,
            logit_bias=dict(sampling.logit_bias) or None,
            logprobs=sampling.logprobs,
            prompt_logprobs=sampling.prompt_logprobs,
            skip_special_tokens=sampling.skip_special_tokens,
            spaces_between_special_tokens=sampling.spaces_between_special_tokens,
            output_kind=RequestOutputKind.DELTA,
            # Text is only needed to stream it or to match stop strings.
            detokenize=detokenize or bool(sampling.stop) or sampling.prompt_logprobs is not None,
        ), sampling.grammar, prompt_token_ids[len(prompt_token_ids) - resumed:] if resumed else ()))
        # An already-rendered input: vLLM neither re-tokenizes nor adds specials.
        prompt = tokens_input(list(prompt_token_ids))
        lora = None
        if sampling.adapter is not None:
            if self.adapters is None:
                raise AdapterMissing(f"this engine serves no fine-tuned models ({sampling.adapter})")
            lora = await self.adapters.request(sampling.adapter)
        async for out in self._llm.generate(prompt, params, request_id, priority=priority, lora_request=lora,
                                            trace_headers=trace_headers or tracing.headers() or None):
            c = out.outputs[0]
            reason = str(c.finish_reason) if c.finish_reason is not None else None
            prompt_positions = None
            if out.prompt_logprobs and sampling.prompt_logprobs is not None:  # the first output's alone
                prompt_positions = self._prompt_positions(prompt_token_ids, out.prompt_logprobs)
            yield Step(list(c.token_ids), reason, c.text or "", _alternatives(c.logprobs), out.num_cached_tokens or 0,
                       prompt_positions)

    def _prompt_positions(self, prompt: list[int], positions: Any) -> list[Decoded]:
        """vLLM's prompt logprobs as its completions server reads them: the first token,
        which nothing precedes, decoded alone and without a logprob."""
        out: list[Decoded] = []
        for token, alts in zip(prompt, positions, strict=True):
            if alts is None:
                out.append([[self.tokenizer.decode(token), None]])
            else:
                out.append([[lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode(t),
                             floor(lp.logprob)] for t, lp in alts.items()])
        return out

    async def embed(self, request_id: str, inputs: list[list[int]], *, dimensions: int | None = None,
                    priority: int = 0, trace_headers: Mapping[str, str] | None = None) -> list[list[float]]:
        """One embedding per input (token ids, rendered already), each its own vLLM request
        (`request_id`-i), all at once. Raises ValueError for what vLLM refuses (`dimensions`
        on a model without Matryoshka embeddings)."""
        from vllm import PoolingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs.engine import tokens_input

        params = PoolingParams(task="embed", dimensions=dimensions)
        try:
            params.verify(self._llm.model_config)  # as vLLM's server does: its defaults, its refusals
        except VLLMClientError as err:
            raise ValueError(str(err)) from None
        headers = trace_headers or tracing.headers() or None

        async def one(i: int, ids: list[int]) -> list[float]:
            last = None
            async for out in self._llm.encode(tokens_input(ids), params, f"{request_id}-{i}", priority=priority,
                                              trace_headers=headers):
                last = out  # one output, once finished
            assert last is not None and last.finished, f"{request_id}-{i}: vLLM ended without its embedding"
            return last.outputs.data.tolist()

        tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(inputs)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:  # a cancelled encode aborts its request in vLLM
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def check_health(self) -> None:
        """Raises where vLLM's engine has died (its engine core process gone)."""
        if self._llm is None:
            raise RuntimeError("the engine has shut down")
        await self._llm.check_health()

    async def abort(self, request_id: str) -> None:
        # vLLM maps our (external) id to its internal, randomised one.
        await self._llm.abort(request_id)

    def shutdown(self) -> None:
        # Drop our reference too, so vLLM's __del__ (a second shutdown) runs now rather
        # than during interpreter teardown, where it fails noisily.
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()


def _alternatives(positions: Any) -> list[Alternatives] | None:
    """vLLM's logprob dicts (sampled token first, then by rank), as journaled."""
    if positions is None:
        return None
    return [[[token, floor(lp.logprob)] for token, lp in alts.items()] for alts in positions]


def record_step(load: Load, full_at: int, since: float, now: float, tokens: int) -> None:
    """A step's output (`tokens`, at `now`; the last at `since`) counted toward the rate at
    full load when vLLM ran at least `full_at` sequences through it (as of the last step)."""
    if full_at > 0 and load.running >= full_at:
        load.full_s += now - since
        load.full_tokens += tokens


def _load_gauge(load: Load, full_at: int):
    """A vLLM stat logger that keeps `load` current (vLLM calls it after each step, in the
    output loop; no default loggers run)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadGauge(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.at = time.monotonic()

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            record_step(load, full_at, self.at, now := time.monotonic(),
                        iteration_stats.num_generation_tokens if iteration_stats is not None else 0)
            self.at = now
            if scheduler_stats is not None:
                load.running = scheduler_stats.num_running_reqs
                load.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                load.kv_cache_usage = scheduler_stats.kv_cache_usage
                load.prefix_queries += scheduler_stats.prefix_cache_stats.queries
                load.prefix_hits += scheduler_stats.prefix_cache_stats.hits

        def log_engine_initialized(self):
            pass

    return LoadGauge


def _vllm_processes() -> set[int]:
    """vLLM's processes under this one (they name themselves VLLM::…); Linux only. Only
    our own descendants: another engine's on the same machine is not ours to renice."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # gone already
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            children.setdefault(int(rest[1]), []).append(int(entry.name))
            names[int(entry.name)] = name
    found, todo = set(), list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        if names.get(pid, "").startswith("VLLM::"):
            found.add(pid)
        todo += children.get(pid, [])
    return found


def _lower_priority(pids: set[int], by: int) -> None:
    # Niceness is per thread on Linux: every existing thread, and new threads inherit it.
    for pid in pids:
        try:
            for tid in map(int, os.listdir(f"/proc/{pid}/task")):
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + by)
        except OSError:
            continue


def _dtype(path: str) -> Literal["float32", "auto"]:
    """The checkpoint's own dtype when it is float32 (the tiny model), else "auto".

    vLLM's "auto" would run a float32 checkpoint in half precision; the tiny model's
    greedy outputs are only reproducible in float32.
    """
    config = Path(path) / "config.json"
    if config.is_file():
        c = json.loads(config.read_text())
        if (c.get("dtype") or c.get("torch_dtype")) == "float32":
            return "float32"
    return "auto"
