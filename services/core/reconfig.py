"""Reconfigurations: what the elastic balancer plans, and what the simulator and the live node carry out.

A reconfiguration retires some instances and starts others on the GPUs they free. The two kinds share one shape:
- ROLE: one instance changes role (prefill <-> decode <-> colocated) for the same model on the same GPUs. It retires
  and starts the same instance id; no weights move, so `load_s` is 0.
- MODEL: instances of one model give their GPUs to instances of the other (an 8B GPU joins a 70B TP group, or a
  70B group splits back into 8B replicas). The started instances load weights first (`load_s`).

Life of one reconfiguration (`Phase`): PLANNED -> DRAINING (the retired instances take no new request; their running
requests finish, or migrate by KV hand-off to another instance of the same model when that is faster) -> SWITCHING
(weights load, roles change) -> DONE. A reconfiguration that cannot proceed ends ABORTED and the retired instances
take requests again. No request is dropped in any phase. The legal moves are `TRANSITIONS`, and every driver (the
scheduler, both elastic simulators, a vLLM slot) moves through them with `advance`.

An in-place role change (`in_place`, only between decode and colocated: `in_place_role`) has no DRAINING: both roles
decode, so the instance keeps its running requests, its held hand-offs and its reservations, and takes new requests
in its old role until the switch; from DONE it takes them in the new one (decode -> colocated: new requests of its
own besides hand-offs; colocated -> decode: hand-offs only, while the prompts it already queued still run there).
The model never loses that instance, so a 70B that is a TP 4 decode instance beside a TP 2 prefill one can become
one colocated TP 4 (and back) with no moment unserved.

Invariants:
- Pure data: no clock, no asyncio, no protobuf. Times are seconds on the caller's clock (`*_s`).
- `retire` and `start` cover the same GPUs: a reconfiguration never takes a GPU it did not free.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from octoserve.services.core.placement import InstanceConfig
from octoserve.services.core.types import Role


class ReconfigKind(str, enum.Enum):
    ROLE = "role"  # same model, same GPUs, new role
    MODEL = "model"  # GPUs move from one model to the other; weights load


class Phase(str, enum.Enum):
    PLANNED = "planned"
    DRAINING = "draining"  # retired instances refuse new requests; running ones finish or migrate
    SWITCHING = "switching"  # roles change / weights load; the GPUs serve nothing
    DONE = "done"
    ABORTED = "aborted"


# The legal moves, for every driver: the scheduler (services/scheduler/elastic.py), both elastic simulators
# (services/sim/elastic_sim.py, elastic_step.py) and a vLLM slot (services/engine/vllm_reconfig.py). An in-place
# role change goes PLANNED -> SWITCHING; a slot that carries out one reconfiguration after another starts its next
# DRAINING from the DONE or ABORTED of the last.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.PLANNED: frozenset({Phase.DRAINING, Phase.SWITCHING, Phase.ABORTED}),
    Phase.DRAINING: frozenset({Phase.SWITCHING, Phase.ABORTED}),
    Phase.SWITCHING: frozenset({Phase.DONE, Phase.ABORTED}),
    Phase.DONE: frozenset({Phase.DRAINING}),
    Phase.ABORTED: frozenset({Phase.DRAINING}),
}
IN_FLIGHT = frozenset({Phase.DRAINING, Phase.SWITCHING})  # what counts against the balancer's `max_in_flight`


def advance(current: Phase, to: Phase) -> Phase:
    """`to`, when `TRANSITIONS` allows it from `current`; a driver that skips or repeats a phase raises ValueError."""
    if to not in TRANSITIONS[current]:
        legal = ", ".join(sorted(p.value for p in TRANSITIONS[current]))
        raise ValueError(f"a reconfiguration cannot go from {current.value} to {to.value} (from {current.value}: "
                         f"{legal})")
    return to


@dataclass(frozen=True, slots=True)
class Reconfiguration:
    reconfig_id: str
    kind: ReconfigKind
    retire: tuple[str, ...]  # instance ids that stop taking requests, drain, and go away (or change role)
    start: tuple[InstanceConfig, ...]  # instances that appear on the freed GPUs
    reason: str  # why, in one line a person can read in a log: the load figures that triggered it
    est_drain_s: float = 0.0  # the planner's estimate of the drain (or migration) time
    load_s: float = 0.0  # weight-load time of the started instances (0 for ROLE)
    est_gain: float = 0.0  # the planner's forecast goodput gain over its window, in requests within SLO
    in_place: bool = False  # a ROLE change between decode and colocated that keeps serving throughout (no drain)

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        return tuple(sorted({g for inst in self.start for g in inst.gpu_ids}))


def check_reconfiguration(current: Mapping[str, InstanceConfig], r: Reconfiguration) -> list[str]:
    """Problems with applying `r` to the instances `current` (id -> config); empty when it may proceed."""
    problems: list[str] = []
    missing = [i for i in r.retire if i not in current]
    if missing:
        problems.append(f"{r.reconfig_id}: retires unknown instances {missing}")
        return problems
    freed = sorted(g for i in r.retire for g in current[i].gpu_ids)
    taken = sorted(g for inst in r.start for g in inst.gpu_ids)
    if set(taken) - set(freed):
        problems.append(f"{r.reconfig_id}: starts instances on GPUs {sorted(set(taken) - set(freed))} it does not free")
    if len(taken) != len(set(taken)):
        problems.append(f"{r.reconfig_id}: two started instances share a GPU")
    kept_ids = set(current) - set(r.retire)
    clash = [inst.id for inst in r.start if inst.id in kept_ids]
    if clash:
        problems.append(f"{r.reconfig_id}: starts ids {clash} that other instances already use")
    if r.kind is ReconfigKind.ROLE:
        if len(r.retire) != 1 or len(r.start) != 1 or r.retire[0] != r.start[0].id:
            problems.append(f"{r.reconfig_id}: a role change retires and starts one and the same instance")
        elif current[r.retire[0]].model != r.start[0].model:
            problems.append(f"{r.reconfig_id}: a role change keeps the model; use a model change")
        elif r.in_place and not in_place_role(current[r.retire[0]].role, r.start[0].role):
            problems.append(f"{r.reconfig_id}: only a change between decode and colocated runs in place; "
                            "drain for the others (in_place false)")
    elif r.in_place:
        problems.append(f"{r.reconfig_id}: only a role change runs in place")
    models_after = {current[i].model for i in kept_ids} | {inst.model for inst in r.start}
    models_before = {inst.model for inst in current.values()}
    lost = sorted(models_before - models_after)
    if lost:
        problems.append(f"{r.reconfig_id}: would leave no instance of {lost}")
    return problems


def in_place_role(old: Role, new: Role) -> bool:
    """Whether a change from role `old` to `new` can run in place: both decode (decode and colocated), so whatever
    the instance holds stays on it, and only the new requests it takes change."""
    return {old, new} == {Role.DECODE, Role.COLOCATED}


def apply(current: Mapping[str, InstanceConfig], r: Reconfiguration) -> dict[str, InstanceConfig]:
    """The instances after `r` is DONE. Raises ValueError with the problems when `r` does not fit `current`."""
    problems = check_reconfiguration(current, r)
    if problems:
        raise ValueError("; ".join(problems))
    after = {i: inst for i, inst in current.items() if i not in r.retire}
    after.update((inst.id, inst) for inst in r.start)
    return after


class Balancer(Protocol):
    """What the simulator and the live scheduler call each balancing period.

    `loads` is whatever windowed view the implementation defines (see services/core/balancer.py); `in_flight`
    are the reconfigurations not yet DONE or ABORTED. Returns the reconfigurations to start now (possibly none).
    """

    def plan(self, now_s: float, loads: object, in_flight: Sequence[Reconfiguration]) -> list[Reconfiguration]: ...
