"""A fine-tuned model's name becomes a directory on the engine host and a key in the store:
only a plain job id may."""

from __future__ import annotations

import pytest

from engine.adapters import AdapterMissing, Adapters, job_of
from storage.objects import ObjectStore


def test_a_job_id_is_one_plain_segment():
    assert job_of("ft:ballast-tiny:colours:ftjob-0123456789abcdef01234567") == "ftjob-0123456789abcdef01234567"
    for name in ("ft:m::../../etc", "ft:m::/etc/passwd", "ft:m::a/b", "ft:m::", "ft:m::" + "x" * 65, "ft:m::.",
                 "ft:m::a\x00b"):
        with pytest.raises(AdapterMissing):
            job_of(name)


async def test_a_name_reaching_outside_the_cache_loads_nothing(tmp_path):
    adapters = Adapters(ObjectStore(str(tmp_path / "objects")), tmp_path / "cache")
    for name in ("ft:m::../../../../tmp", "ft:m::/etc"):
        with pytest.raises(AdapterMissing):
            await adapters.request(name)
    assert not (tmp_path / "cache").exists()
