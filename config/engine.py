"""An engine worker: the model, vLLM's knobs, its endpoint, how it journals progress."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from config.section import Section

TINY_MODEL_NAME = "ballast-tiny"
CPU_KV_CACHE_GIB = 1.0
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices


class EngineSettings(Section):
    # Model: a local directory (or hub id where the network allows). Unset: the tiny model.
    model: str | None = None
    served_model_name: str | None = None
    max_model_len: int = 2048
    # The vLLM tool parser that reads the model's tool calls (vLLM's --tool-call-parser:
    # hermes, llama3_json, mistral, …; its docs list which fits which model). Unset: the
    # model takes no `tools` but "none" (the tiny model: hermes).
    tool_call_parser: str | None = None
    max_num_seqs: int = 256
    # What the model serves: "generate" (chat and completions) or "embed" (/v1/embeddings,
    # from vLLM's pooling runner: an embedding model, or a generative one turned into one
    # by vLLM's --convert embed, as the tiny model is). Its pool then serves nothing else.
    model_task: Literal["generate", "embed"] = "generate"

    # KV-cache memory. Unset: CPU_KV_CACHE_GIB on CPU, where vLLM's gpu_memory_utilization
    # would mean a share of all host memory; on a GPU, what vLLM sizes from
    # gpu_memory_utilization (set it in vllm_args).
    kv_cache_gib: float | None = Field(None, gt=0)

    # vLLM's own engine flags, as `vllm serve` takes them ("--tensor-parallel-size 2
    # --quantization fp8 --gpu-memory-utilization 0.92", or "--config vllm.yaml" for vLLM's
    # YAML form). vLLM's parser reads them when an engine worker starts, so a bad flag
    # fails there naming itself. The flags Ballast sets from the settings above (which the
    # API and control plane read too) are refused with the setting to use instead.
    vllm_args: str = ""

    # One engine step's token budget (None: vLLM's), and the prompt tokens one request may
    # put in a step beside others (0: no cap): a giant prompt is then prefilled across
    # steps, and a short request that arrives meanwhile finds budget in the next step
    # rather than waiting for the giant's whole prefill. 64 halved another tenant's TTFT
    # beside 2k-token prompts on the CPU engine at no cost to the giants' throughput
    # (bench/RESULTS.md, `ballast bench fairness`); a GPU step takes far more tokens for
    # the same time, so raise it there (a few hundred).
    max_num_batched_tokens: int | None = Field(None, ge=1)
    long_prefill_tokens: int = Field(64, ge=0)

    # vLLM's processes busy-poll; a lower CPU priority keeps the request path (and the
    # control plane) ahead of them where they share cores. 0 disables.
    engine_nice: int = Field(10, ge=0, le=19)

    # An engine worker's streaming endpoint for interactive requests (port 0: any free one),
    # and the URL it announces to the API (default http://<host>:<port>).
    engine_host: str = "127.0.0.1"
    engine_port: int = 0
    engine_url: str | None = None

    # The shared secret the API presents to engine workers' endpoint (Authorization: Bearer);
    # an engine worker refuses to start without it. `ballast up` makes one (data_dir/engine-token).
    engine_token: SecretStr | None = None

    # Engines serve fine-tuned models (vLLM's LoRA support, up to max_loras adapters at
    # once beside the base model). False: the base model only, without LoRA's overhead.
    serve_fine_tuned: bool = True
    max_loras: int = Field(4, ge=1)
    # The largest LoRA rank the engines serve (vLLM's max_lora_rank, one of the values vLLM
    # takes: 1, 8, 16, 32, 64, 128, 256, 320, 512): the API refuses a fine-tuning job whose
    # lora_rank is above it. vLLM sizes its LoRA buffers for it: raise it only as far as jobs need.
    max_lora_rank: int = Field(8, ge=1, le=512)

    @field_validator("max_lora_rank")
    @classmethod
    def _a_rank_vllm_takes(cls, value: int) -> int:
        if value not in VLLM_LORA_RANKS:
            raise ValueError(f"max_lora_rank is one of {', '.join(map(str, VLLM_LORA_RANKS))} (vLLM's choices)")
        return value

    # The most tokens one fine-tuning job's files may hold, encoded: its examples stay in the
    # engine worker's memory (tens of bytes a token) while its chunks train. A job over it
    # fails at once, naming the line where it passed it.
    max_training_tokens: int = Field(10_000_000, ge=1)

    # An engine worker journals its generations' new tokens in one append every
    # checkpoint_interval_s, and at once when one has checkpoint_tokens unsaved (and always
    # before an item yields). A crash costs an item at most what it generated since the last
    # commit: one interval and one commit, and at most checkpoint_tokens plus one commit.
    checkpoint_interval_s: float = Field(1.0, gt=0)
    checkpoint_tokens: int = Field(256, ge=1)

    # A failpoint for tests and drills, off when unset: the path of a JSON control file
    # whose token budgets hold this engine's batch generations (engine/gate.py).
    engine_gate: Path | None = None

    # Off when unset: a file the engine worker appends its timeline to (engine/trace.py),
    # for `ballast bench batch`'s picture of where the time goes.
    engine_trace: Path | None = None

    @cached_property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return self.model.rstrip("/").split("/")[-1]
        return TINY_MODEL_NAME
