"""`ballast bench cost`'s projection, against figures worked by hand."""

from __future__ import annotations

from bench.cost import project


def unit(actions: float, rows: float, cpu_s: float, **extra: float) -> dict:
    return dict(actions_per_unit=actions, rows_per_unit=rows, control_cpu_s_per_unit=cpu_s, **extra)


def test_the_projection_scales_windows_not_requests():
    scale = dict(requests_per_min=60 * 30 * 80, regions=30, api_processes_per_region=4, batch_items_per_request=0.5,
                 fine_tune_steps_per_s=30, usd_per_million_actions=25.0, window_s=1.0)
    measured = dict(requests=unit(0.5, 5.0, 0.002, requests_per_window=4), batch=unit(0.1, 3.0, 0.01),
                    fine_tune=unit(3.0, 10.0, 0.5))
    p = project(measured, scale)
    region = p["per_region"]
    # 80 requests/s a region, 20 a second to each of its 4 API processes: windows of 20.
    assert (region["requests_per_s"], region["requests_per_window"]) == (80.0, 20.0)
    # 2 actions a window (0.5 × 4 measured) over 20 requests.
    assert region["actions_per_request"] == 0.1
    # 80 × 0.1 + 40 items × 0.1 + 1 step × 3.
    assert region["actions_per_s"] == 15.0
    assert region["postgres_rows_per_s"] == 80 * 5 + 40 * 3 + 10
    assert region["control_cpu_cores"] == round(80 * 0.002 + 40 * 0.01 + 0.5, 1)
    assert p["actions_per_day"] == 15 * 30 * 86_400
    assert p["usd_per_day"] == round(15 * 30 * 86_400 / 1e6 * 25)
    assert p["usd_per_day_one_workflow_per_request"] == round(2 * 80 * 30 * 86_400 / 1e6 * 25)
