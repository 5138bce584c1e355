"""Fine-tuning activities: check the training file (control worker), train a chunk
(engine worker), move the job's status and write its results (control worker).

A chunk is fenced like a batch generation: it takes the job stream's lease first, so an
attempt whose heartbeat was lost (still running somewhere) cannot journal a checkpoint
once its retry has begun. It resumes from the newest checkpoint whose bytes match the
SHA-256 the journal recorded, falling back to older ones (and saying so in the job's
events) when the newest is missing or corrupt. Steps run one at a time in a thread; the
activity heartbeats after each, and stops after the step in progress, with a checkpoint,
when the workflow cancels it (pause, cancel) or the engine preempts it for interactive
work (it holds a batch slot, as a generation does).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.heartbeat import beating
from journal import batch_store, finetune_store, ledger
from journal.events import append
from journal.leases import acquire
from policy.admission import DAY_S, day_spent
from policy.preemption import floor_pause
from protocol import keys
from protocol.finetune import LORA_ALPHA, LORA_RANK, LORA_TARGETS, MIN_EXAMPLES, Row, problems, rows
from protocol.limits import ANY_MODEL
from protocol.temporal import (
    FineTuneRef,
    FineTuneStatusInput,
    TrainChunkInput,
    TrainChunkResult,
    ValidateTrainingResult,
)
from protocol.tiers import RANK, Tier
from storage.objects import ObjectStore
from telemetry import families

if TYPE_CHECKING:  # torch only where training runs: the control worker never imports it
    from torch.nn import Module

    from training.trainer import Example, Trainer


class FineTuneActivities:
    def __init__(self, db: AsyncEngine, store: ObjectStore, model_path: str | None = None, max_model_len: int = 0,
                 slots: Any = None, max_tokens: int | None = None):
        """`max_tokens`: the most tokens one job's files may hold, encoded (None: no cap): the
        examples live in the engine worker's memory while its chunks train."""
        self.db, self.store = db, store
        self.model_path, self.max_model_len, self.slots = model_path, max_model_len, slots
        self.max_tokens = max_tokens
        self._tokenizer: Any = None
        # Base models loaded and idle: each chunk takes one (or loads one) and gives it back,
        # so a worker loads its base weights once per chunk it runs at a time, not per chunk.
        self._bases: list[Module] = []
        self._encoded: dict[str, list[Example]] = {}

    # -- control worker --------------------------------------------------------------------

    @activity.defn
    async def validate_training_file(self, ref: FineTuneRef) -> ValidateTrainingResult:
        async with self.db.connect() as conn:
            job = await finetune_store.get_job(conn, ref.job_id)
            assert job is not None, f"fine-tuning job {ref.job_id} vanished"
            if job["status"] != "validating_files":  # a retry after we decided
                return ValidateTrainingResult(0, job["status"] == "failed")
            files = {param: await batch_store.get_file(conn, job[param], job["tenant"])
                     for param in ("training_file", "validation_file") if job[param]}
        for param, file in files.items():
            if file is None:
                raise ApplicationError(f"The {param.replace('_', ' ')} {job[param]} is missing.", non_retryable=True)
            with self.store.open(file["object_key"]) as f:
                found = problems(f, min_examples=MIN_EXAMPLES if param == "training_file" else 1)
            if found:
                what = "" if param == "training_file" else "Validation file: "
                error = dict(code=found[0].code, param=param, message=what + "; ".join(
                    f"Line {e.line}: {e.message}" if e.line else e.message for e in found[:10]))
                async with self.db.begin() as conn:
                    await finetune_store.move_status(conn, job, "failed", error=error, finished_at=int(time.time()))
                return ValidateTrainingResult(0, True)
        training = files["training_file"]
        assert training is not None
        with self.store.open(training["object_key"]) as f:
            n = sum(1 for r in rows(f) if isinstance(r, Row))
        return ValidateTrainingResult(n, False)

    @activity.defn
    async def fine_tune_status(self, inp: FineTuneStatusInput) -> str:
        """Journal the job's status; at `succeeded`, its results first. Returns the status
        the job has (a job already ended keeps its end)."""
        async with self.db.connect() as conn:
            job = await finetune_store.get_job(conn, inp.job_id)
            assert job is not None, f"fine-tuning job {inp.job_id} vanished"
            ckpts = await finetune_store.checkpoints(conn, inp.job_id)
        fields: dict[str, Any] = {}
        if inp.status in finetune_store.FINAL:
            fields["finished_at"] = int(time.time())
        if inp.status == "failed":
            fields["error"] = dict(code="training_failed", message=inp.message[:1000], param=None)
        if inp.status == "succeeded":
            fields.update(await self._results(job, ckpts))
        async with self.db.begin() as conn:
            await finetune_store.move_status(conn, job, inp.status, **fields)
            return (await finetune_store.get_job(conn, inp.job_id) or {}).get("status", inp.status)

    async def _results(self, job: dict[str, Any], ckpts: list[dict[str, Any]]) -> dict[str, Any]:
        """The metrics CSV (a file of purpose fine-tune-results), the model's name, the tokens trained."""
        file_id = batch_store.stable_id("file-", job["id"], "metrics")
        key = keys.file(file_id)
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy"])
        for c in ckpts:  # each checkpoint's steps; the validation figures at its own step
            first = c["step"] - len(c["losses"]) + 1
            accuracies = c.get("accuracies") or [None] * len(c["losses"])
            for step, (loss, accuracy) in enumerate(zip(c["losses"], accuracies, strict=True), start=first):
                last = step == c["step"]
                w.writerow([step, _f(loss), _f(accuracy), _f(c.get("valid_loss") if last else None),
                            _f(c.get("valid_mean_token_accuracy") if last else None)])
        with self.store.writer(key) as f:
            f.write(buf.getvalue().encode())
        async with self.db.begin() as conn:
            if await batch_store.get_file(conn, file_id, job["tenant"]) is None:
                await batch_store.create_file(conn, dict(id=file_id, tenant=job["tenant"], purpose="fine-tune-results",
                                                         filename="step_metrics.csv", bytes=self.store.size(key),
                                                         object_key=key, created_at=int(time.time())))
        per_epoch = ckpts[-1].get("tokens_per_epoch", 0) if ckpts else 0
        return dict(result_files=[file_id], fine_tuned_model=finetune_store.fine_tuned_name(job),
                    trained_tokens=per_epoch * int(job["hyperparameters"]["n_epochs"]))

    # -- engine worker ---------------------------------------------------------------------

    @activity.defn
    async def train_chunk(self, inp: TrainChunkInput) -> TrainChunkResult:
        from training.trainer import BadTargets, Hyper, Trainer, load_base

        began = time.perf_counter()
        info = activity.info()
        runner = f"{(info.workflow_run_id or '')[-8:]}:{info.activity_id}:{info.attempt}"
        async with self.db.begin() as conn:
            fence = await acquire(conn, keys.ftjob(inp.job_id), runner)
            now = (await conn.execute(select(func.now()))).scalar_one().timestamp()  # the journal's clock
        async with self.db.connect() as conn:
            job = await finetune_store.get_job(conn, inp.job_id)
            assert job is not None, f"fine-tuning job {inp.job_id} vanished"
            files = {param: await batch_store.get_file(conn, job[param], job["tenant"])
                     for param in ("training_file", "validation_file") if job[param]}
            ckpts = await finetune_store.checkpoints(conn, inp.job_id)
            spent = await self._day_spent(conn, job, now)
        if spent is not None:  # nothing trains today: the workflow waits for the next UTC day
            until = now - now % DAY_S + DAY_S
            async with self.db.begin() as conn:
                await append(conn, [finetune_store.job_event(
                    job["id"], job["tenant"], f"day-spent:{int(until)}",
                    f"Waiting for the next UTC day: the tenant's tokens_per_day ({spent.tokens_per_day} for "
                    f"{'every model' if spent.model == ANY_MODEL else spent.model}) is spent.", "warn")])
            return TrainChunkResult(ckpts[-1]["step"] if ckpts else 0, 0, False, wait_until=until)
        for param, file in files.items():
            if file is None:
                raise ApplicationError(f"The {param.replace('_', ' ')} {job[param]} is missing.", non_retryable=True)
        encoded = {param: await self._encode(f["object_key"]) for param, f in files.items() if f is not None}
        # The job's next chunk here skips the tokenizer.
        self._encoded = {f["object_key"]: encoded[param] for param, f in files.items() if f is not None}
        examples, valid = encoded["training_file"], encoded.get("validation_file")
        hp = job["hyperparameters"]
        # The job's LoRA adapter (a job created before these were chosen trains the defaults).
        hyper = Hyper(n_epochs=int(hp["n_epochs"]), batch_size=int(hp["batch_size"]),
                      learning_rate=float(hp["learning_rate"]), seed=int(job["seed"]),
                      rank=int(hp.get("lora_rank", LORA_RANK)), alpha=float(hp.get("lora_alpha", LORA_ALPHA)),
                      targets=tuple(hp.get("lora_target_modules", LORA_TARGETS)))
        base = self._bases.pop() if self._bases else await asyncio.to_thread(load_base, self._model())
        try:
            trainer = await asyncio.to_thread(Trainer, self._model(), examples, hyper, self._pad_id(), base)
        except BadTargets as err:  # found before the base was touched: it serves the next job
            self._bases.append(base)
            raise ApplicationError(f"lora_target_modules: {err}", non_retryable=True) from err
        try:
            clock = ChunkClock(began, _dispatch_s(info), ckpts[-1] if ckpts else None, now)
            return await self._run(inp, trainer, job, ckpts, fence, examples, valid, clock)
        finally:
            self._bases.append(trainer.release())

    @staticmethod
    async def _day_spent(conn, job: dict[str, Any], now: float):
        """The tokens_per_day limit of the job's tenant (for all its models, or the job's) that
        its tokens of the UTC day have reached, training's included; None: there is room."""
        tenant, model = job["tenant"], job["model"]
        sets = [s for s in (await ledger.load_limits(conn, tenant)).get(tenant, ())
                if s.model in (ANY_MODEL, model) and s.tokens_per_day is not None]
        if not sets:
            return None
        day = now - now % DAY_S
        used = {m: c.day_tokens for m, c in (await ledger.usage(conn, tenant, now, day, now, in_flight=False)).items()}
        for m, n in (await ledger.trained_tokens(conn, tenant, day)).items():
            used[m] = used.get(m, 0) + n
        return day_spent([(s, sum(used.values()) if s.model == ANY_MODEL else used.get(model, 0)) for s in sets])

    async def _run(self, inp: TrainChunkInput, trainer: Trainer, job: dict[str, Any], ckpts: list[dict[str, Any]],
                   fence: int, examples: list[Example], valid: list[Example] | None,
                   clock: ChunkClock) -> TrainChunkResult:
        unusable = await self._resume(trainer, job, ckpts)
        stopped = asyncio.Event()
        clock.mark_ready()

        async def abort() -> None:  # the engine preempts the chunk: stop after this step
            stopped.set()

        hold = (self.slots.batch(f"ft:{inp.job_id}", RANK[Tier.BATCH], abort, owner=job["tenant"]) if self.slots
                else _no_slot())
        # The wait for a slot, behind chat and batch, can outlast the heartbeat timeout.
        waiting = asyncio.create_task(beating(lambda: trainer.step))
        try:
            async with hold:
                waiting.cancel()
                clock.start()
                trained = families.TRAINING_STEPS.labels(families.tenant(job["tenant"]), job["model"])
                cancelled = await self._steps(trainer, inp, clock, stopped, trained)
                clock.trained("done" if trainer.done else "cancelled" if cancelled else
                              "preempted" if stopped.is_set() else "steps")
                await self._checkpoint(trainer, job, ckpts, unusable, fence, sum(len(e.ids) for e in examples),
                                       valid, clock)
                if trainer.done:
                    await asyncio.to_thread(self._save_adapter, trainer, job["id"])
        finally:
            waiting.cancel()
        if cancelled:
            raise asyncio.CancelledError
        return TrainChunkResult(trainer.step, trainer.total_steps, trainer.done, preempted=stopped.is_set())

    async def _steps(self, trainer: Trainer, inp: TrainChunkInput, clock: ChunkClock, stopped: asyncio.Event,
                     trained: Any) -> bool:
        """Train this chunk's steps, one at a time; True if the workflow cancelled us (the
        step in progress is finished first: the trainer is never left half-stepped). A
        chunk is at least `inp.steps` steps, and longer while what it costs beyond its
        steps (dispatch, resume, checkpoint) would be more than `inp.max_overhead` of its
        training time, up to `inp.max_chunk_s` (what a crash can lose): CheckFreq's rule."""
        first = trainer.step
        while not trainer.done and not stopped.is_set():
            if trainer.step - first >= inp.steps and not self._longer(inp, clock):
                break
            started = time.perf_counter()
            step = asyncio.ensure_future(asyncio.to_thread(trainer.run, 1))
            try:
                await asyncio.shield(step)
            except asyncio.CancelledError:
                await step
                return True
            self.stepped(trainer)
            trained.inc()
            activity.heartbeat(trainer.step)
            if self.slots is not None and self.slots.by_floor:
                try:
                    await self._pause(floor_pause(time.perf_counter() - started, self.slots.min_share), stopped,
                                      trainer.step)
                except asyncio.CancelledError:
                    return True
        return False

    @staticmethod
    async def _pause(seconds: float, stopped: asyncio.Event, step: int) -> None:
        """Wait `seconds`, or until preempted, beating meanwhile."""
        end = time.perf_counter() + seconds
        while (left := end - time.perf_counter()) > 0 and not stopped.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 1.0)):
                    await stopped.wait()
            activity.heartbeat(step)

    @staticmethod
    def _longer(inp: TrainChunkInput, clock: ChunkClock) -> bool:
        """Whether a chunk past its minimum steps trains on: while its overhead is above
        its share, and it has time left."""
        return (inp.max_overhead > 0 and clock.overhead_s() > inp.max_overhead * clock.train_s()
                and clock.elapsed_s() < inp.max_chunk_s)

    def stepped(self, trainer: Trainer) -> None:
        """After each step (a seam for tests that kill a chunk mid-way)."""

    async def _resume(self, trainer: Trainer, job: dict[str, Any], ckpts: list[dict[str, Any]]) -> set[int]:
        """From the newest checkpoint that reads back intact; older ones where it does not.
        Returns the steps of those that did not (a chunk that reaches one rewrites it)."""
        from training.trainer import CorruptCheckpoint

        unusable: set[int] = set()
        for ck in reversed(ckpts):
            try:
                data = await asyncio.to_thread(self._read, ck["object_key"])
                trainer.restore(data, ck["sha256"])
                return unusable
            except (CorruptCheckpoint, OSError) as err:
                why = "fails its checksum" if isinstance(err, CorruptCheckpoint) else "cannot be read"
                unusable.add(ck["step"])
                async with self.db.begin() as conn:
                    await append(conn, [finetune_store.job_event(
                        job["id"], job["tenant"], f"unusable:{ck['step']}:{why}",
                        f"The checkpoint at step {ck['step']} {why}; resuming from an earlier one.",
                        level="warn", step=ck["step"])])
        return unusable

    async def _checkpoint(self, trainer: Trainer, job: dict[str, Any], ckpts: list[dict[str, Any]],
                          unusable: set[int], fence: int, tokens_per_epoch: int, valid: list[Example] | None,
                          clock: ChunkClock) -> None:
        """Write and journal a checkpoint of where the trainer is. One journaled already at
        this step (an earlier attempt's) is kept, or rewritten where it was unusable: the
        bytes are the same, so the file is repaired and its journal entry stands."""
        if trainer.step == 0 or (trainer.step in {c["step"] for c in ckpts} and trainer.step not in unusable):
            return
        scores = await asyncio.to_thread(trainer.evaluate, valid) if valid else None
        ck = trainer.checkpoint()
        key = keys.checkpoint(job["id"], ck.step)
        await asyncio.to_thread(self._write, key, ck.data)
        before = max((c["step"] for c in ckpts if c["step"] < ck.step), default=0)
        event = finetune_store.checkpoint_event(job["id"], job["tenant"], ck.step, key, ck.sha256, ck.losses[before:],
                                                fence)
        event.payload.update(tokens_per_epoch=tokens_per_epoch, bytes=len(ck.data), total_steps=trainer.total_steps,
                             accuracies=ck.accuracies[before:])
        message = f"Step {ck.step}/{trainer.total_steps}: training loss={ck.losses[-1]:.4f}"
        metrics: dict[str, Any] = dict(step=ck.step, total_steps=trainer.total_steps, train_loss=ck.losses[-1],
                                       train_mean_token_accuracy=ck.accuracies[-1])
        if scores is not None:
            event.payload.update(valid_loss=scores[0], valid_mean_token_accuracy=scores[1])
            message += f", validation loss={scores[0]:.4f}"
            metrics.update(valid_loss=scores[0], valid_mean_token_accuracy=scores[1])
        labels = families.tenant(job["tenant"]), job["model"]
        families.TRAINING_LOSS.labels(*labels, "train").set(ck.losses[-1])
        if scores is not None:
            families.TRAINING_LOSS.labels(*labels, "valid").set(scores[0])
        event.payload["timing"], event.payload["ended_by"] = clock.timing(), clock.ended_by
        # The tokens these steps trained, settled in the quota ledger with the checkpoint
        # that records them: SQL audits training as it audits inference.
        trained = sum(len(e.ids) for step in range(before, ck.step) for e in trainer.batch(step))
        settle = ledger.Entry(ledger.SETTLE, keys.ftjob_step(job["id"], ck.step), job["tenant"], job["model"],
                              Tier.TRAINING, trained, 0)
        async with self.db.begin() as conn:
            await append(conn, [event, finetune_store.job_event(job["id"], job["tenant"], f"step:{ck.step}", message,
                                                                **metrics)])
            await ledger.insert(conn, [settle])

    # -- files and the model -----------------------------------------------------------------

    async def _encode(self, object_key: str) -> list[Example]:
        cached = self._encoded.get(object_key)
        return cached if cached is not None else await asyncio.to_thread(self._examples, object_key)

    def _examples(self, object_key: str) -> list[Example]:
        from training.trainer import encode_chat, encode_prompt_completion

        tok = self._tok()
        out: list[Example] = []
        held = 0
        with self.store.open(object_key) as f:
            for r in rows(f, min_examples=0):
                if not isinstance(r, Row):
                    raise ApplicationError(f"Line {r.line}: {r.message}", non_retryable=True)
                ex = (encode_chat(tok, [dict(m) for m in r.messages]) if r.format == "chat"
                      else encode_prompt_completion(tok, r.prompt, r.completion))
                if self.max_model_len and len(ex.ids) > self.max_model_len:
                    raise ApplicationError(f"Line {r.line}: the example is {len(ex.ids)} tokens, more than the "
                                           f"model's context of {self.max_model_len}.", non_retryable=True)
                held += len(ex.ids)
                if self.max_tokens is not None and held > self.max_tokens:  # stop before it takes more memory
                    raise ApplicationError(f"Line {r.line}: the file holds more than {self.max_tokens} tokens, "
                                           "the most one job may train on here (BALLAST_MAX_TRAINING_TOKENS).",
                                           non_retryable=True)
                out.append(ex)
        return out

    def _model(self) -> str:
        if not self.model_path:
            raise ApplicationError("this worker has no model to train", non_retryable=True)
        return self.model_path

    def _tok(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._model())
        return self._tokenizer

    def _pad_id(self) -> int:
        tok = self._tok()
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    def _read(self, key: str) -> bytes:
        with self.store.open(key) as f:
            return f.read()

    def _write(self, key: str, data: bytes) -> None:
        with self.store.writer(key) as f:
            f.write(data)

    def _save_adapter(self, trainer: Trainer, job_id: str) -> None:
        import tempfile
        from pathlib import Path

        # Saved on this host's scratch, then into the store: the engine workers that serve it
        # may be on other hosts (engine/adapters.py).
        with tempfile.TemporaryDirectory() as d:
            trainer.save_adapter(d)
            for path in sorted(Path(d).iterdir()):
                self._write(f"{keys.adapter(job_id)}/{path.name}", path.read_bytes())


def _f(x: float | None) -> str:
    return "" if x is None else f"{x:.6f}"


class ChunkClock:
    """Where a chunk's time goes: dispatch (scheduled → started, by Temporal's clock),
    resume (started → ready to train: the lease, the file, the trainer, the checkpoint
    read), the wait for an engine slot (interactive work first: not the checkpoint's
    cost), the steps, and the checkpoint (the previous chunk's figure until this one's is
    written). Its overhead, what chunking costs beyond the steps, counts from the previous
    chunk's checkpoint commit to this one's start (by the journal's clock: that chunk's
    completion, the workflow's turn, dispatch) where that chunk ended by its own rule; a
    chunk stopped early was followed by a wait that chunking did not cause."""

    def __init__(self, began: float, dispatch_s: float, previous: dict[str, Any] | None, now: float):
        self.began, self.dispatch_s = began, dispatch_s
        self.checkpoint_s = float(previous.get("timing", {}).get("checkpoint_s", 0.0)) if previous else 0.0
        self.between_s = (max(dispatch_s, now - previous["at_s"]) if previous and previous.get("ended_by") == "steps"
                          else dispatch_s)
        self.ready = self.started = self.ended = 0.0
        self.ended_by = ""

    def mark_ready(self) -> None:
        self.ready = time.perf_counter()

    def start(self) -> None:
        self.started = time.perf_counter()

    def trained(self, ended_by: str) -> None:
        self.ended, self.ended_by = time.perf_counter(), ended_by

    def train_s(self) -> float:
        return (self.ended or time.perf_counter()) - self.started

    def resume_s(self) -> float:
        return self.ready - self.began

    def overhead_s(self) -> float:
        return self.between_s + self.resume_s() + self.checkpoint_s

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.began

    def timing(self) -> dict[str, float]:
        """Called once the checkpoint's bytes are written (before they are journaled)."""
        self.checkpoint_s = time.perf_counter() - self.ended
        return {k: round(v, 4) for k, v in dict(
            dispatch_s=self.dispatch_s, between_s=self.between_s, resume_s=self.resume_s(),
            wait_s=self.started - self.ready, train_s=self.train_s(), checkpoint_s=self.checkpoint_s).items()}


def _dispatch_s(info: activity.Info) -> float:
    """How long the attempt waited to start, by the server's clock (0 where unknown)."""
    if info.current_attempt_scheduled_time and info.started_time:
        return max(0.0, (info.started_time - info.current_attempt_scheduled_time).total_seconds())
    return 0.0


class _no_slot:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None

