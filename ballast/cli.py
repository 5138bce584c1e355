"""`ballast up | api | worker {control,engine} | migrate | tenants ... | bench ...`"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pydantic import ValidationError

from ballast import tenants_cli
from ballast.settings import Settings

# What to set for each setting a command needs: the services need only their own role's URL.
_ENV = dict(service_db_url="BALLAST_SERVICE_DATABASE_URL (or BALLAST_DATABASE_URL)")


def _need(settings: Settings, *names: str) -> None:
    missing = [n for n in names if not getattr(settings, n)]
    if missing:
        env = ", ".join(_ENV.get(n, "BALLAST_" + n.upper()) for n in missing)
        sys.exit(f"ballast: set {env} (or run `ballast up`, which starts embedded services)")


def _need_engine_token(settings: Settings) -> None:
    """The API and every engine worker share BALLAST_ENGINE_TOKEN: an engine serves only
    requests that carry it, so neither starts without it."""
    from ballast.workers import engine_token

    try:
        engine_token(settings)
    except RuntimeError as err:
        sys.exit(f"ballast: {err}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ballast", description="Durable workload manager for LLM inference on vLLM.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="run everything on this machine (embedded Postgres and Temporal unless configured)")
    u.add_argument("--engines", type=int, default=None, help="engine workers to run here, one vLLM engine each "
                                                             "(BALLAST_ENGINES, 1)")
    sub.add_parser("api", help="serve the OpenAI-compatible API")
    w = sub.add_parser("worker", help="run a Temporal worker; or list the engine workers, or drain one")
    w.add_argument("kind", choices=["control", "engine", "list", "drain"])
    w.add_argument("id", nargs="?", help="drain: the engine worker's id (as `ballast worker list` shows it)")
    sub.add_parser("migrate",
                   help="alembic upgrade head on BALLAST_DATABASE_URL (the owner), granting the services' role")
    tenants_cli.add_parser(sub)
    b = sub.add_parser("bench", help="benchmarks that print ratios measured side by side")
    b.add_argument("name", choices=["batch", "surge", "overhead", "admission", "fairness", "placement",
                                        "grouping", "training", "fold"])
    b.add_argument("--requests", type=int, default=None,
                   help="batch: how many requests (256); overhead: streamed chats per pacing and arm (500)")
    b.add_argument("--seconds", type=float, default=None,
                   help="surge: seconds of interactive load per arm (90); fairness: seconds of backlog per arm (20); "
                        "placement: seconds of each trace per arm (40); "
                        "batch: how long the long batch runs on raw vLLM (65; 0: the short batch only)")
    b.add_argument("--runs", type=int, default=None,
                   help="batch: rounds, alternating raw vLLM and Ballast (3); surge: rounds of the arrival plan "
                        "per arm, pooled (4); grouping: batches per arm (2); "
                        "training: jobs per arm (3); fold: ticks per ledger size (200)")
    b.add_argument("--arms", default=None,
                   help="surge: which arms, comma-separated (all: alone,ballast,priority,partition)")
    c = sub.add_parser("chaos", help="faults injected into a fresh `ballast up` under load; the journal's "
                                     "invariants checked in SQL at the end")
    c.add_argument("--minutes", type=float, default=15.0, help="about how long to inject faults (15: 20+ engine kills)")
    v = sub.add_parser("verify", help="check the journal's invariants (SQL) on BALLAST_DATABASE_URL: each check's "
                                      "rows examined; exits 1 on a violation, or when nothing at all was examined")
    v.add_argument("--tokenizer", default=None, help="a model directory (or hub id): also re-tokenize each completed "
                                                     "batch item's prompt with transformers against its settle")
    v.add_argument("--model", default=None, help="with --tokenizer: only the items of this served model name (and "
                                                 "its fine-tuned models)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        settings = Settings()
    except ValidationError as err:  # a bad BALLAST_* variable: say which, no traceback
        print(f"ballast: invalid settings (BALLAST_* environment variables):\n{err}", file=sys.stderr)
        return 2

    if args.cmd == "up":
        from ballast.stack import up

        if args.engines is not None:
            if args.engines < 1:
                parser.error("--engines must be at least 1")
            settings = settings.model_copy(update=dict(engines=args.engines))
        return up(settings)
    if args.cmd == "migrate":
        from ballast.pg import set_password
        from journal.migrate import upgrade

        _need(settings, "database_url")
        owner = settings.require("database_url")
        upgrade(owner, service_url=settings.service_db_url)  # as the owner
        if settings.service_database_password:
            # The migration that creates the role sets its password once; a password changed
            # since (or a role made without one) is applied on every migrate.
            set_password(owner, settings.service_role, settings.service_database_password)
        return 0
    if args.cmd == "tenants":
        return tenants_cli.main(args, settings)
    if args.cmd == "api":
        import uvicorn

        from api.app import create_app

        _need(settings, "service_db_url", "temporal_address")
        _need_engine_token(settings)
        from ballast.procs import listen_nodelay

        config = uvicorn.Config(create_app(settings), log_level="warning")
        uvicorn.Server(config).run(sockets=[listen_nodelay(settings.api_host, settings.api_port)])
        return 0
    if args.cmd == "worker" and args.kind in ("list", "drain"):
        from ballast import workers

        # As `ballast tenants`: DATABASE_URL, or the running `ballast up`'s embedded Postgres.
        settings = settings.model_copy(update=dict(database_url=tenants_cli.database_url(settings)))
        if args.kind == "drain" and not args.id:
            parser.error("ballast worker drain ID: which engine worker (`ballast worker list` shows them)")
        return asyncio.run(workers.list_or_drain(settings, args.id if args.kind == "drain" else None))
    if args.cmd == "worker":
        from ballast import workers

        _need(settings, "service_db_url", "temporal_address")
        if args.kind == "engine":
            _need_engine_token(settings)
        asyncio.run((workers.engine_worker if args.kind == "engine" else workers.control_worker)(settings))
        return 0
    if args.cmd == "chaos":
        from bench.chaos import main as chaos

        return chaos(settings, minutes=args.minutes)
    if args.cmd == "verify":
        from journal.invariants import audit, passed, report

        _need(settings, "database_url")
        findings = audit(settings.require("database_url"), tokenizer=args.tokenizer, model=args.model)
        print(report(findings))
        return 0 if passed(findings) else 1
    if args.cmd == "bench":
        if args.name == "batch":
            from bench.batch import main as bench_batch

            return bench_batch(settings, requests=args.requests or 256, runs=args.runs or 3,
                               long_s=65.0 if args.seconds is None else args.seconds)
        if args.name == "surge":
            from bench.surge import main as bench_surge

            return bench_surge(settings, duration_s=args.seconds or 90.0,
                               arms=args.arms.split(",") if args.arms else None, rounds=args.runs or 4)
        if args.name == "training":
            from bench.training import main as bench_training

            return bench_training(settings, jobs=args.runs or 3)
        if args.name == "grouping":
            from bench.grouping import main as bench_grouping

            return bench_grouping(settings, rounds=args.runs or 2)
        if args.name == "placement":
            from bench.placement import main as bench_placement

            return bench_placement(settings, seconds=args.seconds or 40.0)
        if args.name == "fairness":
            from bench.fairness import main as bench_fairness

            return bench_fairness(settings, seconds=args.seconds or 20.0)
        if args.name == "fold":
            from bench.fold import main as bench_fold

            return bench_fold(settings, ticks=args.runs or 200)
        if args.name == "admission":
            from bench.admission import main as bench_admission

            return bench_admission(settings)
        from bench.overhead import main as bench_overhead

        return bench_overhead(settings, requests=args.requests or 500)
    return 2


if __name__ == "__main__":
    sys.exit(main())
