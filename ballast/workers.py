"""The two worker processes: control (workflows + journal activities) and engine (vLLM)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import uvicorn
from temporalio.client import Client
from temporalio.common import TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.worker import Worker

from activities.batch import BatchActivities
from activities.finetune import FineTuneActivities
from activities.fleet import FleetActivities
from activities.interactive import RequestActivities
from activities.quota import QuotaActivities
from activities.webhooks import WebhookActivities
from ballast import gauges, procs
from ballast.probes import probes_app
from config import Settings
from config.database import SERVICE_ROLES
from config.temporal import connect_temporal, search_attributes_usable
from journal.db import connect
from policy.grouping import own_queue
from policy.placement import region_queue
from policy.pools import pool_queue
from policy.preemption import min_slots
from protocol import search
from protocol.engine_wire import EngineStats
from protocol.fleet import SurgePolicy
from protocol.requests import RequestLimits
from protocol.temporal import FleetInput, QuotaInput
from protocol.tiers import Tier
from protocol.webhooks import webhook_queue
from storage.objects import ObjectStore
from telemetry import exposition, families
from telemetry.tracing import setup as setup_tracing
from workflows.batch import BatchWorkflow
from workflows.finetune import FineTuneWorkflow
from workflows.fleet import FLEET_ID, FleetWorkflow
from workflows.interactive import InteractiveWorkflow, RequestWindowWorkflow
from workflows.quota import QUOTA_ID, QuotaReconciler
from workflows.webhooks import WebhookDelivery

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from engine.gate import GatedEngine

log = logging.getLogger("ballast.worker")


async def _run_until_signalled(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(worker.shutdown()))
    await worker.run()


async def _run_until_drained(make_workers: Callable[[], list[Worker]], draining: Draining, engine_id: str,
                             polling: asyncio.Event) -> None:
    """Poll until signalled. Drained (`/admin/engines/{id}/drain`, `ballast worker drain`):
    stop polling, which lets running generations finish for the worker's graceful timeout
    and then cancels them to resume elsewhere from the journal, and keep serving the
    streams still open (the API sends no new ones); undrained, poll again with new
    workers. `polling` is set while the workers poll."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        workers = make_workers()
        running = [asyncio.create_task(w.run()) for w in workers]
        polling.set()
        await _first(stop.wait(), draining.drained.wait(), *running)
        polling.clear()
        await asyncio.gather(*(w.shutdown() for w, r in zip(workers, running, strict=True) if not r.done()))
        await asyncio.gather(*running)
        if stop.is_set():
            break
        log.warning("engine worker %s drained: it takes no new work; undrain it, or stop it once its open streams "
                    "end", engine_id)
        await _first(stop.wait(), draining.serving.wait())
        if not stop.is_set():
            log.warning("engine worker %s undrained: it takes new work again", engine_id)


async def _first(*waits: Awaitable[Any]) -> None:
    """Until the first of them is done; the others are cancelled (the tasks given stay)."""
    tasks = [w if isinstance(w, asyncio.Task) else asyncio.ensure_future(w) for w in waits]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t, w in zip(tasks, waits, strict=True):
        if t is not w:
            t.cancel()


class Draining:
    """Whether an operator is draining this engine, as its last announcement read it: one
    of the two events is set."""

    def __init__(self) -> None:
        self.drained, self.serving = asyncio.Event(), asyncio.Event()
        self.serving.set()

    def set(self, draining: bool) -> None:
        on, off = (self.drained, self.serving) if draining else (self.serving, self.drained)
        off.clear()
        on.set()


async def _warn_if_overprivileged(db: AsyncEngine, service: str) -> None:
    """A worker that could mint keys holds more than it uses: say so, and what to hand it."""
    from sqlalchemy import text

    async with db.connect() as conn:
        user, keys = (await conn.execute(text(
            "SELECT current_user, has_table_privilege('api_keys', 'INSERT')"))).one()
    if keys:
        log.warning("the %s worker logs in as %r, which may write API keys and limits: hand it the %s role's "
                    "URL (%s; docs/deployment.md#postgres-roles-and-secrets)", service, user, service,
                    SERVICE_ROLES[service])


async def control_worker(settings: Settings) -> None:
    from engine.server import EmbeddedServer

    setup_tracing("ballast-control", settings)  # before the client: its workers' spans are traced
    client = await connect_temporal(settings, exposition.temporal_runtime())
    families.bound_tenants(settings.metrics_max_tenants)
    db = connect(settings.require("service_db_url"), name="ballast-control")
    await _warn_if_overprivileged(db, "control")
    acts = BatchActivities(
        db,
        ObjectStore(settings.object_store_url),
        RequestLimits(settings.model_name, settings.max_model_len), settings.max_batch_lines,
        settings.windows, settings.batch_promise_share,
    )
    fleet = FleetActivities(db)
    quota = QuotaActivities(db, settings.unreported_after_s, ObjectStore(settings.object_store_url))
    tuning = FineTuneActivities(db, ObjectStore(settings.object_store_url))
    worker = Worker(
        client,
        task_queue=settings.control_queue,
        workflows=[BatchWorkflow, FleetWorkflow, QuotaReconciler, FineTuneWorkflow],
        activities=[acts.validate_batch, acts.pending_items, acts.fail_item, acts.fail_batch, acts.finalize_batch,
                    fleet.observe_fleet, fleet.apply_fleet, quota.reconcile_quota,
                    tuning.validate_training_file, tuning.fine_tune_status],
    )
    # Interactive requests' windows (started by the API replicas, which run no worker):
    # journal each outcome and settle it in the ledger.
    requests = RequestActivities(db)
    interactive = Worker(client, task_queue=settings.interactive_queue,
                         workflows=[RequestWindowWorkflow, InteractiveWorkflow],
                         activities=[requests.journal_window, requests.journal_request])
    # Completion webhooks, on a queue of their own: a slow receiver holds only their slots.
    hooks = WebhookActivities(db, settings)
    webhooks = Worker(client, task_queue=webhook_queue(settings.control_queue), workflows=[WebhookDelivery],
                      activities=[hooks.raise_webhook, hooks.deliver_webhook, hooks.abandon_webhook])
    log.info("control worker polling %s and %s", settings.control_queue, settings.interactive_queue)
    polling = asyncio.Event()
    app = probes_app(db, client, polling.is_set, _secret(settings.metrics_token))
    port = settings.control_port or procs.free_port(settings.control_host)
    server = EmbeddedServer(uvicorn.Config(app, host=settings.control_host, port=port, log_level="warning",
                                           lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[procs.listen_nodelay(settings.control_host, port)]))
    log.info("control worker probes and metrics at http://%s:%d (/healthz, /readyz, /metrics)",
             settings.control_host, port)
    gauging = asyncio.create_task(gauges.keep_refreshing(db, settings.metrics_refresh_s, settings.scale_policy(),
                                                         stale_s=5 * settings.announce_s))
    try:
        searchable = await search_attributes_usable(client, settings)
        await start_fleet(client, settings, searchable)
        await start_quota(client, settings, searchable)
        async with interactive, webhooks:
            polling.set()
            procs.freeze_heap()
            procs.notify_ready()
            await _run_until_signalled(worker)
    finally:
        polling.clear()
        gauging.cancel()
        await _stop_server(server, serving)
        await hooks.close()
        await db.dispose()


async def start_fleet(client: Client, settings: Settings, searchable: bool = False) -> None:
    """The fleet controller runs once per control queue, however many control workers poll it."""
    policy = SurgePolicy(settings.surge_high, settings.surge_low, settings.surge_cool_down_s,
                         settings.surge_batch_share)
    await client.start_workflow(
        FleetWorkflow.run, FleetInput(policy, settings.fleet_tick_s, stale_s=5 * settings.announce_s),
        id=f"{FLEET_ID}:{settings.control_queue}", task_queue=settings.control_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=search.attributes("fleet") if searchable else TypedSearchAttributes.empty,
    )


async def start_quota(client: Client, settings: Settings, searchable: bool = False) -> None:
    """The quota reconciler, like the fleet controller: one per control queue."""
    await client.start_workflow(
        QuotaReconciler.run, QuotaInput(settings.admission_refresh_s, settings.admission_holder_ttl_s),
        id=f"{QUOTA_ID}:{settings.control_queue}", task_queue=settings.control_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=search.attributes("quota") if searchable else TypedSearchAttributes.empty,
    )


async def engine_worker(settings: Settings) -> None:
    # vLLM is imported here, not at module level: the control plane never needs it.
    from activities.generate import GenerationActivities
    from engine import metrics as engine_metrics
    from engine.adapters import Adapters
    from engine.fair_share import FairShare
    from engine.model_spec import resolve_model
    from engine.prefix_leaders import PrefixLeaders
    from engine.server import EmbeddedServer, create_app
    from engine.slots import EngineSlots
    from engine.trace import Trace
    from engine.vllm_engine import Engine, engine_args
    from journal.checkpointer import Checkpointer
    from journal.served import ServedRecords

    token = engine_token(settings)  # before minutes of vLLM start-up, not after
    setup_tracing("ballast-engine", settings)  # before vLLM, whose spans then go the same way
    spec = resolve_model(settings)
    log.info("starting vLLM with %s (%s)", spec.name, spec.path)
    # Fine-tuned models (LoRA adapters from the object store) beside the base model.
    adapters = (Adapters(ObjectStore(settings.object_store_url), settings.data_dir / "adapters")
                if settings.serve_fine_tuned and not spec.embeds else None)
    # The settings' vLLM arguments, from the one mapping every benchmark's raw arm uses too.
    engine: Engine | GatedEngine = await Engine.from_args(spec, engine_args(spec, settings),
                                                          nice=settings.engine_nice, adapters=adapters,
                                                          full_at=settings.max_num_seqs)
    if settings.engine_gate is not None:  # a test seam: batch generations hold at the file's budgets
        from engine.gate import GatedEngine

        log.warning("engine gate on: batch generations hold at the budgets in %s", settings.engine_gate)
        engine = GatedEngine(engine, settings.engine_gate)
    client = await connect_temporal(settings, exposition.temporal_runtime())
    families.bound_tenants(settings.metrics_max_tenants)
    db = connect(settings.require("service_db_url"), name="ballast-engine")
    await _warn_if_overprivileged(db, "engine")
    slots = EngineSlots(settings.max_num_seqs, busy_cap=settings.batch_busy_cap, cool_down_s=settings.batch_cool_down_s,
                        priced=settings.batch_resume == "priced",
                        min_share=settings.batch_min_share, starve_after_s=settings.batch_starve_after_s,
                        preemption=settings.batch_preemption, max_share=settings.batch_max_share,
                        spare=settings.spare_seqs)
    port = settings.engine_port or procs.free_port(settings.engine_host)
    url = settings.engine_url or f"http://{settings.engine_host}:{port}"
    engine_id = f"{socket.gethostname()}-{os.getpid()}"
    fair = FairShare(settings.fair_share, settings.max_num_seqs,
                     headroom=min_slots(settings.fair_headroom, settings.max_num_seqs),
                     floors=dict(flex=min_slots(settings.flex_min_share, settings.max_num_seqs)),
                     starve_after_s=settings.flex_starve_after_s, long_prompt=settings.fair_long_prompt,
                     long_prefills=settings.fair_long_prefills,
                     bounds=dict(priority=settings.wait_bound_priority_s, default=settings.wait_bound_default_s,
                                 flex=settings.wait_bound_flex_s))
    fair.lending = slots.lend  # reserved slots left unused: batch's until asked for
    async with AsyncExitStack() as stack:
        stack.callback(engine.shutdown)
        stack.push_async_callback(db.dispose)
        trace = Trace(str(settings.engine_trace) if settings.engine_trace else None)
        tracing = asyncio.create_task(trace.run(engine.load))
        stack.callback(tracing.cancel)
        checkpointer = await stack.enter_async_context(Checkpointer(db, settings.checkpoint_interval_s, trace=trace))
        # Every request served is journaled from here too, on the checkpointer's ticks: the
        # record that accounts for it if its API process dies (journal/served.py). What the
        # last tick left goes with the checkpointer's last commit, once the server has stopped.
        served = ServedRecords(engine_id)
        stack.enter_context(checkpointer.track(served))
        stack.callback(lambda: served.committed(checkpointer.submit(served.due())))
        engine_metrics.register(slots, fair, spec.name, settings.region)
        polling = asyncio.Event()  # set while its Temporal workers poll (its /readyz)
        app = create_app(engine, slots, fair, token=token,
                         served=served.add,
                         metrics_token=_secret(settings.metrics_token), polling=polling.is_set)
        server = EmbeddedServer(uvicorn.Config(app, host=settings.engine_host, port=port, log_level="warning",
                                               lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[procs.listen_nodelay(settings.engine_host, port)]))
        stack.push_async_callback(_stop_server, server, serving)
        draining = Draining()
        # One pool per model: its batch queue, and its region's and each worker's own under it.
        pool = pool_queue(settings.engine_queue, spec.name)
        announcing = asyncio.create_task(_announce(db, engine_id, url, spec, pool, settings, slots, engine, fair,
                                                   draining))
        stack.push_async_callback(_withdraw, db, engine_id, announcing)
        acts = GenerationActivities(db, engine, checkpointer, slots, checkpoint_tokens=settings.checkpoint_tokens,
                                    trace=trace, leaders=PrefixLeaders(
                                        settings.batch_prefix_wait_s,
                                        min_blocks=engine.prefill_step_tokens // engine.block_size))
        # The pool's queue, and its region's: a tenant fenced to regions has its batches
        # sent to one of theirs (policy/placement.py), which no engine elsewhere polls; and
        # its own, where a batch sends the groups whose prefix it holds (policy/grouping.py).
        # And the queue every engine shared before pools had their own, for the batches
        # started then (a generation of another model there is handed back: activities/generate.py).
        queues = [pool, region_queue(pool, settings.region), own_queue(pool, settings.region, engine_id),
                  settings.engine_queue]
        # Fine-tuning chunks too: they hold batch slots, so they yield to chat as batch does.
        tuning = FineTuneActivities(db, ObjectStore(settings.object_store_url), spec.path, spec.max_model_len, slots,
                                    max_tokens=settings.max_training_tokens)

        def make_workers() -> list[Worker]:  # anew after each drain: a worker shut down does not run again
            return [Worker(client, task_queue=q, activities=[acts.generate, tuning.train_chunk],
                           # Enough slots that the engine slots, not Temporal, decide how much runs at once.
                           max_concurrent_activities=settings.max_num_seqs * 2,
                           graceful_shutdown_timeout=timedelta(seconds=5)) for q in queues]

        log.info("engine worker %s polling %s, streaming at %s", engine_id, " and ".join(queues), url)
        procs.freeze_heap()
        procs.notify_ready()
        await _run_until_drained(make_workers, draining, engine_id, polling)


async def list_or_drain(settings: Settings, drain: str | None, draining: bool = True) -> int:
    """`ballast worker list`: the engine workers seen lately. `ballast worker drain ID`:
    that one takes no new work (the API and Temporal stop sending it any); `undrain ID`:
    it takes work again."""
    from journal import engine_registry

    db = connect(settings.require("database_url"), pool_size=1)
    try:
        async with db.begin() as conn:
            if drain is not None:
                if not await engine_registry.drain(conn, drain, draining):
                    print(f"ballast: no engine worker {drain!r}; `ballast worker list` shows them", file=sys.stderr)
                    return 1
                print(f"{drain}: draining. It takes no new work; its generations finish or move to the others."
                      if draining else f"{drain}: serving. It takes new work again.")
                return 0
            rows = await engine_registry.live(conn, within_s=60)
        print(f"{'id':<28} {'region':<10} {'model':<16} {'running':>7} {'waiting':>7} {'kv':>5}  state")
        for r in rows:
            st = EngineStats.from_json(r["stats"])
            state = "draining" if r["draining"] else "serving"
            print(f"{r['id']:<28} {st.region:<10} {r['model']:<16} {st.running:>7} "
                  f"{st.waiting:>7} {st.kv_cache_usage:>5.0%}  {state}  {r['url']}")
        return 0
    finally:
        await db.dispose()


def _secret(value) -> str | None:
    return (value.get_secret_value().strip() or None) if value is not None else None


def engine_token(settings: Settings) -> str:
    """The shared secret the engine worker's endpoint demands of the API. Always required:
    the endpoint generates for anyone who reaches it, bypassing keys, quotas and the journal,
    and even a loopback port is open to every local user and process."""
    token = settings.engine_token.get_secret_value().strip() if settings.engine_token else ""
    if not token:
        raise RuntimeError("BALLAST_ENGINE_TOKEN is not set: an engine worker serves only requests that carry it. "
                           "Set it to the API's value (`ballast up` keeps one in <data dir>/engine-token), "
                           "or make one: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return token


async def _announce(db, engine_id: str, url: str, spec, queue: str, settings: Settings, slots, engine, fair,
                    draining: Draining) -> None:
    """Every second, off the request path: tell the API and the fleet controller where this
    engine streams from and how loaded it is; take the controller's batch cap back, and
    whether an operator is draining this engine; its batch pace, which completion windows
    are promised on (policy/promises.py), and its rate at full load; and its part of its
    pool's reservations, those in tokens a second as slots at the pool's rate at full load,
    which it keeps for their tenants (policy/reservations.py)."""
    from dataclasses import asdict

    from journal import engine_registry, reservations
    from policy import reservations as reserving
    from policy.promises import Pace, paced

    pace = full = Pace()
    while True:
        try:
            report = slots.report()
            batch_tokens = int(families.total(families.BATCH_TOKENS))
            pace = paced(pace, slots.busy_s(), batch_tokens)
            full = paced(full, engine.load.full_s, engine.load.full_tokens)
            reserved, used = fair.reserved, reserving.used(fair.reserved, fair.running_of)
            lent = min(report["batch"], sum(reserved.values()) - sum(used.values()))
            async with db.begin() as conn:
                pool = [reserving.Reserved(r["tenant"], r["slots"], r["region"], r["tokens_per_s"])
                        for r in await reservations.in_force(conn, model=spec.name)]
                peers = {e["id"]: reserving.Peer(s.region, s.max_seqs, s.full_rate, s.spare_seqs)
                         for e in await engine_registry.live(conn, settings.announce_s * 5)
                         if e["model"] == spec.name and not e["draining"]
                         for s in [EngineStats.from_json(e["stats"])]}
                if not draining.drained.is_set():  # a draining engine leaves its part to its peers
                    peers[engine_id] = reserving.Peer(settings.region, settings.max_num_seqs, full.rate,
                                                       settings.spare_seqs)
                cap, drained = await engine_registry.announce(
                    conn, engine_id, url, spec.name, queue,
                    EngineStats(**report, **asdict(engine.load), max_seqs=settings.max_num_seqs,
                                spare_seqs=settings.spare_seqs,
                                flex=fair.in_tier(Tier.FLEX), flex_floor=fair.floors.get(Tier.FLEX, 0),
                                block_size=engine.block_size, region=settings.region,
                                max_model_len=spec.max_model_len, model_source=spec.path, task=spec.task,
                                batch_tokens=batch_tokens, batch_rate=round(pace.rate, 3),
                                full_rate=round(full.rate, 3), reserved=reserved,
                                reserved_used=used, lent=lent).to_json())
            fair.reserve(reserving.shares(reserving.in_slots(pool, peers),
                                          {e: p.region for e, p in peers.items()}, engine_id))
            await slots.direct(cap)
            draining.set(drained)
        except Exception as err:  # the database is back soon; the API sees us as stale meanwhile
            log.warning("could not announce engine %s: %s", engine_id, err)
        await asyncio.sleep(settings.announce_s)


async def _withdraw(db, engine_id: str, announcing: asyncio.Task) -> None:
    from journal import engine_registry

    announcing.cancel()
    async with db.begin() as conn:
        await engine_registry.withdraw(conn, engine_id)


async def _stop_server(server, serving: asyncio.Task) -> None:
    server.should_exit = True
    await serving
