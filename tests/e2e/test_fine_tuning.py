"""A fine-tuning job on the real stack, through the official OpenAI client: the file
uploaded with purpose fine-tune, the job created, trained in chunks on the engine worker
(a batch slot each), checkpointed and journaled; it ends `succeeded` with OpenAI's
fields filled (fine_tuned_model, trained_tokens, a metrics CSV in result_files), its
events and checkpoints listed. The adapter the engine worker trained is bitwise the one
an uninterrupted run in this test process trains (another process, another thread
count: the determinism that lets a chunk resume on any worker).

Then the result serves: the model is in the tenant's /v1/models (no one else's); a chat
and a batch item naming it run on vLLM with the adapter and answer what transformers
answers with the adapter merged into the base weights (W + alpha/r · B·A), which is not
what the base model answers, and what vLLM answers with the adapter loaded directly. A bad
file fails the job in validation with its lines named, and nothing trains."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psycopg
import pytest
import torch
from safetensors.torch import load

from config.database import libpq_url
from protocol import keys
from training.trainer import Hyper, Trainer, encode_chat

pytestmark = pytest.mark.e2e

CHATS = [[dict(role="user", content=f"Colour {i}?"),
          dict(role="assistant", content=random.Random(i).choice(["red", "green", "blue"]))] for i in range(10)]


def wait_final(client, job_id: str, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while (job := client.fine_tuning.jobs.retrieve(job_id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.5)
    return job


@pytest.fixture(scope="module")
def tuned(stack, tiny_model):
    """A job trained on the stack: (its job object, the adapter it wrote, its metrics rows)."""
    client = stack.openai()
    body = "".join(json.dumps(dict(messages=c)) + "\n" for c in CHATS).encode()
    file_id = client.files.create(file=("train.jsonl", io.BytesIO(body)), purpose="fine-tune").id
    job = client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id, suffix="colours", seed=11,
                                         hyperparameters=dict(n_epochs=2, batch_size=4, learning_rate_multiplier=10))
    done = wait_final(client, job.id)
    assert done.status == "succeeded", done.error
    with open(stack.root / "objects" / keys.adapter(job.id) / "adapter_model.safetensors", "rb") as f:
        return done, load(f.read())


def merged(tiny_model, adapter: dict[str, torch.Tensor] | None):
    """The base model in transformers, the adapter merged into its weights by hand (W + alpha/r · B·A)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32)
    if adapter is not None:
        weights = model.state_dict()
        for key, a in adapter.items():
            if key.endswith("lora_A.weight"):
                layer = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                weights[f"{layer}.weight"] += (16 / 8) * adapter[key.replace("lora_A", "lora_B")] @ a
        model.load_state_dict(weights)
    return model


def merged_greedy(tiny_model, adapter: dict[str, torch.Tensor] | None, messages: list[dict], n: int) -> str:
    """transformers' greedy answer, the adapter merged into the base weights."""
    from transformers import AutoTokenizer

    from engine.prompts import render_chat

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    model = merged(tiny_model, adapter)
    ids = render_chat(tok, messages)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    # The byte-level model may end on part of a character: the API holds such a tail back
    # (engine/text.py), transformers shows it as U+FFFD.
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True).removesuffix("\ufffd")


def vllm_with_adapter(tiny_model, adapter_dir: Path, messages: list[dict], n: int, tmp_path: Path) -> str:
    """vLLM's own greedy answer with the adapter loaded directly (`LLM.chat` with a
    LoRARequest on the adapter's directory), in a process of its own."""
    out = tmp_path / "vllm-answer.json"
    script = textwrap.dedent(f"""
        import json, os
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        llm = LLM(model={tiny_model.path!r}, enforce_eager=True, kv_cache_memory_bytes=256 << 20, max_model_len=1024,
                  dtype="float32", seed=0, enable_lora=True, max_lora_rank=8, max_loras=1)
        got = llm.chat({messages!r}, SamplingParams(max_tokens={n}, temperature=0),
                       lora_request=LoRARequest("direct", 1, {str(adapter_dir)!r}), use_tqdm=False)
        open({str(out)!r}, "w").write(json.dumps(got[0].outputs[0].text))
        os._exit(0)  # vLLM's engine process would hold the exit
    """)
    with open(tmp_path / "vllm.log", "w") as log:  # a file, not a pipe: vLLM's engine process outlives it
        child = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            assert child.wait(300) == 0, (tmp_path / "vllm.log").read_text()[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # its engine process too
    return json.loads(out.read_text()).removesuffix("\ufffd")


def test_the_fine_tuned_model_serves_chats_and_batches_with_its_adapter(client, stack, tiny_model, tuned, db_url,
                                                                          tmp_path):
    from tests.e2e.test_admission import tenant_client
    from tests.e2e.test_batch import submit, wait_for

    done, adapter = tuned
    assert done.fine_tuned_model in [m.id for m in client.models.list()]
    _, _, other = tenant_client(stack, db_url, "not-the-owner")
    assert done.fine_tuned_model not in [m.id for m in other.models.list()]
    with pytest.raises(Exception) as caught:  # another tenant's fine-tune does not exist for it
        other.chat.completions.create(model=done.fine_tuned_model, messages=[dict(role="user", content="hi")])
    assert getattr(caught.value, "status_code", None) == 404

    messages = [dict(role="user", content="Colour 3?")]
    tuned_answer = client.chat.completions.create(model=done.fine_tuned_model, messages=messages, max_tokens=8,
                                                  temperature=0)
    base_answer = client.chat.completions.create(model="ballast-tiny", messages=messages, max_tokens=8,
                                                 temperature=0)
    assert tuned_answer.model == done.fine_tuned_model
    expected = merged_greedy(tiny_model, adapter, messages, 8)
    assert tuned_answer.choices[0].message.content == expected
    # … and what vLLM answers with the adapter the job wrote loaded directly.
    adapter_dir = stack.root / "objects" / keys.adapter(done.id)
    assert vllm_with_adapter(tiny_model, adapter_dir, messages, 8, tmp_path) == expected
    assert base_answer.choices[0].message.content == merged_greedy(tiny_model, None, messages, 8) != expected

    line = dict(custom_id="ft-0", method="POST", url="/v1/chat/completions",
                body=dict(model=done.fine_tuned_model, messages=messages, max_tokens=8, temperature=0))
    batch = wait_for(client, submit(client, [line]).id)
    assert batch.status == "completed" and batch.request_counts.completed == 1, batch
    [out] = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert out["response"]["body"]["choices"][0]["message"]["content"] == expected


def test_vllm_keeps_a_fine_tuned_models_prefix_cache_apart_as_placement_predicts(client, stack, tuned, db_url):
    """Placement seeds a fine-tuned model's blocks with its own root (policy/prefix.py)
    because vLLM does not share cached blocks between an adapter and the base model: the
    premise, checked on vLLM's own prefix-cache counters. A prompt the base model has just
    run hits nothing for the adapter; run again with the adapter, it hits."""
    done, _ = tuned
    prompt = [dict(role="system", content=" ".join(f"rule {i}: answer in colours." for i in range(30))),
              dict(role="user", content=f"Colour {time.time_ns()}?")]

    def counters() -> tuple[int, int]:
        time.sleep(2.5)  # the engine worker reports its counters every second
        with psycopg.connect(libpq_url(db_url)) as conn:
            stats = [s for (s,) in conn.execute("SELECT stats FROM engines")]
        return sum(s.get("prefix_queries", 0) for s in stats), sum(s.get("prefix_hits", 0) for s in stats)

    def run(model: str) -> tuple[int, int]:
        q0, h0 = counters()
        client.chat.completions.create(model=model, messages=prompt, max_tokens=1, temperature=0)
        q1, h1 = counters()
        return q1 - q0, h1 - h0

    run("ballast-tiny")
    queried, hit = run(done.fine_tuned_model)
    assert queried > 256 and hit == 0  # the base model's blocks are no hit for the adapter
    queried, hit = run(done.fine_tuned_model)
    assert hit >= 256  # its own are


def test_a_job_trains_on_the_engine_worker_and_ends_as_openai_reports_it(client, stack, tiny_model, db_url):
    body = "".join(json.dumps(dict(messages=c)) + "\n" for c in CHATS).encode()
    file_id = client.files.create(file=("train.jsonl", io.BytesIO(body)), purpose="fine-tune").id
    held_out = [[dict(role="user", content=f"Shade {i}?"), dict(role="assistant", content=["teal", "navy"][i % 2])]
                for i in range(3)]
    valid_id = client.files.create(file=("valid.jsonl", io.BytesIO("".join(
        json.dumps(dict(messages=c)) + "\n" for c in held_out).encode())), purpose="fine-tune").id
    job = client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id, suffix="colours", seed=11,
                                         validation_file=valid_id, hyperparameters=dict(n_epochs=2, batch_size=4))
    done = wait_final(client, job.id)
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"ft:ballast-tiny:colours:{job.id}" and done.finished_at >= done.created_at
    steps = 2 * 3  # 10 examples in batches of 4, twice
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoints[0].step_number == steps
    events = [e.message for e in client.fine_tuning.jobs.list_events(job.id)]
    assert events[0].startswith(f"Step {steps}/{steps}: training loss=") and ", validation loss=" in events[0]
    metrics = [r.split(",") for r in client.files.content(done.result_files[0]).text.splitlines()]
    assert metrics[0] == ["step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy"]
    assert [r[0] for r in metrics[1:]] == [str(s) for s in range(1, steps + 1)]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    examples = [encode_chat(tok, c) for c in CHATS]
    assert done.trained_tokens == 2 * sum(len(e.ids) for e in examples)
    # Settled in the quota ledger, checkpoint by checkpoint: SQL audits training as inference.
    with psycopg.connect(libpq_url(db_url)) as conn:
        settled = conn.execute("SELECT sum(input_tokens), count(*) FROM ledger WHERE kind = 'settle' "
                               "AND tier = 'training' AND subject LIKE %s", (f"ftjob:{job.id}:%",)).fetchone()
    assert settled == (done.trained_tokens, len(checkpoints))
    here = Trainer(tiny_model.path, examples, Hyper(n_epochs=2, batch_size=4, learning_rate=1e-3, seed=11),
                   tok.eos_token_id)
    here.run(steps)
    with open(stack.root / "objects" / keys.adapter(job.id) / "adapter_model.safetensors", "rb") as f:
        served = load(f.read())
    mine = here.weights()
    assert served.keys() == mine.keys() and all(torch.equal(served[k], mine[k]) for k in mine)
    assert [r[1] for r in metrics[1:]] == [f"{x:.6f}" for x in here.losses]
    assert [r[2] for r in metrics[1:]] == [f"{x:.6f}" for x in here.accuracies]

    # The validation loss at the last step: the held-out chats' trained tokens, scored by
    # transformers with the served adapter merged in.
    model, total, count = merged(tiny_model, served), 0.0, 0
    with torch.no_grad():
        for chat in held_out:
            e = encode_chat(tok, chat)
            labels = torch.tensor([[t if trained else -100 for t, trained in zip(e.ids, e.trained, strict=True)]])
            n = int((labels[0, 1:] != -100).sum())
            total += n * float(model(input_ids=torch.tensor([list(e.ids)]), labels=labels).loss)
            count += n
    assert float(metrics[-1][3]) == pytest.approx(total / count, rel=1e-4)
    assert 0 <= float(metrics[-1][4]) <= 1 and metrics[1][3] == ""  # scored at checkpoints only


def test_pause_resume_and_cancel_through_the_api(client, stack, tiny_model, db_url):
    """Paused, the job trains no step (its checkpoints stand still). Its newest checkpoint
    is then corrupted on disk; resumed, it finds that by the checksum, says so in its
    events, goes on from the one before (or the start), and ends bitwise equal to one
    uninterrupted run. Cancelled, a job ends `cancelled` with its checkpoints listed."""
    chats = CHATS * 3  # 30 examples, 50 epochs: 1,500 steps a job
    body = "".join(json.dumps(dict(messages=c)) + "\n" for c in chats).encode()
    file_id = client.files.create(file=("train.jsonl", io.BytesIO(body)), purpose="fine-tune").id
    steps = "SELECT coalesce(max((payload->>'step')::int), 0) FROM events WHERE stream = %s AND type = 'ft_checkpoint'"

    def saved(job_id: str) -> int:
        with psycopg.connect(libpq_url(db_url)) as conn:
            (step,) = conn.execute(steps, (keys.ftjob(job_id),)).fetchall()[0]
        return step

    def until(job_id: str, status: str) -> None:
        deadline = time.monotonic() + 60
        while (now := client.fine_tuning.jobs.retrieve(job_id).status) != status:
            assert time.monotonic() < deadline, f"{job_id} never {status} (it is {now})"
            time.sleep(0.1)

    # Seconds of training each, so the pause, which reaches the chunk at its next heartbeat
    # (0.8 of the heartbeat timeout at most), finds it mid-run even on a loaded machine.
    jobs = []
    for seed in (1, 2):
        jobs.append(job := client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id, seed=seed,
                                                          hyperparameters=dict(n_epochs=50, batch_size=1)))
        stack.wait_stats(lambda st: f"ft:{job.id}" in st["holds"], "the job training on the engine worker")
        time.sleep(0.2)
        client.fine_tuning.jobs.pause(job.id)
        until(job.id, "paused")
    held = saved(jobs[0].id)
    assert 0 < held < 1500  # it checkpointed when paused, mid-run
    time.sleep(2)
    assert saved(jobs[0].id) == held  # nothing trains while paused
    newest = stack.root / "objects" / keys.checkpoint(jobs[0].id, held)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    client.fine_tuning.jobs.resume(jobs[0].id)
    done = wait_final(client, jobs[0].id)
    assert done.status == "succeeded" and saved(jobs[0].id) == 1500
    warned = [e.message for e in client.fine_tuning.jobs.list_events(jobs[0].id, limit=100) if e.level == "warn"]
    assert warned == [f"The checkpoint at step {held} fails its checksum; resuming from an earlier one."]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    whole = Trainer(tiny_model.path, [encode_chat(tok, c) for c in chats],
                    Hyper(n_epochs=50, batch_size=1, learning_rate=1e-3, seed=1), tok.eos_token_id)
    whole.run(1500)
    with open(stack.root / "objects" / keys.adapter(jobs[0].id) / "adapter_model.safetensors", "rb") as f:
        served = load(f.read())
    assert all(torch.equal(served[k], v) for k, v in whole.weights().items())

    kept = saved(jobs[1].id)
    assert client.fine_tuning.jobs.cancel(jobs[1].id).id == jobs[1].id
    cancelled = wait_final(client, jobs[1].id)
    assert cancelled.status == "cancelled" and cancelled.fine_tuned_model is None
    listed = [c.step_number for c in client.fine_tuning.jobs.checkpoints.list(jobs[1].id)]
    assert listed and listed[0] == kept


def test_a_bad_training_file_fails_the_job_naming_its_lines(client):
    lines = [dict(messages=c) for c in CHATS] + [dict(messages=[dict(role="user", content="no answer")])]
    body = "".join(json.dumps(x) + "\n" for x in lines).encode() + b"{oops\n"
    file_id = client.files.create(file=("bad.jsonl", io.BytesIO(body)), purpose="fine-tune").id
    job = client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id)
    done = wait_final(client, job.id)
    assert done.status == "failed" and done.trained_tokens is None and done.fine_tuned_model is None
    assert "Line 11: Each example must contain at least one assistant message." in done.error.message
    assert "Line 12: This line is not parseable as valid JSON" in done.error.message
    assert list(client.fine_tuning.jobs.checkpoints.list(job.id)) == []
