"""The simulator's adapter of the gang arbiter: one `GangGroupSim` per gang group, driving its members' steps.

The driver hands every boundary of a member (a step ended, work arrived, a KV hand-off landed) to `kick`, which
asks the group's `GangArbiter` what starts now and starts it through the driver with the arbiter's cap. The
barrier is honest: the arbiter never starts an LM step while an SM step on its GPUs runs, so the LM's wait for
the slowest SM step is virtual time that passes (`GangStats.barrier_idle_gpu_s`, `max_lm_wait_s`).

At each lease start every SM's state for the lease is chosen by `lease_state.lease_state` and counted: "drain" when it
ran a fill step inside the barrier, "keep" when its KV stays resident (the static KV split always allows it),
"swap"/"recompute" otherwise. For seed 003's follow-up it also sums, per lease start and SM with running
requests, what checkpointing its KV to host would have cost (PCIe out and back, `checkpoint_s`) beside what
draining cost (the time from the drain decision to the SM's last step end, `drain_s`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from octoserve.services.core.gang import GangArbiter, GangStats, MemberView
from octoserve.services.core.lease_state import lease_state, lease_state_costs
from octoserve.services.core.placement import GangGroup, NodeConfig


@dataclass(frozen=True, slots=True)
class GangReport:
    """One gang group's figures over a whole run."""

    lm: str
    shape: str
    stats: GangStats
    virtual_s: float
    drain_s: float  # summed over lease starts and SMs with running requests: drain decision -> its last step end
    checkpoint_s: float  # the same SMs' KV out to host and back over PCIe, had they checkpointed instead
    num_sm_pauses: int  # (lease start, SM with running requests) pairs
    # the longest LM wait and SM stall, the waits still open at the end of the run included (a starved side's)
    longest_lm_wait_s: float = 0.0
    longest_sm_stall_s: float = 0.0

    @property
    def switches_per_s(self) -> float:
        return self.stats.num_switches / self.virtual_s if self.virtual_s > 0 else 0.0


class GangGroupSim:
    def __init__(self, node: NodeConfig, group: GangGroup, instances: dict, start_step: Callable) -> None:
        self.group = group
        self.arbiter = GangArbiter(node.gang.policy, group.lm, group.sms)
        self.lm = instances[group.lm]
        self.sms = [instances[x] for x in group.sms]
        self._by_id = {inst.cfg.id: inst for inst in self.members()}
        self._start_step = start_step  # (instance, cap_s) -> step seconds, or None when it planned nothing
        # each member's deadlines come from its own model's ITL SLO (per-model SLOs: the LM's and the SMs' differ)
        self._itl_s = {inst.cfg.id: node.slo.for_model(inst.cfg.model).itl_ms / 1000.0 for inst in self.members()}
        # ...and its prompts' latest starts from the share of the GPUs they get beside the other side
        self._prefill_share = {inst.cfg.id: inst.reporter.gang.prefill_share for inst in self.members()}
        self._horizon_s = node.gang.policy.due_horizon_ms / 1000.0
        self._lending = node.gang.policy.lends_tails
        self._blocked: set[str] = set()  # told to start, planned nothing: no work until the next event
        self._drain_from: float | None = None
        self._sm_ran_fill: set[str] = set()
        self.drain_s = 0.0
        self.checkpoint_s = 0.0
        self.num_sm_pauses = 0

    def members(self) -> list:
        return [self.lm, *self.sms]

    def _view(self, inst, now: float) -> MemberView:
        b = inst.batcher
        has_work = (b.has_work or b.has_pending_outputs) and inst.cfg.id not in self._blocked
        deadline_s = b.earliest_deadline_s(self._itl_s[inst.cfg.id], self._prefill_share[inst.cfg.id])
        return MemberView(inst.cfg.id, has_work, b.step_floor_s(), deadline_s,
                          b.due_prefill_s(now, self._horizon_s) if has_work else 0.0,
                          self._lending and b.lends_tail())

    def step_done(self, inst, now: float) -> None:
        self.arbiter.finished(inst.cfg.id, now)
        self.kick(now)

    def kick(self, now: float) -> None:
        """Something changed at `now`: start whatever the arbiter decides, until it decides nothing new."""
        self._blocked.clear()
        while True:
            was_draining = self.arbiter.draining
            d = self.arbiter.decide(now, self._view(self.lm, now), [self._view(s, now) for s in self.sms])
            if self.arbiter.draining and not was_draining:
                self._drain_from, self._sm_ran_fill = now, set()
            for member_id, shared in d.notices:
                self._by_id[member_id].reporter.shared = shared
            for member_id, lent in d.lend_notices:
                self._by_id[member_id].reporter.note_lending(lent, now)
            starts = ([(self.lm, d.lm_cap_s)] if d.run_lm else []) + [
                (inst, cap) for inst in self.sms for sm_id, cap in d.sm_starts if sm_id == inst.cfg.id
            ]
            if not starts:
                return
            if d.run_lm:
                self._note_lease_start(now)
            blocked_any = False
            for inst, cap in starts:
                step_s = self._start_step(inst, cap)
                if step_s is None:
                    self.arbiter.nothing_to_run(inst.cfg.id)
                    self._blocked.add(inst.cfg.id)
                    blocked_any = True
                else:
                    self.arbiter.started(inst.cfg.id, now, step_s, cap)
                    if d.fills:
                        self._sm_ran_fill.add(inst.cfg.id)
            if not blocked_any:
                return

    def _note_lease_start(self, now: float) -> None:
        if self._drain_from is None:
            return
        for sm in self.sms:
            b = sm.batcher
            if not b.num_running:
                continue
            context = b.running_context_tokens()
            costs = lease_state_costs(
                fill_fits=sm.cfg.id in self._sm_ran_fill, kv_resident_ok=True, running_context_tokens=context,
                swap_s_per_token=sm.cost.swap_time_s(1, 1) - sm.cost.constants.swap_setup_s,
                prefill_s_per_token=b.config.prefill_s_per_token, host_room=True,
            )
            self.arbiter.note_lease_state(lease_state(costs))
            self.num_sm_pauses += 1
            last_end = self.arbiter.last_step_end_s(sm.cfg.id) or self._drain_from
            self.drain_s += max(0.0, last_end - self._drain_from)
            self.checkpoint_s += costs.swap_out_in_s + 2 * sm.cost.constants.swap_setup_s
        self._drain_from = None

    def report(self, virtual_s: float) -> GangReport:
        stats = self.arbiter.stats
        open_lm, open_sm = self.arbiter.open_waits_s(virtual_s)
        return GangReport(self.group.lm, self.arbiter.policy.shape, stats, virtual_s, self.drain_s,
                          self.checkpoint_s, self.num_sm_pauses, max(stats.max_lm_wait_s, open_lm),
                          max(stats.max_sm_stall_s, open_sm))


def build_gangs(node: NodeConfig, instances: dict, start_step: Callable) -> dict[str, GangGroupSim]:
    """instance id -> the GangGroupSim it belongs to (empty without `gang` in the config)."""
    out: dict[str, GangGroupSim] = {}
    if node.gang is None:
        return out
    for group in node.gang.groups:
        sim = GangGroupSim(node, group, instances, start_step)
        for member in (group.lm, *group.sms):
            out[member] = sim
    return out
