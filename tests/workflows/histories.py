"""Recorded workflow histories: the replay gate's material (tests/workflows/test_replay.py).

`BALLAST_RECORD_HISTORIES=<dir> make test` writes, when the test session's Temporal server
stops, histories of every workflow type the suite ran: per type and close status, the
largest few under a size cap (the most varied). Copy them into
tests/workflows/histories/ and commit them: every later change to a workflow then has to
replay what today's code recorded, or fail CI before it fails running jobs.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

from temporalio.client import Client, WorkflowHistory

DIR = Path(__file__).with_name("histories")
MAX_BYTES = 60_000  # compressed
PER_KIND = 2


async def record(address: str, out: Path) -> list[Path]:
    client = await Client.connect(address)
    kinds: dict[tuple[str, str], list[tuple[int, str, bytes]]] = defaultdict(list)
    async for wf in client.list_workflows():
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        text = json.dumps(dict(workflow_id=wf.id, workflow_type=wf.workflow_type,
                               history=json.loads(history.to_json()))).encode()
        packed = gzip.compress(text)
        if len(packed) <= MAX_BYTES:
            status = wf.status.name if wf.status is not None else "UNKNOWN"
            kinds[(wf.workflow_type, status)].append((len(text), wf.id, packed))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for (kind, status), found in sorted(kinds.items()):
        for n, (_, _, packed) in enumerate(sorted(found, reverse=True)[:PER_KIND]):
            path = out / f"{kind}-{status.lower()}-{n}.json.gz"
            path.write_bytes(packed)
            written.append(path)
    return written


def load(path: Path) -> WorkflowHistory:
    got = json.loads(gzip.decompress(path.read_bytes()))
    return WorkflowHistory.from_json(got["workflow_id"], got["history"])
