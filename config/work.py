"""Batches and fine-tuning jobs: how they are cut into work."""

from __future__ import annotations

from pydantic import Field, field_validator

from config.section import Section
from policy.promises import parse_window


class WorkSettings(Section):
    # Batches.
    batch_concurrency: int = 256
    batch_items_per_run: int = 1000  # a batch workflow continues as new after this many items
    batch_group_size: int = 16  # items per generation activity

    # The completion windows a batch may ask for (OpenAI offers `24h`): `<n>s|m|h|d`, at most
    # 24h. A batch is accepted only when its window can be met: behind the work promised on
    # its model's pool, at batch_promise_share of the pace the pool's engine workers
    # measured (policy/promises.py); otherwise it is refused with the shortest window that
    # could be. A pool that has measured no pace yet promises its longest window only, as
    # best effort. Shorter windows run ahead of the longest (Temporal priority).
    batch_windows: list[str] = ["1h", "24h"]
    batch_promise_share: float = Field(0.8, gt=0, le=1)

    # A fenced tenant's batch moves to the next region of its fence when a group waits
    # this long with no engine worker claiming it.
    batch_spill_after_s: float = Field(30.0, gt=0)

    # A batch's runs of items sharing a prefix go to one engine worker's own queue
    # (policy/grouping.py); a group it leaves unclaimed this long (dead, hung, draining)
    # goes to the shared queue. 0: no such groups, every group to the shared queue.
    batch_sticky_wait_s: float = Field(10.0, ge=0)

    # An item whose prompt shares most of its full KV blocks with one an engine is
    # prefilling now, more than vLLM prefills of one request in a step, waits before it
    # takes a batch slot for that prompt's first token (so it finds the shared blocks in
    # vLLM's cache), at most this long (engine/prefix_leaders.py). 0: items go at once,
    # and a prefix is prefilled by every line that arrives beside another.
    batch_prefix_wait_s: float = Field(10.0, ge=0)

    # A fine-tuning job trains at least this many optimizer steps per chunk: one checkpoint
    # each. A chunk runs longer while what it costs beyond its steps (dispatch, resume, the
    # checkpoint) is more than fine_tune_checkpoint_overhead of their time (CheckFreq's
    # rule: on a small model's millisecond steps, 10 steps would be mostly overhead), but
    # not past fine_tune_chunk_max_s, which bounds what a crash loses. Preemption, pause and
    # cancel end a chunk at any step, with a checkpoint.
    fine_tune_chunk_steps: int = Field(10, ge=1)
    fine_tune_checkpoint_overhead: float = Field(0.03, ge=0)
    fine_tune_chunk_max_s: float = Field(300.0, gt=0)

    @field_validator("batch_windows")
    @classmethod
    def _windows(cls, v: list[str]) -> list[str]:
        for w in v:
            seconds = parse_window(w)
            if seconds is None or seconds > 86_400:
                raise ValueError(f"{w!r} is not a completion window: write <n>s, <n>m, <n>h or <n>d, at most 24h")
        if not v:
            raise ValueError("at least one completion window, e.g. [\"24h\"]")
        return v

    @property
    def windows(self) -> dict[str, int]:
        """Each completion window offered, in seconds."""
        return {w: int(parse_window(w) or 0) for w in self.batch_windows}
