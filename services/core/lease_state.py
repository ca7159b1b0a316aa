"""What one SM keeps through a gang lease: the cheapest state for its running requests, by its cost model.

At each lease start (services/core/gang.py) every SM with running requests is drained (one more step inside the
barrier, free when it fits), kept (paused with its KV on the GPU, free while both KV pools stay resident), swapped
(its KV to host memory and back over PCIe) or recomputed (its KV prefilled again), whichever costs least. Clock-free.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True, slots=True)
class LeaseStateCosts:
    """What one SM instance's choice at a lease start costs, in seconds of GPU time, from its cost model."""

    fill_fits: bool  # its next step ends before the barrier anyway (drain costs the LM nothing)
    kv_resident_ok: bool  # its KV pool stays resident through the lease (placement's static split)
    swap_out_in_s: float  # PCIe time to move its running KV to host and back
    recompute_s: float  # prefill time to rebuild its running KV
    host_room: bool  # swap space holds it


def lease_state(c: LeaseStateCosts) -> str:
    """drain: finish one more step inside the barrier (free); keep: pause with KV on GPU (free while the pools are
    resident); else the cheaper of swap (PCIe both ways) and recompute (prefill again)."""
    if c.fill_fits:
        return "drain"
    if c.kv_resident_ok:
        return "keep"
    if c.host_room and c.swap_out_in_s <= c.recompute_s:
        return "swap"
    return "recompute"


def lease_state_costs(
    *, fill_fits: bool, kv_resident_ok: bool, running_context_tokens: int, swap_s_per_token: float,
    prefill_s_per_token: float, host_room: bool,
) -> LeaseStateCosts:
    return LeaseStateCosts(
        fill_fits=fill_fits,
        kv_resident_ok=kv_resident_ok,
        swap_out_in_s=2 * running_context_tokens * swap_s_per_token,
        recompute_s=running_context_tokens * prefill_s_per_token,
        host_room=host_room,
    )
