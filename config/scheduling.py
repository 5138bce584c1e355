"""What runs next on an engine and what yields: tenant fair shares, preemption, the
fleet's surges."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.section import Section


class SchedulingSettings(Section):
    # Interactive requests' turn on an engine within a tier: "vtc", the tenant served least
    # (a Virtual Token Counter: input + 2 × output tokens over the tenant's weight) when a
    # sequence slot frees; "fcfs": by arrival (engine/fair_share.py).
    fair_share: Literal["vtc", "fcfs"] = "vtc"

    # While more than one tenant is about, no tenant holds the last fair_headroom share
    # of an engine's interactive slots (at least one), so another tenant's request never
    # queues behind it; flex gets flex_min_share of them back once a flex request has
    # waited flex_starve_after_s (continuous chat slows flex, never stops it). Keep that
    # below wait_bound_flex_s, or flex is refused for the wait before its floor comes back.
    fair_headroom: float = Field(0.05, ge=0, lt=1)
    flex_min_share: float = Field(0.05, ge=0, le=1)
    flex_starve_after_s: float = Field(5.0, ge=0)

    # While more than one tenant is about, at most fair_long_prefills prompts longer than
    # fair_long_prompt tokens are prefilling on an engine at once (the rest wait their
    # turn there), so one tenant's giant prompts cannot fill every step with prefill work
    # and stall another tenant's first token; 0 disables. Alone, a tenant's go at once.
    fair_long_prompt: int = Field(1024, ge=0)
    fair_long_prefills: int = Field(1, ge=1)

    # Interactive requests queue at an engine behind the higher tiers. One whose expected
    # wait for a slot there (the requests ahead of it, over the rate slots free less the
    # rate higher tiers arrive at) passes its tier's bound is refused at once with 429 resource_unavailable
    # and a Retry-After, once the pool's other engines refused it too, rather than queued
    # past any use; one that queued anyway is refused once it has waited its bound. Under
    # overload flex is shed first, then default, then priority. Never a request inside its
    # tenant's reservation. 0: no bound (it queues however long).
    wait_bound_priority_s: float = Field(30.0, ge=0)
    wait_bound_default_s: float = Field(15.0, ge=0)
    wait_bound_flex_s: float = Field(10.0, ge=0)

    # Preemption: batch sequences allowed on an engine while interactive work is in
    # flight, and how long demand must stay low before batch gets its slots back.
    # "fixed": always batch_cool_down_s. "priced": that wait is learned per engine from its
    # last calm spells between chats and what its resumptions cost (policy.preemption.
    # resume_after): at once in the long gaps between bursts, not in a surge's short ones;
    # batch_cool_down_s until it has seen a few spells. It doubles what batch harvests of
    # the gaps and doubles chat's median TTFT under bursts (chats arrive while batch holds
    # the engine more often): bench/RESULTS.md.
    batch_busy_cap: int = 0
    batch_cool_down_s: float = 2.0
    batch_resume: Literal["fixed", "priced"] = "fixed"

    # false: no preemption at all, batch keeps the slots it holds and interactive work goes
    # ahead only by vLLM's priority scheduling. batch_max_share < 1: a static partition,
    # batch never holds more than that share of an engine's slots.
    batch_preemption: bool = True
    batch_max_share: float = Field(1.0, gt=0, le=1)

    # Sequences vLLM may run beyond max_num_seqs (its max_num_seqs is the sum), for
    # reserved tenants taking back slots lent to batch: the tenant's request starts at the
    # engine's next step beside the batch generation on that slot, which runs on to its end
    # (batch gets no new slot meanwhile) rather than being aborted and re-prefilled when
    # the slot may be lent again a moment later; and lent slots stay lent through a surge.
    # Set it to the most slots reserved on one engine. 0: a slot taken back is freed by
    # aborting its generation (every token journaled), and nothing is lent in a surge.
    spare_seqs: int = Field(0, ge=0)

    # Batch's floor: squeezed below batch_min_share of an engine's slots (by chat or a
    # surge) for longer than batch_starve_after_s, batch gets that share back, so
    # continuous chat slows batch down but never stops it. 0 disables the floor.
    batch_min_share: float = Field(0.05, ge=0, le=1)
    batch_starve_after_s: float = Field(30.0, ge=0)

    # The fleet controller (workflows/fleet.py): a pool surges when an engine's pressure
    # (interactive + queued against its slots, or KV-cache use under chat) reaches
    # surge_high, and calms after staying under surge_low for surge_cool_down_s; while it
    # surges every engine of the pool keeps batch to surge_batch_share of its slots.
    surge_high: float = Field(0.8, gt=0, le=1)
    surge_low: float = Field(0.5, ge=0, le=1)
    surge_cool_down_s: float = Field(10.0, ge=0)
    surge_batch_share: float = Field(0.0, ge=0, le=1)
    fleet_tick_s: float = Field(1.0, gt=0)
    announce_s: float = Field(1.0, gt=0)  # how often engine workers report
    heartbeat_timeout_s: float = 10.0

    @model_validator(mode="after")
    def _surge_band(self) -> SchedulingSettings:
        if self.surge_low > self.surge_high:
            raise ValueError(f"BALLAST_SURGE_LOW ({self.surge_low}) must not exceed BALLAST_SURGE_HIGH "
                             f"({self.surge_high}): a pool would leave a surge before it could enter one")
        if 0 < self.wait_bound_flex_s <= self.flex_starve_after_s and self.flex_min_share > 0:
            raise ValueError(f"BALLAST_FLEX_STARVE_AFTER_S ({self.flex_starve_after_s}) must be under "
                             f"BALLAST_WAIT_BOUND_FLEX_S ({self.wait_bound_flex_s}): flex would be refused for the "
                             "wait before its floor came back, and continuous chat would shut it out")
        return self
