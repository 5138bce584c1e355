"""The two worker processes: control (workflows + journal activities) and engine (vLLM)."""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import AsyncExitStack
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from activities.batch import BatchActivities
from activities.batch_input import Limits
from ballast.settings import Settings
from journal.db import connect
from journal.objects import ObjectStore
from workflows.batch import BatchWorkflow

log = logging.getLogger("ballast.worker")


async def _run_until_signalled(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(worker.shutdown()))
    await worker.run()


async def control_worker(settings: Settings) -> None:
    client = await Client.connect(settings.temporal_address, namespace=settings.temporal_namespace)
    db = connect(settings.database_url)
    acts = BatchActivities(
        db,
        ObjectStore(settings.object_store_url),
        Limits("", settings.model_name, settings.max_model_len, settings.max_batch_lines),
    )
    worker = Worker(
        client,
        task_queue=settings.control_queue,
        workflows=[BatchWorkflow],
        activities=[acts.validate_batch, acts.pending_items, acts.set_batch_status, acts.fail_item, acts.finalize_batch],
    )
    log.info("control worker polling %s", settings.control_queue)
    try:
        await _run_until_signalled(worker)
    finally:
        await db.dispose()


async def engine_worker(settings: Settings) -> None:
    # vLLM is imported here, not at module level: the control plane never needs it.
    from activities.generate import GenerationActivities
    from engine.models import resolve_model
    from engine.vllm_engine import Engine
    from journal.checkpointer import Checkpointer

    spec = resolve_model(settings)
    log.info("starting vLLM with %s (%s)", spec.name, spec.path)
    engine = await Engine.start(spec, kv_cache_gib=settings.kv_cache_gib, max_num_seqs=settings.max_num_seqs)
    client = await Client.connect(settings.temporal_address, namespace=settings.temporal_namespace)
    db = connect(settings.database_url)
    async with AsyncExitStack() as stack:
        stack.callback(engine.shutdown)
        stack.push_async_callback(db.dispose)
        checkpointer = await stack.enter_async_context(Checkpointer(db))
        acts = GenerationActivities(db, engine, checkpointer, checkpoint_tokens=settings.checkpoint_tokens)
        worker = Worker(
            client,
            task_queue=settings.engine_queue,
            activities=[acts.generate],
            # Enough slots that vLLM, not Temporal, decides how many run at once.
            max_concurrent_activities=settings.max_num_seqs * 2,
            graceful_shutdown_timeout=timedelta(seconds=5),
        )
        log.info("engine worker polling %s", settings.engine_queue)
        await _run_until_signalled(worker)
