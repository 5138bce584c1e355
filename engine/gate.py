"""A failpoint for tests and drills: batch generations held at a token budget.

Off by default (`BALLAST_ENGINE_GATE` unset: the engine worker never builds this, so it
costs nothing). Set to the path of a small JSON control file, the engine worker wraps its
`Engine` in a `GatedEngine`, and every batch generation (priority == the batch tier)
passes steps through only while its item's total tokens — those it had when this attempt
began (`resumed_from`, its journaled offset) plus those produced since — stay within the
item's budget. Beyond it the generation waits, vLLM's steps buffered, until the budget
grows or the request is aborted. A test that needs work in flight at a moment makes it so
with the gate ("every item holds exactly 137 tokens now"), instead of guessing how fast
the engine runs. In the spirit of etcd's gofail.

The control file, replaced atomically (write a temporary file, then `os.replace`):

    {"budget": {"default": 300, "item:<batch>:<idx>": 340}}   per item (its choice c > 0: "…#c"), else "default"
    {"budget": 300}                                            every batch item
    {"budget": null}   or no file at all                       unlimited: nothing held

One poller per engine reads it when it changes (a stat every `poll_s`), never per token.

An abort of a held request ends its iteration at once with a final
`Step([], "abort")`, exactly as vLLM ends an aborted request, and nothing beyond the
budget is ever yielded; so a preempted item journals exactly its budget. Interactive
requests are never gated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.sampling import Sampling
from engine.vllm_engine import Step
from protocol.tiers import RANK, Tier

log = logging.getLogger(__name__)

BATCH_PRIORITY = RANK[Tier.BATCH]
_REMEMBERED_ABORTS = 4096  # aborts of requests not yet started (see `abort`)


@dataclass
class _Gated:
    """One batch request passing through the gate."""

    item: str  # whose budget applies: the batch item's stream, "item:<batch>:<idx>" ("…#<c>": its choice c > 0)
    tokens: int  # the item's total: what it had when this request began + what was yielded since
    held: bool = False  # waiting at its budget now
    aborted: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class GatedEngine:
    """The engine, with batch generations held at the control file's budgets.

    Everything but `generate`, `abort` and `shutdown` is the wrapped engine's."""

    def __init__(self, engine: Any, control: str | os.PathLike[str], *, poll_s: float = 0.015):
        self._engine = engine
        self.control = Path(control)
        self.poll_s = poll_s
        self._budget: dict[str, int | None] | None = None  # None: unlimited
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime_ns, size) last read
        self._requests: dict[str, _Gated] = {}
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._poller: asyncio.Task | None = None
        self._read()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    # -- the engine's interface ----------------------------------------------------------

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: Sampling, *, priority: int = 0,
                 item: str | None = None, resumed_from: int = 0, **kw: Any) -> AsyncIterator[Step]:
        kw.update(priority=priority, item=item, resumed_from=resumed_from)
        if priority != BATCH_PRIORITY:
            return self._engine.generate(request_id, prompt_token_ids, sampling, **kw)  # interactive: untouched
        return self._gated(request_id, prompt_token_ids, sampling, item or request_id, resumed_from, kw)

    async def abort(self, request_id: str) -> None:
        g = self._requests.get(request_id)
        if g is not None:
            g.aborted = True
            g.wake.set()
        else:
            # Aborted before its generation began (an interactive request arrived between
            # the batch slot and the first step). vLLM would run it anyway and the
            # activity aborts it again after its first step; but a request held from its
            # start yields no step, so the gate remembers and ends it at once.
            self._aborted[request_id] = None
            while len(self._aborted) > _REMEMBERED_ABORTS:
                self._aborted.popitem(last=False)
        await self._engine.abort(request_id)

    def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        self._engine.shutdown()

    # -- what it holds ---------------------------------------------------------------------

    def budget(self, item: str) -> int | None:
        """The item's budget now (None: unlimited)."""
        if self._budget is None:
            return None
        return self._budget.get(item, self._budget.get("default"))

    def gate_stats(self) -> dict[str, Any]:
        """The control file's budgets and every batch request at the gate, for /stats."""
        return dict(budget=self._budget,
                    requests=[dict(item=g.item, tokens=g.tokens, held=g.held) for g in self._requests.values()])

    async def _gated(self, request_id: str, prompt: list[int], sampling: Sampling, item: str, resumed_from: int,
                     kw: dict[str, Any]) -> AsyncIterator[Step]:
        self._start_polling()
        self._refresh()  # a file written just before this request applies to it
        g = _Gated(item, resumed_from, aborted=request_id in self._aborted)
        self._aborted.pop(request_id, None)
        self._requests[request_id] = g
        # Pulled lazily: while held, vLLM keeps generating and merges its deltas until we
        # ask again (or the request is aborted, which vLLM ends with an empty "abort" step).
        inner = self._engine.generate(request_id, prompt, sampling, **kw)
        pending: deque[Step] = deque()  # pulled from vLLM, not yet passed on
        try:
            while True:
                g.wake.clear()
                budget = self.budget(item)
                room = None if budget is None else budget - g.tokens
                if pending and (room is None or room > 0):
                    step = pending.popleft()
                    if room is not None and len(step.token_ids) > room:  # pass what fits, keep the rest
                        lp = step.logprobs
                        pending.appendleft(replace(step, token_ids=step.token_ids[room:],
                                                   logprobs=lp[room:] if lp is not None else None))
                        step = replace(step, token_ids=step.token_ids[:room], finish_reason=None, text="",
                                       logprobs=lp[:room] if lp is not None else None)
                    g.tokens += len(step.token_ids)
                    yield step
                    if step.finish_reason is not None:
                        return
                elif room is not None and room <= 0:
                    if g.aborted:
                        yield Step([], "abort")
                        return
                    g.held = True
                    try:
                        await g.wake.wait()
                    finally:
                        g.held = False
                else:
                    try:
                        pending.append(await anext(inner))
                    except StopAsyncIteration:
                        return
        finally:
            self._requests.pop(request_id, None)
            await inner.aclose()  # vLLM aborts a request whose iteration is closed early

    # -- the control file --------------------------------------------------------------------

    def _start_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="engine-gate")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            self._refresh()

    def _refresh(self) -> None:
        if self._read():
            for g in self._requests.values():
                g.wake.set()

    def _read(self) -> bool:
        """Re-read the control file if it changed; whether the budgets changed."""
        try:
            st = self.control.stat()
        except FileNotFoundError:
            seen, budget = None, None
        else:
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
            if seen == self._seen:
                return False
            try:
                budget = _parse(json.loads(self.control.read_text()))
            except (OSError, ValueError) as err:  # half-written by a careless writer: keep the last
                log.warning("engine gate %s unreadable, keeping the last budgets: %s", self.control, err)
                return False
        self._seen = seen
        if budget == self._budget:
            return False
        self._budget = budget
        log.info("engine gate: budgets now %s", budget)
        return True


def _parse(doc: Any) -> dict[str, int | None] | None:
    if not isinstance(doc, dict):
        raise ValueError("the control file is a JSON object with a 'budget'")
    budget = doc.get("budget")
    if budget is None:
        return None
    if isinstance(budget, int) and not isinstance(budget, bool):
        return {"default": budget}
    if isinstance(budget, dict) and all(v is None or (isinstance(v, int) and not isinstance(v, bool))
                                        for v in budget.values()):
        return {str(k): v for k, v in budget.items()}
    raise ValueError(f"a budget is null, a token count or an object of token counts, not {budget!r}")
