"""The benchmarks' pictures draw from the data their runs keep (a PNG of the expected size
per arm), whatever the run measured: no data at all in a panel is drawn, not an error."""

from __future__ import annotations

import struct

from bench import pictures
from bench.fairness import cumulative


def _size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_surge_fairness_and_training_pictures(tmp_path):
    surge = dict(seconds=30.0, chats=[(1.0, 0.02), (12.5, 0.4)], tokens=[(0, 900), (1, 850), (12, 100)],
                 surges=[(12.0, 15.5)], load_surge=[10.0, 20.0])
    pictures.draw_surge(tmp_path / "s.png", dict(alone=dict(surge, tokens=[], surges=[]), ballast=surge),
                        "surge")
    assert _size(tmp_path / "s.png")[0] > _size(tmp_path / "s.png")[1]  # a column per arm, side by side

    series = cumulative([(10.1, 5.0), (10.3, 7.0), (19.9, 1.0), (25.0, 100.0)], start=10.0, end=20.0, step=0.5)
    assert series[0] == (0.0, 12.0) and series[-1] == (10.0, 13.0)  # what came after the end is not counted
    pictures.draw_fairness(tmp_path / "f.png", dict(fcfs=dict(tenants=dict(short=series, long=[])),
                                                    vtc=dict(tenants=dict(short=series, long=series))), "fairness")
    assert _size(tmp_path / "f.png")[0] > 0

    job = [dict(step=3, losses=[2.0, 1.5, 1.2], ended_by="preempted"), dict(step=5, losses=[1.0, 0.9],
                                                                             ended_by="done")]
    pictures.draw_training(tmp_path / "t.png", {"a job": job, "empty": []}, "training")
    assert _size(tmp_path / "t.png")[0] > 0
