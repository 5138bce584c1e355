"""The engine worker's own gauges, read from its slots and fair share when Prometheus
scrapes (nothing is kept twice), beside vLLM's series (its Prometheus stat logger, in the
same registry) and the batch and training counters of telemetry/families.py."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from engine.fair_share import FairShare
from engine.slots import EngineSlots
from telemetry import families


class EngineCollector(Collector):
    def __init__(self, slots: EngineSlots, fair: FairShare, model: str, region: str = ""):
        self.slots, self.fair, self.model, self.region = slots, fair, model, region

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap, share = self.slots.snapshot(), self.fair.snapshot()
        info = GaugeMetricFamily("ballast_engine_info", "1, labelled with the engine worker's model (its pool) and "
                                 "region: join on it to see any engine series by region.", labels=["model", "region"])
        info.add_metric([self.model, self.region], 1)
        yield info
        used = GaugeMetricFamily("ballast_engine_slots", "Sequence slots held, by kind of work (the engine's "
                                 "max_num_seqs is ballast_engine_max_seqs).", labels=["model", "kind"])
        for kind in ("interactive", "batch"):
            used.add_metric([self.model, kind], snap[kind])
        yield used
        yield _gauge("ballast_engine_max_seqs", "The engine's sequence slots (vLLM's max_num_seqs).", self.model,
                     self.slots.max_seqs)
        yield _gauge("ballast_engine_batch_waiting", "Batch generations waiting for a slot here.", self.model,
                     snap["batch_queued"])
        cap = snap["batch_cap"] if snap["batch_cap"] is not None else self.slots.max_seqs
        yield _gauge("ballast_engine_batch_cap", "The slots batch may hold now (lowered while interactive "
                     "traffic surges).", self.model, cap)
        yield _gauge("ballast_engine_batch_resume_after_seconds", "The calm batch waits for, once interactive work "
                     "ends, before it takes its slots back (priced from this engine's recent calm spells).", self.model,
                     self.slots.wait_s)
        idle = self.slots.max_seqs - snap["interactive"]
        if idle > 0:  # every slot held by interactive work: nothing idle to harvest
            yield _gauge("ballast_engine_harvest_ratio", "The share of the slots interactive work leaves idle that "
                         "batch generations hold now (1: batch harvests all of them).", self.model,
                         min(1.0, snap["batch"] / idle))
        pre = CounterMetricFamily("ballast_engine_preemptions", "Batch generations this engine preempted for "
                                  "interactive work (each resumes from its journaled tokens).", labels=["model"])
        pre.add_metric([self.model], snap["preemptions"])
        yield pre
        served = CounterMetricFamily("ballast_engine_served_weighted_tokens", "Interactive tokens given to each "
                                     "tenant here, divided by its weight (what fair share evens out).",
                                     labels=["model", "tenant"])
        folded: dict[str, float] = {}
        for tenant, n in share["served"].items():
            label = families.tenant(tenant)
            folded[label] = folded.get(label, 0.0) + n
        for label, n in sorted(folded.items()):
            served.add_metric([self.model, label], n)
        yield served
        by_tier = GaugeMetricFamily("ballast_engine_interactive_running", "Interactive requests holding slots here, "
                                    "by service tier (priority, default, flex).", labels=["model", "tier"])
        for tier, n in share["running_in"].items():
            by_tier.add_metric([self.model, tier], n)
        yield by_tier
        waiting = GaugeMetricFamily("ballast_engine_interactive_waiting", "Interactive requests waiting for their "
                                    "fair-share turn here.", labels=["model"])
        waiting.add_metric([self.model], sum(share["waiting"].values()))
        yield waiting
        shed = CounterMetricFamily("ballast_engine_shed", "Interactive requests refused here for the wait "
                                   "(BALLAST_WAIT_BOUND_*): at arrival, their expected wait for a slot past their "
                                   "tier's bound; or at the bound, having waited it without a slot.",
                                   labels=["model", "tier", "when"])
        for when, counts in (("arrival", share["shed_by"]), ("bound", share["expired_by"])):
            for tier, n in counts.items():
                shed.add_metric([self.model, tier, when], n)
        yield shed
        if share["hold_s"] is not None:
            yield _gauge("ballast_engine_slot_hold_seconds", "The mean time the last interactive requests held their "
                         "slot here: what their expected wait is reckoned in.", self.model, share["hold_s"])


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model"])
    g.add_metric([model], value)
    return g


def register(slots: EngineSlots, fair: FairShare, model: str, region: str = "") -> EngineCollector:
    collector = EngineCollector(slots, fair, model, region)
    REGISTRY.register(collector)
    return collector
