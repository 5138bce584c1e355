"""`ballast sim placement | fleet | quota | fairness | grouping | replay`: the simulator's experiments,
printed as markdown."""

from __future__ import annotations

import argparse
from pathlib import Path

from sim import report
from sim.fairness import FairnessSetup
from sim.fairness import experiment as fairness
from sim.fleet import FleetSetup, simulate
from sim.grouping import GroupingSetup
from sim.grouping import experiment as grouping
from sim.placement import PlacementSetup, experiment
from sim.quota import QuotaSetup
from sim.quota import simulate as quota
from sim.replay import load, replay
from sim.trace import BatchSpec


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ballast sim", description="The real policies in virtual time.")
    sub = parser.add_subparsers(dest="experiment", required=True)
    p = sub.add_parser("placement", help="prefix affinity against least-loaded and round-robin on one pool")
    p.add_argument("--engines", type=int, default=PlacementSetup.engines)
    p.add_argument("--seconds", type=float, default=PlacementSetup.seconds, help="virtual seconds of trace")
    p.add_argument("--seed", type=int, default=PlacementSetup.seed)
    f = sub.add_parser("fleet", help="every class over many regions, with a region lost halfway")
    f.add_argument("--regions", type=int, default=FleetSetup.regions)
    f.add_argument("--engines-per-region", type=int, default=FleetSetup.engines_per_region)
    f.add_argument("--minutes", type=float, default=FleetSetup.minutes, help="virtual minutes of trace")
    f.add_argument("--rate", type=float, default=FleetSetup.rate_per_min, help="requests a minute, fleet-wide")
    f.add_argument("--seed", type=int, default=FleetSetup.seed)
    f.add_argument("--no-loss", action="store_true", help="keep every region")
    q = sub.add_parser("quota", help="bounded-stale admission against synchronous admission across regions")
    q.add_argument("--regions", type=int, default=QuotaSetup.regions)
    q.add_argument("--minutes", type=int, default=QuotaSetup.minutes)
    q.add_argument("--reconcile-s", type=float, default=QuotaSetup.reconcile_s, help="the reconcile period")
    q.add_argument("--tier", choices=["priority", "default", "flex"], default=str(QuotaSetup.tier))
    q.add_argument("--seed", type=int, default=QuotaSetup.seed)
    fa = sub.add_parser("fairness", help="one heavy tenant and light ones in a tier: the VTC queue against FCFS")
    fa.add_argument("--engines", type=int, default=FairnessSetup.engines)
    fa.add_argument("--seconds", type=float, default=FairnessSetup.seconds)
    fa.add_argument("--light-tenants", type=int, default=FairnessSetup.light_tenants)
    fa.add_argument("--overload", type=float, default=FairnessSetup.overload,
                    help="the heavy tenant's rate over the pool's capacity")
    fa.add_argument("--seed", type=int, default=FairnessSetup.seed)
    g = sub.add_parser("grouping", help="a prefix-heavy batch's pages grouped on engines' own queues against the "
                                        "shared queue")
    g.add_argument("--engines", type=int, default=GroupingSetup.engines)
    g.add_argument("--items", type=int, default=BatchSpec.items)
    g.add_argument("--prefixes", type=int, default=BatchSpec.prefixes, help="distinct shared prompt prefixes")
    g.add_argument("--seed", type=int, default=BatchSpec.seed)
    r = sub.add_parser("replay", help="a recorded `ballast bench placement` run replayed: the sim against the real "
                                      "stack")
    r.add_argument("path", type=Path, help="the bench's --record file")
    args = parser.parse_args(argv)
    if args.experiment == "replay":
        if not args.path.is_file():
            parser.error(f"no recording at {args.path}: `ballast bench placement --record PATH` makes one")
        print(report.replay(replay(load(args.path))))
        return 0
    if args.experiment == "quota":
        if args.regions < 1 or args.minutes < 1 or args.reconcile_s <= 0:
            parser.error("--regions and --minutes must be at least 1, --reconcile-s positive")
        print(report.quota(quota(QuotaSetup(args.regions, args.minutes, reconcile_s=args.reconcile_s, tier=args.tier,
                                            seed=args.seed))))
        return 0
    if args.experiment == "fairness":
        if args.engines < 1 or args.seconds <= 0 or args.light_tenants < 1 or args.overload <= 0:
            parser.error("--engines and --light-tenants must be at least 1, --seconds and --overload positive")
        print(report.fairness(fairness(FairnessSetup(args.engines, args.seconds, args.seed, args.light_tenants,
                                                     overload=args.overload))))
        return 0
    if args.experiment == "grouping":
        if args.engines < 1 or args.items < 1 or args.prefixes < 1:
            parser.error("--engines, --items and --prefixes must be at least 1")
        batch = BatchSpec(items=args.items, prefixes=args.prefixes, seed=args.seed)
        print(report.grouping(grouping(GroupingSetup(args.engines, batch))))
        return 0
    if args.experiment == "placement":
        if args.engines < 1 or args.seconds <= 0:
            parser.error("--engines must be at least 1 and --seconds positive")
        print(report.placement(experiment(PlacementSetup(args.engines, args.seconds, args.seed))))
    else:
        if args.regions < 1 or args.engines_per_region < 1 or args.minutes <= 0 or args.rate <= 0:
            parser.error("--regions and --engines-per-region must be at least 1, --minutes and --rate positive")
        setup = FleetSetup(args.regions, args.engines_per_region, min(FleetSetup.pool_size, args.engines_per_region),
                           args.minutes, args.rate, args.seed, lose_at=None if args.no_loss else FleetSetup.lose_at)
        print(report.fleet(simulate(setup)))
    return 0
