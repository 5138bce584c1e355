"""`python -m bench NAME [options]` (also `ballast bench NAME`, `ballast chaos`): each
benchmark with its own options, each option meaning one thing. Every run prints its figures
as JSON; bench/RESULTS.md keeps them with the command that made them."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from config import Settings

Run = Callable[[Settings, argparse.Namespace], int]


def _batch(s: Settings, a: argparse.Namespace) -> int:
    from bench.batch import main

    return main(s, requests=a.requests, runs=a.rounds, long_s=a.long_seconds)


def _surge(s: Settings, a: argparse.Namespace) -> int:
    from bench.surge import main

    return main(s, duration_s=a.seconds, arms=a.arms.split(",") if a.arms else None, rounds=a.rounds)


def _overhead(s: Settings, a: argparse.Namespace) -> int:
    from bench.overhead import main

    return main(s, requests=a.requests)


def _rate(s: Settings, a: argparse.Namespace) -> int:
    from bench.rate import main

    return main(s, requests=a.requests, rounds=a.rounds, concurrency=a.concurrency)


def _cost(s: Settings, a: argparse.Namespace) -> int:
    from bench.cost import main

    return main(s, n_requests=a.requests, items=a.items)


def _prefix(s: Settings, a: argparse.Namespace) -> int:
    from bench.prefix import main

    return main(s, items=a.items, prefixes=a.prefixes, prefix_chars=a.prefix_chars, cache_share=a.cache_share,
                rounds=a.rounds, long_prefill_tokens=a.long_prefill_tokens)


def _admission(s: Settings, a: argparse.Namespace) -> int:
    from bench.admission import main

    return main(s)


def _fairness(s: Settings, a: argparse.Namespace) -> int:
    from bench.fairness import main

    return main(s, seconds=a.seconds)


def _placement(s: Settings, a: argparse.Namespace) -> int:
    from bench.placement import main

    return main(s, seconds=a.seconds, record=a.record)


def _grouping(s: Settings, a: argparse.Namespace) -> int:
    from bench.grouping import main

    return main(s, rounds=a.batches)


def _training(s: Settings, a: argparse.Namespace) -> int:
    from bench.training import main

    return main(s, jobs=a.jobs)


def _fold(s: Settings, a: argparse.Namespace) -> int:
    from bench.fold import main

    return main(s, ticks=a.ticks)


def _promises(s: Settings, a: argparse.Namespace) -> int:
    from bench.promises import main

    return main(s, seconds=a.seconds, load=a.load, windows=tuple(a.windows.split(",")))


def _reserved(s: Settings, a: argparse.Namespace) -> int:
    from bench.reserved import main, main_tokens

    if a.in_tokens:
        return main_tokens(s, seconds=a.seconds, share=a.share, gold_streams=a.gold_streams, streams=a.streams,
                           spare=a.slots if a.spare is None else a.spare)
    return main(s, seconds=a.seconds, rate=a.rate, slots=a.slots, streams=a.streams,
                spare=a.slots if a.spare is None else a.spare)


def _overload(s: Settings, a: argparse.Namespace) -> int:
    from bench.overload import main

    return main(s, seconds=a.seconds, rate=a.rate, max_tokens=a.max_tokens, reserved=a.reserved,
                giant_streams=a.giant_streams)


def _chaos(s: Settings, a: argparse.Namespace) -> int:
    from bench.chaos import main

    return main(s, minutes=a.minutes)


def _hosts(s: Settings, a: argparse.Namespace) -> int:
    from bench.hosts import main

    return main(s, items=a.items, chats=a.chats)


def _cells(s: Settings, a: argparse.Namespace) -> int:
    from bench.cells import main

    return main(s, seconds=a.seconds, rate=a.rate, lose=a.lose)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description="Benchmarks that print ratios measured side "
                                                                    "by side in one run, and the chaos run.")
    sub = p.add_subparsers(dest="name", required=True)

    def bench(name: str, run: Run, help: str) -> argparse.ArgumentParser:
        b = sub.add_parser(name, help=help)
        b.set_defaults(run=run)
        return b

    b = bench("batch", _batch, "one batch file: raw vLLM, vLLM run-batch, Ballast, Ballast without LoRA")
    b.add_argument("--requests", type=int, default=256, help="requests in the short batch")
    b.add_argument("--rounds", type=int, default=3, help="rounds, the arms' order rotating")
    b.add_argument("--long-seconds", type=float, default=65.0,
                   help="how long the long batch runs on raw vLLM (0: the short batch only)")
    b = bench("surge", _surge, "chat bursts over a batch backlog, against chat alone and the baselines")
    b.add_argument("--seconds", type=float, default=90.0, help="seconds of interactive load per round")
    b.add_argument("--rounds", type=int, default=4, help="rounds of the arrival plan per arm, pooled")
    b.add_argument("--arms", default=None, help="comma-separated (all: alone,ballast,priority,partition)")
    b = bench("overhead", _overhead, "what Ballast adds to a streamed chat's first token, against vLLM direct")
    b.add_argument("--requests", type=int, default=500, help="streamed chats per pacing and arm")
    b = bench("rate", _rate, "small chats per second through Ballast, against vllm serve on the same engine")
    b.add_argument("--requests", type=int, default=400, help="chats per arm and round")
    b.add_argument("--rounds", type=int, default=3, help="rounds, the arms' order alternating")
    b.add_argument("--concurrency", type=int, default=8, help="chats in flight at once")
    b = bench("cost", _cost, "the control plane's Temporal actions, Postgres rows and CPU per request, batch item "
                             "and fine-tune step, projected to the seeds' scale")
    b.add_argument("--requests", type=int, default=1000, help="chats")
    b.add_argument("--items", type=int, default=256, help="batch items")
    b = bench("prefix", _prefix, "a prefix-heavy batch larger than the KV cache: vLLM run-batch against Ballast")
    b.add_argument("--items", type=int, default=768, help="lines of the batch")
    b.add_argument("--prefixes", type=int, default=24, help="distinct shared prefixes, one drawn per line")
    b.add_argument("--prefix-chars", type=int, default=1200, help="each prefix's length (a token a character)")
    b.add_argument("--cache-share", type=float, default=0.25, help="the KV cache holds this share of the prefixes")
    b.add_argument("--rounds", type=int, default=2, help="rounds, the arms' order alternating")
    b.add_argument("--long-prefill-tokens", type=int, default=0,
                   help="vLLM's long_prefill_token_threshold in every arm (Ballast's default is 64, for chat)")
    bench("admission", _admission, "quota overshoot across real API processes, judged from the ledger")
    b = bench("fairness", _fairness, "two tenants' service at the client, VTC against FCFS")
    b.add_argument("--seconds", type=float, default=20.0, help="seconds of backlog per arm")
    b = bench("placement", _placement, "prompt-cache affinity against round-robin and least-loaded")
    b.add_argument("--seconds", type=float, default=40.0, help="seconds of each trace per arm")
    b.add_argument("--record", type=Path, default=None,
                   help="where to write every request's arrival, prompt blocks and engine, per arm, for "
                        "`ballast sim replay` (default: the data dir's bench/placement-record.json)")
    b = bench("grouping", _grouping, "a batch's shared prefixes kept on one engine worker, or not")
    b.add_argument("--batches", type=int, default=2, help="batches per arm")
    b = bench("training", _training, "fine-tuning chunks, checkpoints and resumes beside chats")
    b.add_argument("--jobs", type=int, default=3, help="fine-tuning jobs per arm")
    b = bench("fold", _fold, "the quota fold's cost: incremental against a full refold")
    b.add_argument("--ticks", type=int, default=200, help="reconciler ticks per ledger size")
    b = bench("promises", _promises, "mixed completion windows asked of a fleet beyond its pace: kept, and each "
                                     "refusal replayed")
    b.add_argument("--seconds", type=float, default=150.0, help="seconds of arrivals")
    b.add_argument("--load", type=float, default=2.0, help="arrivals' work over the pace's promised share")
    b.add_argument("--windows", default="30s,60s,120s", help="the completion windows offered, comma-separated")
    b = bench("reserved", _reserved, "a tenant's reserved slots with the engine full of others' chats and batch: "
                                     "its TTFT against alone and unreserved, and the reservation lent while idle")
    b.add_argument("--seconds", type=float, default=60.0, help="seconds of the reserved tenant's chats per phase")
    b.add_argument("--rate", type=float, default=4.0, help="its chats a second (Poisson)")
    b.add_argument("--slots", type=int, default=2, help="slots reserved for it")
    b.add_argument("--streams", type=int, default=24, help="the other tenant's chats in flight")
    b.add_argument("--spare", type=int, default=None,
                   help="BALLAST_SPARE_SEQS, in every phase (default: --slots; 0: a slot taken back is aborted)")
    b.add_argument("--in-tokens", action="store_true",
                   help="reserve output tokens a second instead, and measure what the tenant is delivered")
    b.add_argument("--share", type=float, default=0.5,
                   help="with --in-tokens: the reservation as a share of the engine's measured generation rate")
    b.add_argument("--gold-streams", type=int, default=16, help="with --in-tokens: its chats in flight")
    b = bench("overload", _overload, "the overload policy by class: the fleet shrinks, the work doubles, one tenant "
                                     "floods giant prompts; waiting time, refusals and downgrades per class")
    b.add_argument("--seconds", type=float, default=120.0, help="seconds of each phase")
    b.add_argument("--rate", type=float, default=1.5, help="chats a second per interactive tenant (Poisson)")
    b.add_argument("--max-tokens", type=int, default=96, help="tokens each chat generates")
    b.add_argument("--reserved", type=int, default=4, help="slots reserved for the reserved tenant")
    b.add_argument("--giant-streams", type=int, default=8, help="giant-prompt chats kept in flight")
    b = bench("chaos", _chaos, "faults injected into a fresh `ballast up` under load; the client's record and "
                               "the journal's invariants judged at the end")
    b.add_argument("--minutes", type=float, default=15.0, help="about how long to inject faults (15: 20+ engine kills)")
    b = bench("hosts", _hosts, "Ballast as separate hosts in network namespaces (root): chats, a fine-tune and a "
                               "batch through two API hosts, one engine host's link cut mid-batch")
    b.add_argument("--items", type=int, default=48, help="batch items")
    b.add_argument("--chats", type=int, default=8, help="chats, alternating between the API hosts")
    b = bench("cells", _cells, "three regions as cells in network namespaces (root): a global daily limit "
                               "reconciled between them through delayed links, one region cut and mended")
    b.add_argument("--seconds", type=float, default=90.0, help="seconds of load through the edge")
    b.add_argument("--rate", type=float, default=6.0, help="chats a second")
    b.add_argument("--lose", choices=("crash", "cut"), default="crash",
                   help="how the region is lost: every process of it killed and started again later (crash), or "
                        "its link down and up (cut)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        settings = Settings()
    except ValidationError as err:
        print(f"bench: invalid settings (BALLAST_* environment variables):\n{err}", file=sys.stderr)
        return 2
    return int(args.run(settings, args))


if __name__ == "__main__":
    sys.exit(main())
