"""The reconfiguration vocabulary: what may be applied to a placement, and what the placement is afterwards."""

import dataclasses

import pytest

from octoserve.services.core.placement import InstanceConfig
from octoserve.services.core.reconfig import ReconfigKind, Reconfiguration, apply, check_reconfiguration
from octoserve.services.core.types import Role

LM = InstanceConfig(id="lm-0", model="llama-3-70b", role=Role.COLOCATED, tp=4, gpu_ids=(0, 1, 2, 3))
SMS = [InstanceConfig(id=f"sm-{i}", model="llama-3-8b", role=Role.COLOCATED, tp=1, gpu_ids=(4 + i,)) for i in range(4)]
NODE = {inst.id: inst for inst in [LM, *SMS]}


def test_role_change_keeps_gpus_and_model():
    r = Reconfiguration("r1", ReconfigKind.ROLE, ("sm-0",), (dataclasses.replace(SMS[0], role=Role.PREFILL),), "x")
    after = apply(NODE, r)
    assert after["sm-0"].role is Role.PREFILL
    assert after["sm-0"].gpu_ids == (4,)
    assert set(after) == set(NODE)


def test_model_change_moves_four_8b_gpus_into_a_second_70b_group():
    lm1 = InstanceConfig(id="lm-1", model="llama-3-70b", role=Role.COLOCATED, tp=4, gpu_ids=(4, 5, 6, 7))
    # It would leave no 8B: refused.
    r = Reconfiguration("r2", ReconfigKind.MODEL, tuple(s.id for s in SMS), (lm1,), "x", load_s=3.0)
    assert check_reconfiguration(NODE, r) == ["r2: would leave no instance of ['llama-3-8b']"]
    node = dict(NODE, **{"sm-4": InstanceConfig(id="sm-4", model="llama-3-8b", role=Role.COLOCATED, tp=1, gpu_ids=(8,))})
    after = apply(node, r)
    assert sorted(after) == ["lm-0", "lm-1", "sm-4"]
    assert r.gpu_ids == (4, 5, 6, 7)


def test_refuses_gpus_it_does_not_free_and_unknown_ids():
    grab = InstanceConfig(id="sm-9", model="llama-3-8b", role=Role.COLOCATED, tp=1, gpu_ids=(0,))
    r = Reconfiguration("r3", ReconfigKind.MODEL, ("sm-0",), (grab,), "x")
    assert check_reconfiguration(NODE, r) == ["r3: starts instances on GPUs [0] it does not free"]
    r = Reconfiguration("r4", ReconfigKind.ROLE, ("nope",), (), "x")
    assert check_reconfiguration(NODE, r) == ["r4: retires unknown instances ['nope']"]
    with pytest.raises(ValueError, match="retires unknown instances"):
        apply(NODE, r)


def test_role_change_must_be_one_instance_of_the_same_model():
    other = dataclasses.replace(SMS[0], model="llama-3-70b")
    r = Reconfiguration("r5", ReconfigKind.ROLE, ("sm-0",), (other,), "x")
    assert check_reconfiguration(NODE, r) == ["r5: a role change keeps the model; use a model change"]


def test_every_driver_moves_through_the_same_legal_phases():
    """One state machine for the scheduler, both simulators and a vLLM slot (`reconfig.advance`)."""
    from octoserve.services.core.reconfig import IN_FLIGHT, TRANSITIONS, Phase, advance

    drained = [Phase.PLANNED, Phase.DRAINING, Phase.SWITCHING, Phase.DONE, Phase.DRAINING, Phase.ABORTED,
               Phase.DRAINING]  # a slot's next reconfiguration starts where its last one ended
    in_place = [Phase.PLANNED, Phase.SWITCHING, Phase.ABORTED]
    for path in (drained, in_place):
        phase = path[0]
        for to in path[1:]:
            phase = advance(phase, to)
        assert phase is path[-1]
    assert IN_FLIGHT == {Phase.DRAINING, Phase.SWITCHING}
    assert set(TRANSITIONS) == set(Phase) and all(Phase.PLANNED not in to for to in TRANSITIONS.values())
    for current, to, legal in ((Phase.PLANNED, Phase.DONE, "aborted, draining, switching"),
                               (Phase.SWITCHING, Phase.DRAINING, "aborted, done"),
                               (Phase.DONE, Phase.SWITCHING, "draining"),
                               (Phase.DRAINING, Phase.DRAINING, "aborted, switching")):
        with pytest.raises(ValueError) as info:
            advance(current, to)
        assert str(info.value) == (f"a reconfiguration cannot go from {current.value} to {to.value} "
                                   f"(from {current.value}: {legal})")
