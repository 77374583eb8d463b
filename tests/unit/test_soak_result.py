"""The soak's verdict (``spyre_support.soak.SoakResult``): each failed
check is named with its figures, a passing run has none."""
from __future__ import annotations

import pytest

from spyre_support.soak import SoakResult

IDLE = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
        "vllm:gpu_cache_usage_perc": 0.0}


def result(**changes) -> SoakResult:
    fields = dict(requests=80, completed=55, dropped=25, errors=0,
                  mismatched=0, rss_baseline_mib=1000.0, rss_end_mib=1040.0,
                  rss_ratio=1.04, end_metrics=dict(IDLE), wall_s=1.0,
                  processes_baseline=2, processes_end=2)
    fields.update(changes)
    return SoakResult(**fields)


def test_a_clean_run_has_no_problem():
    assert result().problems == [] and result().ok


@pytest.mark.parametrize("changes, named", [
    (dict(errors=2, error_samples=["request 3: HTTP 500"]),
     "2 request(s) failed: request 3: HTTP 500"),
    (dict(mismatched=1), "1 answer(s) differ"),
    (dict(end_metrics={**IDLE, "vllm:num_requests_running": 1.0}),
     "not idle at the end: {'vllm:num_requests_running': 1.0}"),
    (dict(rss_end_mib=1060.0, rss_ratio=1.06),
     "resident memory 1000 -> 1060 MiB (x1.060, within 0.05 allowed)"),
    (dict(processes_end=3), "processes 2 -> 3"),
])
def test_each_failed_check_is_named(changes, named):
    got = result(**changes)
    assert not got.ok
    [problem] = got.problems
    assert problem.startswith(named), problem
