"""A fine-tuning job on the real stack, through the official OpenAI client: the file
uploaded with purpose fine-tune, the job created, trained in chunks on the engine worker
(a batch slot each), checkpointed and journaled; it ends `succeeded` with OpenAI's
fields filled (fine_tuned_model, trained_tokens, a metrics CSV in result_files), its
events and checkpoints listed. The adapter the engine worker trained is bitwise the one
an uninterrupted run in this test process trains (another process, another thread
count: the determinism that lets a chunk resume on any worker). A bad file fails the job
in validation with its lines named, and nothing trains."""

from __future__ import annotations

import io
import json
import random
import time

import pytest
import torch
from safetensors.torch import load

from engine.training import Hyper, Trainer, encode_chat
from journal import finetunes as fj

pytestmark = pytest.mark.e2e

CHATS = [[dict(role="user", content=f"Colour {i}?"),
          dict(role="assistant", content=random.Random(i).choice(["red", "green", "blue"]))] for i in range(10)]


def wait_final(client, job_id: str, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while (job := client.fine_tuning.jobs.retrieve(job_id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(0.5)
    return job


def test_a_job_trains_on_the_engine_worker_and_ends_as_openai_reports_it(client, stack, tiny_model):
    body = "".join(json.dumps(dict(messages=c)) + "\n" for c in CHATS).encode()
    file_id = client.files.create(file=("train.jsonl", io.BytesIO(body)), purpose="fine-tune").id
    job = client.fine_tuning.jobs.create(model="ballast-tiny", training_file=file_id, suffix="colours", seed=11,
                                         hyperparameters=dict(n_epochs=2, batch_size=4))
    done = wait_final(client, job.id)
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"ft:ballast-tiny:colours:{job.id}" and done.finished_at >= done.created_at
    steps = 2 * 3  # 10 examples in batches of 4, twice
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoints[0].step_number == steps
    events = [e.message for e in client.fine_tuning.jobs.list_events(job.id)]
    assert events[0].startswith(f"Step {steps}/{steps}: training loss=")
    metrics = client.files.content(done.result_files[0]).text.splitlines()
    assert metrics[0] == "step,train_loss" and [r.split(",")[0] for r in metrics[1:]] == [str(s) for s in
                                                                                          range(1, steps + 1)]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model.path)
    examples = [encode_chat(tok, c) for c in CHATS]
    assert done.trained_tokens == 2 * sum(len(e.ids) for e in examples)
    here = Trainer(tiny_model.path, examples, Hyper(n_epochs=2, batch_size=4, learning_rate=1e-3, seed=11),
                   tok.eos_token_id)
    here.run(steps)
    with open(stack.root / "objects" / fj.adapter_prefix(job.id) / "adapter_model.safetensors", "rb") as f:
        served = load(f.read())
    mine = here.weights()
    assert served.keys() == mine.keys() and all(torch.equal(served[k], mine[k]) for k in mine)
    assert [r.split(",")[1] for r in metrics[1:]] == [f"{x:.6f}" for x in here.losses]


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
