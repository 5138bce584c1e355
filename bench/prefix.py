"""`ballast bench prefix`: a prefix-heavy batch larger than the engine's KV cache, through
vLLM's own batch runner and through Ballast, on the same file and engine arguments.

The file is what real batch jobs look like: a few long shared prefixes (system prompts,
few-shot examples), each line one of them (drawn at random, so lines sharing a prefix are
scattered through the file) and a short question of its own. The engine's KV cache holds
only a fraction of the distinct prefixes at once (`--cache-share`), sized from the model's
config. vLLM schedules a batch in arrival order: lines of many prefixes run side by side,
each prefix's blocks are evicted before its next line comes, and most lines prefill their
prefix again. Ballast pages a batch's pending items sorted by their prompts' text
(journal/batch_store.py), so lines sharing a prefix reach vLLM together.

Arms, each round (their order alternating):
- run-batch: `python -m vllm.entrypoints.openai.run_batch` on the file as it is (what a
  vLLM user runs instead), timed from its engine being up to its output written;
- Ballast: the file through `ballast up` end to end (REST → batch workflow → engine
  worker → journal → output file), until the journal records the batch completed;
- Ballast, items not waiting on a leader's prefill (BALLAST_BATCH_PREFIX_WAIT_S=0): what
  engine/prefix_leaders.py buys beyond sorted pages;
- run-batch sorted (reference): the same lines sorted by prompt text, for what ordering
  alone buys: a user who knew to sort their file would get this much from vLLM.

The engines run without Ballast's cap on a request's prompt tokens per step
(`--long-prefill-tokens`, default 0 here, vLLM's own default): it is there for chat's
TTFT beside giant prompts, and on an engine whose KV cache holds few prompts at once it
caps a step at that many tokens per running request, so prefill, not the cache, bounds
every arm alike. Every arm gets the same value.

Every line's output is compared with run-batch's (greedy: the same engine must say the
same). Ratios are run-batch's seconds over Ballast's, medians over rounds with a bootstrap
interval. One JSON line last.
"""

from __future__ import annotations

import json
import random
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench.batch import (
    URL,
    args_differ,
    logged_args,
    median_ratio,
    parsed_args,
    run_batch_argv,
    run_batch_file,
    submit,
)
from bench.placement import kv_bytes_per_token
from bench.stack import ballast_up
from bench.stats import p50
from config import Settings

SEED = 11
LETTERS = "abcdefghijklmnopqrstuvwxyz      ,.ABCDEFGHIJ0123456789"
ARMS = ("run_batch", "ballast", "ballast_no_wait", "run_batch_sorted")
TARGET = 1.2


def workload(items: int, prefixes: int, prefix_chars: int, seed: int = SEED) -> list[dict]:
    """`items` chats: a system prompt, one of `prefixes` of `prefix_chars` characters each
    (byte tokenizer: a token each), drawn at random per line, and a user question of 40
    characters of its own; 8 output tokens, greedy, run to max_tokens."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(rng.choice(LETTERS) for _ in range(n))

    shared = [f"Prefix {k}. " + text(prefix_chars) for k in range(prefixes)]
    return [dict(messages=[dict(role="system", content=rng.choice(shared)), dict(role="user", content=text(40))],
                 max_tokens=8, temperature=0, ignore_eos=True) for _ in range(items)]


def batch_lines(reqs: list[dict], model: str, order: list[int] | None = None) -> bytes:
    order = list(range(len(reqs))) if order is None else order
    return "".join(json.dumps(dict(custom_id=f"r{i}", method="POST", url=URL, body=dict(reqs[i], model=model))) + "\n"
                   for i in order).encode()


def sorted_order(reqs: list[dict]) -> list[int]:
    """Lines by their prompts' text, then by line: what Ballast's pages do (bytewise)."""
    def key(i: int) -> tuple[bytes, int]:
        return "".join(m["content"] for m in reqs[i]["messages"]).encode(), i
    return sorted(range(len(reqs)), key=key)


def contents(lines: list[dict]) -> dict[str, str]:
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in lines}


def kv_cache_gib(model_path: str, tokens: int) -> float:
    return tokens * kv_bytes_per_token(model_path) / 2**30


def run_batch_arm(settings: Settings, reqs: list[dict], model: str, order: list[int] | None) -> dict:
    from engine.model_spec import resolve_model
    from engine.vllm_engine import engine_args

    args = engine_args(resolve_model(settings), settings)
    argv = run_batch_argv(args)
    with tempfile.TemporaryDirectory(prefix="ballast-bench-prefix-") as d:
        got = run_batch_file(Path(d) / "file", batch_lines(reqs, model, order), len(reqs), argv, settings.engine_nice,
                         keep_output=True)
    return dict(seconds=got["seconds"], start_s=got["start_s"], outputs=contents(got.pop("lines")),
                args=parsed_args(argv, list(args)))


def ballast_arm(settings: Settings, reqs: list[dict], model: str, wait: bool = True) -> dict:
    with tempfile.TemporaryDirectory(prefix="ballast-bench-prefix-") as d, \
            ballast_up(settings, Path(d), BALLAST_KV_CACHE_GIB=repr(settings.kv_cache_gib),
                       BALLAST_LONG_PREFILL_TOKENS=str(settings.long_prefill_tokens),
                       BALLAST_BATCH_PREFIX_WAIT_S=repr(settings.batch_prefix_wait_s if wait else 0.0)) as stack:
        warm = [dict(reqs[0], messages=[dict(role="user", content="warm up")])]
        submit(stack, batch_lines(warm, model))
        seconds, out = submit(stack, batch_lines(reqs, model))
        return dict(seconds=seconds, outputs=contents([json.loads(ln) for ln in out]),
                    args=logged_args(Path(d) / "logs" / "engine.log"))


def main(settings: Settings, items: int = 768, prefixes: int = 24, prefix_chars: int = 1200,
         cache_share: float = 0.25, rounds: int = 2, long_prefill_tokens: int = 0) -> int:
    from engine.model_spec import resolve_model

    spec = resolve_model(settings)
    reqs = workload(items, prefixes, prefix_chars)
    # The cache holds `cache_share` of the distinct prefixes' tokens (the chat template's
    # few tokens aside), and never less than one prompt at the model's length.
    cache_tokens = max(int(cache_share * prefixes * prefix_chars), spec.max_model_len)
    own = settings.model_copy(update=dict(kv_cache_gib=round(kv_cache_gib(spec.path, cache_tokens), 9),
                                          long_prefill_tokens=long_prefill_tokens))
    order = sorted_order(reqs)
    print(f"bench prefix: {items} chats over {prefixes} shared prefixes of {prefix_chars} characters, drawn at random "
          f"per line, 8 output tokens each; a KV cache of {cache_tokens} tokens ({cache_share:.0%} of the prefixes'); "
          f"long_prefill_tokens {long_prefill_tokens} in every arm; {rounds} rounds of {', '.join(ARMS)}; "
          f"model {spec.name}", flush=True)
    got: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for n in range(1, rounds + 1):
        arms = ARMS if n % 2 else tuple(reversed(ARMS))
        for arm in arms:
            print(f"round {n}/{rounds}, {arm} …", flush=True)
            if arm.startswith("ballast"):
                r = ballast_arm(own, reqs, spec.name, wait=arm == "ballast")
            else:
                r = run_batch_arm(own, reqs, spec.name, order if arm == "run_batch_sorted" else None)
            print(f"  {items} lines in {r['seconds']:.2f} s ({items / r['seconds']:.1f} lines/s)", flush=True)
            got[arm].append(r)

    oracle = got["run_batch"][-1]["outputs"]
    seconds = {arm: [r["seconds"] for r in rs] for arm, rs in got.items()}
    unequal = {arm: args_differ(got["run_batch"][-1]["args"], got[arm][-1]["args"]) for arm in ARMS[1:]}
    out: dict[str, Any] = dict(
        bench="prefix", run=uuid.uuid4().hex[:8], items=items, prefixes=prefixes, prefix_chars=prefix_chars,
        cache_tokens=cache_tokens, cache_share=cache_share, rounds=rounds, long_prefill_tokens=long_prefill_tokens,
        seconds={arm: [round(s, 2) for s in xs] for arm, xs in seconds.items()},
        lines_per_s={arm: round(items / p50(xs), 1) for arm, xs in seconds.items()},
        # run-batch's time over each arm's: above 1, the arm finished sooner.
        speedup=median_ratio(seconds["run_batch"], seconds["ballast"]),
        sorted_speedup=median_ratio(seconds["run_batch"], seconds["run_batch_sorted"]),
        ballast_over_sorted=median_ratio(seconds["run_batch_sorted"], seconds["ballast"]),
        waiting_over_not=median_ratio(seconds["ballast_no_wait"], seconds["ballast"]),
        outputs_equal_to_run_batch={arm: sum(r["outputs"].get(k) == v for k, v in oracle.items())
                                    for arm, rs in got.items() for r in rs[-1:]},
        engine_args_differ=unequal, target=TARGET)
    out["met"] = out["speedup"]["ratio"] >= TARGET
    print(f"\nlines/s: {out['lines_per_s']}")
    print(f"Ballast ÷ run-batch (speed) {out['speedup']['ratio']:.3f} {out['speedup']['ci95']} (target ≥ {TARGET}); "
          f"sorted run-batch ÷ run-batch {out['sorted_speedup']['ratio']:.3f}; Ballast ÷ sorted run-batch "
          f"{out['ballast_over_sorted']['ratio']:.3f}; waiting on leaders ÷ not {out['waiting_over_not']['ratio']:.3f}")
    print(f"outputs equal to run-batch's, of {items}: {out['outputs_equal_to_run_batch']}; engine args differing: "
          f"{unequal}")
    print(json.dumps(out))
    return 0 if not any(unequal.values()) else 1  # a ratio is only meaningful on equal engines
