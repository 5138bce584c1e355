"""Fine-tuned models on an engine: `ft:<base>:<suffix>:<job id>` names a LoRA adapter the
job's training wrote to the object store (activities/finetune.py). An engine worker
copies it into a local cache once, on the first request that names it (no shared
filesystem: any worker serves any tenant's fine-tune), and hands vLLM a LoRARequest;
vLLM keeps up to `max_loras` adapters on the engine beside the one base model.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

from protocol import keys
from storage.objects import ObjectStore

FILES = keys.ADAPTER_FILES
JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what api/fine_tuning.py makes ("ftjob-" and hex), and no path


class AdapterMissing(LookupError):
    pass


def job_of(model: str) -> str:
    """The fine-tuning job id of a fine-tuned model's name: one plain path segment (it names
    this host's cache directory and the store's key), or AdapterMissing. The API and the
    control worker let through only a tenant's own models; this holds whatever reaches here."""
    job = model.rsplit(":", 1)[-1]
    if not JOB_ID.fullmatch(job):
        raise AdapterMissing(f"{model!r} names no fine-tuning job")
    return job


def lora_id(model: str) -> int:
    """vLLM's id for the adapter: a positive int, the same for the same model everywhere."""
    return zlib.crc32(model.encode()) % (2**31 - 1) + 1


class Adapters:
    def __init__(self, store: ObjectStore, cache_dir: Path):
        # The cache is this host's own (vLLM loads an adapter from a local directory); the
        # adapter itself lives in the store, which every host reaches.
        self.store, self.cache_dir = store, cache_dir
        self._locks: dict[str, asyncio.Lock] = {}

    async def request(self, model: str) -> Any:
        """The LoRARequest for `model`, its adapter fetched first if this worker has not yet."""
        from vllm.lora.request import LoRARequest

        job = job_of(model)
        path = self.cache_dir / job
        if not (path / FILES[-1]).exists():
            async with self._locks.setdefault(model, asyncio.Lock()):
                if not (path / FILES[-1]).exists():
                    await asyncio.to_thread(self._fetch, job, path)
        return LoRARequest(model, lora_id(model), str(path))

    def _fetch(self, job_id: str, path: Path) -> None:
        objects = [f"{keys.adapter(job_id)}/{name}" for name in FILES]
        if not all(self.store.exists(k) for k in objects):
            raise AdapterMissing(f"no trained adapter for fine-tuning job {job_id}")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{job_id}-", dir=self.cache_dir))
        try:
            for name, key in zip(FILES, objects, strict=True):
                with self.store.open(key) as src, open(tmp / name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            try:
                os.replace(tmp, path)  # whole or not at all: a reader never sees half an adapter
            except OSError:  # unless another worker sharing this cache placed it first
                if not (path / FILES[-1]).exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
