"""Live matches virtual under the pessimistic cost profile: the dilated live node and the simulator agree on
goodput, ITL P95, TTFT P95 and the refusals (the seed-000 profile at 5 req/s). The default profile's agreement is
`tests/test_live_vs_virtual.py`.
"""

import pytest

from octoserve.services.lab.agreement import TOLERANCE, cap_outputs, compare
from octoserve.services.workload import PROFILES, generate_trace, scaled

# compare() starts the node without a run directory: its temp directory goes under tmp_path.
pytestmark = [pytest.mark.slow, pytest.mark.agreement, pytest.mark.usefixtures("temp_dirs_in_tmp_path")]


def test_live_node_and_simulator_agree_under_the_pessimistic_profile():
    """The 70B's decode step (26 ms) leaves it one decode slot under the 30 ms ITL SLO: admission turns on the
    predicted wait for that slot, which the live router reads from the workers' load reports. K = 20, 5 req/s."""
    profile = scaled(PROFILES["seed-000"], rate_rps=5.0, duration_s=10.0)
    trace = cap_outputs(generate_trace(profile, 0), 96)
    result = compare(None, trace, 20.0, duration_s=10.0, slo=profile.slo, cost_profile="pessimistic")
    assert result.live.overall.num_offered == result.virtual.overall.num_offered
    assert result.live.overall.num_refused == result.virtual.overall.num_refused, result.table()
    assert result.live.overall.num_errors == 0, result.table()
    assert all(abs(d) <= TOLERANCE for d in result.relative_differences().values()), result.table()
