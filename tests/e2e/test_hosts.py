"""The multi-host run, CI-sized (bench/hosts.py; `make hosts` is the full one): Ballast as
seven hosts in network namespaces, started with the deployment's commands and environments.

Through both API hosts with the official client: chats, a fine-tune whose model then
answers through the other API host (its adapter crossing hosts through the S3 store), and a
batch during which one engine host's link is cut; the batch completes, each of its items
exactly once by the client's output file and by the journal's SQL, and `ballast verify`
passes on the journal."""

from __future__ import annotations

import json
import os

import pytest

from bench import hosts
from config import Settings

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_seven_hosts_lose_nothing_when_an_engine_host_is_cut_off(tmp_path, capsys):
    settings = Settings(data_dir=tmp_path, max_num_seqs=16)
    with hosts.fleet_up(tmp_path / "hosts", settings) as fleet:
        # Each process is handed its environment whole; none names loopback or another host's files.
        assert not hosts.crossings(fleet, fleet.placed)
        # Long enough that both engine hosts hold generations for seconds (16 x 96 once finished
        # in 4 s, before an engine host had announced any).
        report = hosts.run(fleet, items=32, chats=4, max_tokens=256)
    print(json.dumps(report, indent=2))
    assert report["chats"] == dict(sent=4, answered=4)
    assert report["fine_tune"]["status"] == "succeeded", report["fine_tune"]
    assert report["fine_tune"]["fine_tuned_model_answered"]
    batch = report["batch"]
    assert batch["cut_after_s"] is not None, "no engine host held a batch item to be cut off from"
    assert batch["status"] == "completed" and batch["output_lines"] == 32 and batch["custom_ids_once"]
    assert batch["journal_results"] == 32 and batch["journal_results_once"]
    assert report["verify"]["exit"] == 0, report["verify"]
    # Every host ran what it was for, and nothing else.
    assert {h: [line.split()[0] for line in lines] for h, lines in report["hosts"].items()} == dict(
        pg=["python"], temporal=["temporal", "haproxy"], s3=["python"], engine1=["python"], engine2=["python"],
        control=["python"], api1=["python"], api2=["python"])
    assert report["ok"]
    # The namespaces and links are gone with the fleet.
    assert fleet.net.tag not in os.popen("ip netns list").read()
