"""Faults in the simulator: an instance lost at time t and back (restarted, empty) after `down_s`, and what it did
to the SLO attainment of its model.

    octoserve simulate --fault sm-0@30+5 [--fault ...]     # instance sm-0 lost at t = 30 s, serving again at 35 s

The driver (`services/sim/driver.py`) applies the fault as the live router and launcher do: requests on the lost
instance with no token yet are placed again at once; those with tokens are continued on another instance of their
model (a new request: the prompt plus the tokens streamed, `services/core/continuation.py`), or fail when they were
continued `policies.max_continuations` times already (bound) or no instance has room for the continuation (refused);
the instance is unroutable while down.
The report, per fault, over the lost instance's model, in `bin_s` bins of outcome time (when each request's fate
was sealed: its finish, the fault that failed it, or its refusal; by arrival time a loss would show in the bins of
the requests that arrived up to a whole generation earlier, and by its last token in the bin before the fault):
- before: attainment (requests meeting the SLO / requests ended) over the `baseline_s` before the fault;
- dip: the lowest bin attainment from the fault on, and when (the start of its bin, or the fault if later);
- recovery: time from the fault until the end of the first rolling `hold_s` window, ending after the instance is
  back, whose attainment is within `tolerance` of `before` (None when none is within the run);
- rerouted: requests moved off the instance before their first token; continued: streams continued elsewhere;
  failed: requests the fault ended, by cause: bound (continuations spent, or moved MAX_REROUTES times already) and
  refused (no instance had room to take the request again; a request moved before its first token and refused then
  ends as a refusal, the others with an error).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from octoserve.services.metrics import RequestRecord, SloSpec, TimeBin, meets_slo


DEFAULT_DOWN_S = 5.0  # restart time: the live launcher restarts a sim worker in seconds; a vLLM engine takes longer


@dataclass(frozen=True, slots=True)
class InstanceFault:
    instance_id: str
    at_s: float
    down_s: float = DEFAULT_DOWN_S


FAULT_HEADER = ("fault                 model          before    dip (at)         recovery   rerouted  continued  failed  "
                "bound  refused")


def parse_fault(text: str) -> InstanceFault:
    """'sm-0@30' or 'sm-0@30+5' (instance, loss time s, down time s)."""
    instance_id, at, rest = text.partition("@")
    if not at or not instance_id:
        raise ValueError(f"fault {text!r}: write INSTANCE@T or INSTANCE@T+DOWN, as sm-0@30+5")
    at_text, plus, down_text = rest.partition("+")
    try:
        at_s = float(at_text.rstrip("s"))
        down_s = float(down_text.rstrip("s")) if plus else DEFAULT_DOWN_S
    except ValueError:
        raise ValueError(f"fault {text!r}: times are seconds, as sm-0@30+5") from None
    if at_s < 0 or down_s < 0:
        raise ValueError(f"fault {text!r}: times must be >= 0")
    return InstanceFault(instance_id, at_s, down_s)


@dataclass(frozen=True, slots=True)
class FaultReport:
    fault: InstanceFault
    model: str
    before: float
    dip: float
    dip_at_s: float
    recovery_s: float | None
    rerouted: int  # moved before their first token (refused ones included)
    continued: int  # streams continued on another instance
    failed_bound: int  # ended: continuations (or re-routes) spent
    failed_refused: int  # ended: taking them again was refused (continuations and re-routes)

    @property
    def failed(self) -> int:
        return self.failed_bound + self.failed_refused


# The error the simulator's driver gives a request that failed with its instance (services/sim/driver.py, _on_fault).
_LOST = re.compile(r"instance (\S+) was lost\b")


def outcome_time_s(record: RequestRecord, faults: Sequence[InstanceFault] = ()) -> float:
    """When a request's fate was sealed: finished; failed with a lost instance (the time of that fault: the first
    of `faults` on the instance its error names at or after its arrival); failed otherwise (its last token); or
    refused (on arrival)."""
    if record.finish_s is not None:
        return record.finish_s
    if record.error and faults and (m := _LOST.match(record.error)):
        at = [f.at_s for f in faults if f.instance_id == m.group(1) and f.at_s >= record.arrival_s]
        if at:
            return min(at)
    if record.token_times_s:
        return record.token_times_s[-1]
    return record.arrival_s


def attainment_by_outcome_time(records: Sequence[RequestRecord], slo: SloSpec, bin_s: float,
                               faults: Sequence[InstanceFault] = ()) -> list[TimeBin]:
    """Requests binned by `outcome_time_s` (with `faults`) from 0 (empty bins included), with SLO outcomes."""
    if not records:
        return []
    times = [outcome_time_s(r, faults) for r in records]
    num_bins = int(max(times) // bin_s) + 1
    offered, admitted, good = [0] * num_bins, [0] * num_bins, [0] * num_bins
    for r, t in zip(records, times):
        b = int(t // bin_s)
        offered[b] += 1
        admitted[b] += not r.refused
        good[b] += meets_slo(r, slo)
    return [TimeBin(b * bin_s, offered[b], admitted[b], good[b]) for b in range(num_bins)]


def fault_report(records: Sequence[RequestRecord], slo: SloSpec, fault: InstanceFault, model: str, *,
                 counts: Mapping[str, int], bin_s: float = 1.0, baseline_s: float = 20.0, tolerance: float = 0.05,
                 hold_s: float = 10.0, faults: Sequence[InstanceFault] = ()) -> FaultReport:
    """`counts`: what this fault did to its instance's requests (`SimResult.fault_counts_by_fault`, keys
    `driver.FAULT_COUNT_KEYS`); `faults`: every fault of the run (default: this one), so each failed request is
    dated by its own fault."""
    outcomes = (counts.get("rerouted", 0), counts.get("continued", 0), counts.get("failed_bound", 0),
                counts.get("failed_refused", 0) + counts.get("reroute_refused", 0))
    mine = [r for r in records if r.model == model]
    last_arrival_s = max((r.arrival_s for r in mine), default=0.0)
    # Up to the last arrival: after it only the drain's stragglers end, a handful per second.
    bins = [b for b in attainment_by_outcome_time(mine, slo, bin_s, tuple(faults) or (fault,))
            if b.start_s + bin_s <= last_arrival_s]
    # A request lost with its instance is dated by the fault, so the bins wholly before it are the baseline.
    edge_s = fault.at_s
    before_bins = [b for b in bins if edge_s - baseline_s <= b.start_s and b.start_s + bin_s <= edge_s]
    offered = sum(b.num_offered for b in before_bins)
    before = sum(b.num_good for b in before_bins) / offered if offered else 1.0
    # The bin holding the fault counts as after it: the requests lost with the instance are in it.
    after = [b for b in bins if b.start_s + bin_s > edge_s and b.num_offered]
    if not after:
        return FaultReport(fault, model, before, before, fault.at_s, 0.0, *outcomes)
    worst = min(after, key=lambda b: b.attainment_offered)
    floor = before - tolerance
    hold_bins = max(1, round(hold_s / bin_s))
    rolling = []  # (start of the window, attainment over it)
    for i in range(len(after) - hold_bins + 1):
        window = after[i:i + hold_bins]
        rolling.append((window[0].start_s, sum(w.num_good for w in window) / sum(w.num_offered for w in window)))
    # The first window after the instance is back that is within tolerance again; later windows wander with the
    # load as they did before the fault (the before-figure is a 20 s mean, not a bound).
    back_s = fault.at_s + fault.down_s
    recovery_s = next((start_s + hold_s - fault.at_s for start_s, attainment in rolling
                       if start_s + hold_s >= back_s and attainment >= floor), None)
    return FaultReport(fault, model, before, worst.attainment_offered, max(worst.start_s, fault.at_s), recovery_s,
                       *outcomes)


def format_reports(reports: Sequence[FaultReport]) -> str:
    lines = [FAULT_HEADER]
    for r in reports:
        name = f"{r.fault.instance_id}@{r.fault.at_s:g}+{r.fault.down_s:g}"
        recovery = "never" if r.recovery_s is None else f"{r.recovery_s:.0f} s"
        lines.append(f"{name:<21} {r.model:<14} {r.before:>6.1%}  {r.dip:>6.1%} ({r.dip_at_s:>5.0f} s)  "
                     f"{recovery:>8}  {r.rerouted:>8}  {r.continued:>9}  {r.failed:>6}  {r.failed_bound:>5}  "
                     f"{r.failed_refused:>7}")
    lines.append("(attainment: requests meeting the SLO / requests ended, by second of outcome: finish, refusal, or "
                 "the fault for a request lost with its instance; dip (at): the worst second from the fault on; "
                 "recovery: from the fault to the end of the first 10 s window, after the instance is back, within 5 "
                 "points of before; rerouted: moved before their first token; continued: streams that went on from "
                 "their last token on another instance; failed: requests the fault ended, because their "
                 "continuations were spent (bound, policies.max_continuations) or no instance had room to take them "
                 "again (refused))")
    return "\n".join(lines)


def plot_fault_attainment(records: Sequence[RequestRecord], slo: SloSpec, faults: Sequence[InstanceFault],
                          model: str, path, bin_s: float = 1.0):
    """Attainment (of all and of admitted) of `model` per second of outcome time, each fault's down time shaded."""
    from octoserve.services.plots import _save, plt

    bins = attainment_by_outcome_time([r for r in records if r.model == model], slo, bin_s, faults)
    xs = [b.start_s for b in bins]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(xs, [100 * b.attainment_admitted for b in bins], label="of admitted")
    ax.plot(xs, [100 * b.attainment_offered for b in bins], label="of all (refused = miss)")
    for f in faults:
        ax.axvspan(f.at_s, f.at_s + f.down_s, color="red", alpha=0.12)
        ax.axvline(f.at_s, color="red", lw=1)
        ax.text(f.at_s, 101, f" {f.instance_id} lost", color="red", fontsize=8, va="bottom")
    ax.set_ylim(0, 108)
    ax.set_xlabel("outcome time (s): finish, refusal, or the fault for a request lost with its instance")
    ax.set_ylabel(f"{model} SLO attainment (%)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    return _save(fig, path)
