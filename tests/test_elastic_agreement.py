"""A live model change against the step-level elastic simulator (services/lab/elastic_agreement.py, --model-change).

The shortened mix-shift day (one hour = 0.5 simulated seconds, 12 s, outputs capped at 32 tokens) on the sim-engine
node dilated 8x, with no balancer: at hour 8 `Scheduler.Reconfigure` moves two 8B GPUs (sm-2, sm-3) to the 70B as
one TP-2 instance, at hour 20 that instance goes back to two 8B; the step-level elastic simulator carries out the
same two reconfigurations at the same simulated times. About two minutes.
"""

import pytest

from octoserve.services.lab import elastic_agreement as ea
from octoserve.services.config import default_config_text, node_config_from_text
from octoserve.services.workload_day import LARGE, SMALL

pytestmark = pytest.mark.slow


def test_the_scripted_plan_is_the_schedulers_reconfiguration_with_its_weight_load_time():
    node = node_config_from_text(default_config_text())
    plan = ea.sim_plan(node, ea.change_script(6.0, 21.0), hour_s=0.5)
    (t1, join), (t2, back) = plan
    assert (t1, t2) == (3.0, 10.5)
    assert join.retire == ("sm-2", "sm-3")
    assert [(i.model, i.tp, i.gpu_ids) for i in join.start] == [(LARGE, 2, (6, 7))]
    assert back.retire == (join.start[0].id,)
    assert [(i.model, i.tp, i.gpu_ids) for i in back.start] == [(SMALL, 1, (6,)), (SMALL, 1, (7,))]
    # The weights over one PCIe link per GPU: the 70B's TP-2 shard, then one 8B.
    pcie = node.gpu.pcie_bytes_per_s
    assert join.load_s == pytest.approx(node.models[LARGE].weight_bytes_per_gpu(2) / pcie)
    assert back.load_s == pytest.approx(node.models[SMALL].weight_bytes_per_gpu(1) / pcie)


def test_a_move_back_before_the_move_is_refused_with_what_to_change():
    with pytest.raises(SystemExit):
        ea.parse_args(["--model-change", "--change-at-h", "10", "--back-at-h", "5"])
    with pytest.raises(ValueError, match="--back-at-h 5 must be after --change-at-h 10"):
        ea.change_script(10.0, 5.0)
    with pytest.raises(ValueError, match=r"--change-at-h 30 must be an hour of the day, in \[0, 24\)"):
        ea.change_script(30.0, 0.0)
    assert [entry[0] for entry in ea.change_script(8.0, 0.0)] == [8.0]  # 0: no move back


@pytest.mark.agreement
@pytest.mark.usefixtures("temp_dirs_in_tmp_path")  # run_model_change starts the node without a run directory
def test_a_live_model_change_agrees_with_the_step_level_simulator_and_loses_nothing():
    args = ea.parse_args(["--model-change", "--rate", "8", "--hour-s", "0.5", "--time-scale", "8",
                          "--max-output", "32"])
    result = ea.run_model_change(args)
    table = result.table()
    assert result.live_lost == 0 and result.sim_lost == 0, table
    # Both changes carried out on both sides, at the scripted simulated times.
    assert [c.label for c in result.live_changes] == [c.label for c in result.sim_changes] == [
        f"sm-2+sm-3 -> {LARGE} TP 2", f"the moved GPUs -> {SMALL} TP 1"]
    assert [c.at_s for c in result.sim_changes] == [4.0, 10.0]
    # The instance's downtime: the simulator's switch is exactly the modelled weight load; the live one waits for it
    # (and for the new worker process to start) before the started instances serve.
    node = node_config_from_text(default_config_text())
    loads = [node.models[LARGE].weight_bytes_per_gpu(2) / node.gpu.pcie_bytes_per_s,
             node.models[SMALL].weight_bytes_per_gpu(1) / node.gpu.pcie_bytes_per_s]
    assert [c.switch_s for c in result.sim_changes] == pytest.approx(loads)
    assert all(lv.switch_s >= load for lv, load in zip(result.live_changes, loads)), table
    # Goodput overall and per model within the tolerance.
    diffs = result.goodput_diffs()
    assert set(diffs) == {"all", SMALL, LARGE}
    assert all(abs(d) <= ea.TOLERANCE for d in diffs.values()), table
