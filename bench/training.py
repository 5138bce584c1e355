"""`ballast bench training`: what checkpointing costs a fine-tuning job, what resuming
from a checkpoint costs, and how long interactive work waits for training to yield.

Every arm is a fresh `ballast up` and every job goes the product's whole path: the file
uploaded and the job created through the API, the FineTune workflow, chunks on the
engine worker, checkpoints in the object store and the journal. The arms run the same
jobs and differ only in how often a chunk checkpoints:

  default      as shipped: chunks of at least BALLAST_FINE_TUNE_CHUNK_STEPS (10) steps,
               longer while what a chunk costs beyond its steps is over
               BALLAST_FINE_TUNE_CHECKPOINT_OVERHEAD (3 %) of their time;
  every-10     exactly 10 steps a chunk (the overhead rule off): what a fixed K costs
               on this model's millisecond steps;
  uncheckpointed  one chunk for the whole job: its only checkpoint is the last.

Time per step is a job's wall time from its `running` status to its last checkpoint,
both as the journal committed them, over its steps. The checkpoint overhead is the
default arm's time per step over the uncheckpointed arm's (medians of `jobs` jobs each,
after one warm-up job that loads the base model into the engine worker). Arms run one
after another, and this machine's step time drifts by more than the overhead between
them, so each job's wall time over its steps' own time (the chunks' `train_s`) is given
too: the overhead within one run.

Then, in the default arm, a job trains while streamed chats arrive one by one, 2.5-4.5 s
apart (`chats` of them, each after training is back from the previous one's cool-down):
each chat preempts the chunk, which stops after its step, checkpoints
and gives the engine back; the next chunk resumes from that checkpoint once the chat is
done. Reported: how long each chat waited for training to yield (the engine worker's
own figure, decision to slot free: /stats `yields`), chat TTFT against the same chats on
the idle stack before, and resume time (a chunk's start to its first step: the lease,
the file, the trainer on the cached base, the checkpoint read and verified) as a ratio to
a step and to a chunk that starts the job. One JSON line last.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

from bench.fairness import token_event
from bench.pictures import draw_training
from bench.stack import Stack, ballast_up
from bench.stats import p50
from bench.stats import pct as _pct
from config import Settings

SEED = 29
PICTURE = Path(__file__).with_name("training.png")
EXAMPLES = 200
BATCH_SIZE = 4
EPOCHS = 8  # 400 steps a job
WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbour", "indigo", "juniper", "kelp",
         "lagoon", "meadow", "nectar", "obsidian", "prairie", "quartz", "river", "saffron", "tundra")
ARMS = {
    "default": {},
    "every-10": {"BALLAST_FINE_TUNE_CHECKPOINT_OVERHEAD": "0"},
    "uncheckpointed": {"BALLAST_FINE_TUNE_CHUNK_STEPS": "1000000", "BALLAST_FINE_TUNE_CHECKPOINT_OVERHEAD": "0"},
}


PHASES = ("between_s", "resume_s", "wait_s", "train_s", "checkpoint_s")  # a checkpoint's `timing`


def training_file(seed: int = SEED, examples: int = EXAMPLES) -> bytes:
    rng = random.Random(f"{seed}:training")
    lines = []
    for i in range(examples):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(6, 14)))
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 8)))
        lines.append(json.dumps(dict(messages=[dict(role="user", content=f"{i}: {q}?"),
                                               dict(role="assistant", content=a)])))
    return ("\n".join(lines) + "\n").encode()


def create_job(stack: Stack, file_id: str, model: str, epochs: int, seed: int) -> str:
    return stack.api.post("/v1/fine_tuning/jobs", json=dict(
        model=model, training_file=file_id, seed=seed, suffix="bench",
        hyperparameters=dict(n_epochs=epochs, batch_size=BATCH_SIZE))).raise_for_status().json()["id"]


def wait_done(stack: Stack, job_id: str, timeout: float = 900) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (job := stack.api.get(f"/v1/fine_tuning/jobs/{job_id}").json())["status"] not in (
            "succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    assert job["status"] == "succeeded", job
    return job


def journal(stack: Stack, job_id: str) -> dict[str, Any]:
    """From the job's stream: its training wall time (running → last checkpoint) and its
    checkpoints' payloads, in order."""
    with psycopg.connect(stack.db_url) as conn:
        rows = conn.execute("SELECT type, payload, committed_at FROM events WHERE stream = %s ORDER BY version",
                            (f"ftjob:{job_id}",)).fetchall()
    running = min(at for t, p, at in rows if t == "ft_status" and p["status"] == "running")
    ckpts = [(p, at) for t, p, at in rows if t == "ft_checkpoint"]
    return dict(seconds=(ckpts[-1][1] - running).total_seconds(), steps=ckpts[-1][0]["step"],
                checkpoints=[p for p, _ in ckpts])


def chat(api: httpx.Client, model: str, i: int) -> float:
    """A streamed chat's TTFT (seconds to its first token, not to the opening chunk)."""
    t0 = time.perf_counter()
    with api.stream("POST", "/v1/chat/completions", json=dict(
            model=model, stream=True, max_tokens=16, temperature=0,
            messages=[dict(role="user", content=f"chat {i}: tell me about {WORDS[i % len(WORDS)]}")])) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and token_event(json.loads(line[6:])):
                return time.perf_counter() - t0
    raise AssertionError(f"chat {i} streamed no content")


def chats(stack: Stack, model: str, n: int, gap_s: tuple[float, float], seed: int) -> list[float]:
    """n chats, one at a time, `gap_s` (uniform) apart: their TTFTs."""
    rng = random.Random(seed)
    ttfts = []
    for i in range(n):
        time.sleep(rng.uniform(*gap_s))
        ttfts.append(chat(stack.api, model, i))
    return ttfts


def yields(stack: Stack, engine_url: str) -> list[tuple[str, float]]:
    stats = httpx.get(engine_url + "/stats", headers=stack.engine_headers, timeout=10).json()
    return [(id, s) for id, s in stats["yields"]]


def engine_url(stack: Stack) -> str:
    with psycopg.connect(stack.db_url) as conn:
        row = conn.execute("SELECT url FROM engines ORDER BY seen_at DESC LIMIT 1").fetchone()
    assert row is not None, "no engine worker announced itself"
    return str(row[0])


def run_arm(settings: Settings, arm: str, env: dict[str, str], jobs: int, n_chats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ballast-bench-training-") as d, \
            ballast_up(settings, Path(d), **env) as stack:
        model = stack.api.get("/v1/models").json()["data"][0]["id"]
        file_id = stack.api.post("/v1/files", files={"file": ("train.jsonl", training_file())},
                                 data={"purpose": "fine-tune"}).raise_for_status().json()["id"]
        wait_done(stack, create_job(stack, file_id, model, 1, SEED))  # warm-up: the worker loads its base model
        out: dict[str, Any] = dict(jobs=[])
        for j in range(jobs):
            job_id = create_job(stack, file_id, model, EPOCHS, SEED + j)
            wait_done(stack, job_id)
            got = journal(stack, job_id)
            phases = {k: round(sum(c["timing"][k] for c in got["checkpoints"]), 3) for k in PHASES}
            out["jobs"].append(dict(seconds=round(got["seconds"], 3), steps=got["steps"],
                                    checkpoints=len(got["checkpoints"]), phases=phases,
                                    between_chunks=round(got["seconds"] - sum(phases.values()), 3)))
            print(f"  {arm} job {j + 1}/{jobs}: {got['steps']} steps in {got['seconds']:.2f} s, "
                  f"{len(got['checkpoints'])} checkpoints; {out['jobs'][-1]}", flush=True)
            out.setdefault("checkpoint_payloads", []).extend(got["checkpoints"])
        per_step = [j["seconds"] / j["steps"] for j in out["jobs"]]
        out["ms_per_step"] = round(1000 * p50(per_step), 3)
        # The same jobs' wall time over their steps' own time: the overhead within one run.
        out["wall_over_steps"] = round(p50(j["seconds"] / j["phases"]["train_s"] for j in out["jobs"]), 4)
        if n_chats:
            out["surge"] = surge(stack, model, file_id, n_chats)
        ckpts = out.pop("checkpoint_payloads")
        out["picture"] = picture(got["checkpoints"])  # its last job's
        out["checkpoint_bytes"] = ckpts[-1]["bytes"]
        out["checkpoint_s_p50"] = round(p50(c["timing"]["checkpoint_s"] for c in ckpts), 4)
        return out


def surge(stack: Stack, model: str, file_id: str, n: int) -> dict[str, Any]:
    url = engine_url(stack)
    idle = chats(stack, model, n, (0.2, 0.4), SEED)  # the same chats on the idle stack: the reference
    before = len(yields(stack, url))
    job_id = create_job(stack, file_id, model, 50, SEED + 100)  # the most epochs; cancelled after the chats
    while stack.api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] != "running":
        time.sleep(0.1)
    time.sleep(1.0)  # training under way
    # Apart by more than batch's cool-down (BALLAST_BATCH_COOL_DOWN_S, 2 s): training is
    # back on the engine when each arrives, so each chat meets it and waits for it to yield.
    busy = chats(stack, model, n, (2.5, 4.5), SEED)
    waited = [s for id, s in yields(stack, url)[before:] if id == f"ft:{job_id}"]
    stack.api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").raise_for_status()
    while stack.api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] != "cancelled":
        time.sleep(0.2)
    ckpts = journal(stack, job_id)["checkpoints"]
    first, resumed = ckpts[0]["timing"], [c["timing"] for c in ckpts[1:]]
    step_s = p50(c["timing"]["train_s"] / max(1, len(c["losses"])) for c in ckpts if c["losses"])
    resume = sorted(t["resume_s"] for t in resumed)
    return dict(picture=picture(ckpts), chats=n, preemptions=len(waited), yield_ms_p50=_ms(_pct(waited, 50)),
                yield_ms_p99=_ms(_pct(waited, 99)), yield_ms_max=_ms(max(waited, default=0)),
                ttft_ms_idle_p50=_ms(_pct(idle, 50)), ttft_ms_busy_p50=_ms(_pct(busy, 50)),
                ttft_ms_idle_p99=_ms(_pct(idle, 99)), ttft_ms_busy_p99=_ms(_pct(busy, 99)),
                resumes=len(resume), resume_ms_p50=_ms(_pct(resume, 50)), resume_ms_p99=_ms(_pct(resume, 99)),
                first_chunk_start_ms=_ms(first["resume_s"]), step_ms=_ms(step_s),
                resume_in_steps=round(_pct(resume, 50) / step_s, 2) if resume else None)


def picture(ckpts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A job's checkpoints as bench/pictures.py draws them."""
    return [dict(step=c["step"], losses=c["losses"], ended_by=c.get("ended_by")) for c in ckpts]


def _ms(s: float) -> float:
    return round(1000 * s, 2)


def main(settings: Settings, jobs: int = 3, n_chats: int = 20) -> int:
    print(f"bench training: {EXAMPLES} chat examples, batches of {BATCH_SIZE}, {EPOCHS} epochs "
          f"({EXAMPLES // BATCH_SIZE * EPOCHS} steps) a job, {jobs} jobs per arm after a warm-up; arms "
          f"{', '.join(ARMS)}, each a fresh `ballast up`; then {n_chats} chats over a training job", flush=True)
    out: dict[str, Any] = dict(bench="training", jobs=jobs)
    for arm, env in ARMS.items():
        print(f"arm {arm} …", flush=True)
        out[arm] = run_arm(settings, arm, env, jobs, n_chats if arm == "default" else 0)
    pictures = {f"{arm}: a job alone" if arm != "uncheckpointed" else "uncheckpointed: one chunk":
                out[arm].pop("picture") for arm in ARMS}
    surge = out["default"]["surge"]
    pictures["default: chats arriving 2.5-4.5 s apart (cancelled after them)"] = surge.pop("picture")
    draw_training(PICTURE, pictures, f"bench training: {EXAMPLES // BATCH_SIZE * EPOCHS} steps a job, checkpoints "
                                     f"as each arm takes them; {surge['chats']} chats preempting the last job")
    base = out["uncheckpointed"]["ms_per_step"]
    out["overhead"] = {arm: round(out[arm]["ms_per_step"] / base, 3) for arm in ("default", "every-10")}
    print(f"\n{'arm':15} {'ms/step':>8} {'× uncheckpointed':>17} {'wall ÷ steps':>13} {'checkpoints/job':>16}")
    for arm in ARMS:
        a = out[arm]
        print(f"{arm:15} {a['ms_per_step']:8.3f} {a['ms_per_step'] / base:17.3f} {a['wall_over_steps']:13.4f} "
              f"{p50(j['checkpoints'] for j in a['jobs']):16}")
    s = out["default"]["surge"]
    print(f"checkpoint: {out['default']['checkpoint_bytes']} bytes, written in {out['default']['checkpoint_s_p50']} s "
          f"(p50)")
    print(f"surge: {s['chats']} chats, {s['preemptions']} preemptions; training yielded in p50 {s['yield_ms_p50']} ms, "
          f"p99 {s['yield_ms_p99']} ms; chat TTFT p50 {s['ttft_ms_busy_p50']} ms (idle {s['ttft_ms_idle_p50']} ms)")
    print(f"resume: p50 {s['resume_ms_p50']} ms, p99 {s['resume_ms_p99']} ms ({s['resume_in_steps']} steps; "
          f"a job's first chunk starts in {s['first_chunk_start_ms']} ms)")
    print(f"picture: {PICTURE}")
    print(json.dumps(out))
    return 0
