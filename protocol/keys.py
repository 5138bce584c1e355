"""Every name Ballast writes down for something: journal streams (which are also ledger
subjects and Temporal workflow ids), object store keys, fine-tuned model names. Audits,
workflows and SQL join on these, so each is built here and nowhere else.

`file:<id>`, `batch:<id>`, `item:<batch>:<index>`, `request:<id>`, `served:<engine>:<token>`
(an engine worker's records of what it served), `finished:<tenant>:<token>` (a window's
outcomes),
`requests:<API process>:<n>` (the workflow that journals a window of requests), `ftjob:<id>`,
`ftjob:<id>:<step>` (the ledger's subject of a checkpoint's trained tokens),
`tenant:<id>` (what was done to the tenant as a whole: its erasures), and `webhook:<event id>` (a
webhook event and its deliveries; `webhooks:<job stream>` is the workflow that delivers it);
`files/<id>`, `fine-tuning/<job>/checkpoints/step-<n>.pt`, `fine-tuning/<job>/adapter`;
`ft:<base>:<suffix>:<job>`.
"""

from __future__ import annotations


def batch(batch_id: str) -> str:
    return f"batch:{batch_id}"


def item(batch_id: str, idx: int) -> str:
    return f"item:{batch_id}:{idx}"


def request(request_id: str) -> str:
    return f"request:{request_id}"


def request_window(holder: str, n: int) -> str:
    """The workflow journaling an API process's `n`th window of requests (api/services/settlement.py)."""
    return f"requests:{holder}:{n}"


def served_records(engine_id: str, token: str) -> str:
    """A tick's records of what an engine worker served, of one tenant (journal/served.py)."""
    return f"served:{engine_id}:{token}"


def finished_records(tenant: str, token: str) -> str:
    """A window's outcomes of one tenant's requests (activities/interactive.py)."""
    return f"finished:{tenant}:{token}"


def tenant(tenant_id: str) -> str:
    return f"tenant:{tenant_id}"


def ftjob(job_id: str) -> str:
    return f"ftjob:{job_id}"


def ftjob_step(job_id: str, step: int) -> str:
    """The quota ledger's subject of the tokens trained up to checkpoint `step`."""
    return f"ftjob:{job_id}:{step}"


def file(file_id: str) -> str:
    """The object store key of a file's bytes."""
    return f"files/{file_id}"


def file_stream(file_id: str) -> str:
    """The journal stream of a file's record."""
    return f"file:{file_id}"


def checkpoint(job_id: str, step: int) -> str:
    return f"fine-tuning/{job_id}/checkpoints/step-{step:08d}.pt"


def adapter(job_id: str) -> str:
    """The prefix under which a job's trained adapter's files lie."""
    return f"fine-tuning/{job_id}/adapter"


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # PEFT's, under `adapter`


def fine_tuned(base: str, suffix: str | None, job_id: str) -> str:
    """`ft:<base>:<suffix>:<job>`: OpenAI's shape without the organization."""
    return f"ft:{base}:{suffix or ''}:{job_id}"


def fine_tuned_prefix(base: str) -> str:
    """What every model fine-tuned from `base` is named beginning with."""
    return f"ft:{base}:"


def is_fine_tuned(name: str) -> bool:
    return name.startswith("ft:")


def webhook(event_id: str) -> str:
    """The journal stream of a webhook event and its deliveries (`evt_…`)."""
    return f"webhook:{event_id}"


def webhook_delivery(job_stream: str) -> str:
    """The workflow id of the delivery of a job's terminal event: one per job, as a job ends once."""
    return f"webhooks:{job_stream}"
