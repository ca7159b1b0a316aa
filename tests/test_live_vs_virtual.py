"""Live matches virtual: the dilated live node and the simulator agree on goodput, ITL P95 and each model's TTFT P95
within ±15 %.

Starts the real node (scheduler, router, one worker process per instance, sim engines dilated 10x) on 127.0.0.1,
replays a seed-000 trace through the load harness, and simulates the same trace. About three minutes. The pessimistic
profile's agreement is `tests/test_live_vs_virtual_pessimistic.py`: a file each, so `make test`'s processes run the
two side by side.
"""

import pytest

from octoserve.services.lab.agreement import TOLERANCE, cap_outputs, compare
from octoserve.services.workload import PROFILES, generate_trace, scaled

# compare() starts the node without a run directory: its temp directory goes under tmp_path.
pytestmark = [pytest.mark.slow, pytest.mark.agreement, pytest.mark.usefixtures("temp_dirs_in_tmp_path")]


def test_live_node_and_simulator_agree_within_tolerance():
    profile = scaled(PROFILES["seed-000"], rate_rps=30.0, duration_s=20.0)
    trace = cap_outputs(generate_trace(profile, 0), 96)
    result = compare(None, trace, 10.0, duration_s=20.0, slo=profile.slo)
    diffs = result.relative_differences()
    # Both sides measure the same window: the arrivals after the simulator's warm-up.
    in_window = sum(1 for r in trace if r.arrival_s >= result.virtual.window.start_s)
    assert result.live.window.start_s == result.virtual.window.start_s
    assert result.live.overall.num_offered == result.virtual.overall.num_offered == in_window
    assert result.live.overall.num_errors == 0, result.table()
    # Goodput and ITL pooled; TTFT per model over the requests both sides served (each model's P95 against its own:
    # the pooled P95 over a 70B and an 8B whose first tokens differ several times over moves with each admitted 70B
    # request, and a model's own P95 over a few dozen requests with each long prompt one side refused and the other
    # served; goodput carries that difference).
    per_model = result.both_served_ttft_differences()
    assert sorted(per_model) == ["llama-3-70b", "llama-3-8b"]
    checked = [diffs["goodput"], diffs["itl_p95"], *per_model.values()]
    assert all(abs(d) <= TOLERANCE for d in checked), result.table()
