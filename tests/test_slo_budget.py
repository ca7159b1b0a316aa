"""The SLOs spent as budgets, end to end in the seeded simulator: an idle node admits what it can serve in time,
and slow steps spend the ITL tail only within its budget."""

from __future__ import annotations

import dataclasses

import pytest

from octoserve.services.config import load_node_config
from octoserve.services.core.types import Priority
from octoserve.services.sim.driver import run_simulation
from octoserve.services.workload import TraceRequest

LM = "llama-3-70b"


def lm_request(prompt_len: int, arrival_s: float = 0.5, rid: str = "r0") -> TraceRequest:
    return TraceRequest(request_id=rid, arrival_s=arrival_s, model=LM,
                        prompt_token_ids=tuple(range(1000, 1000 + prompt_len)), output_len=8, max_tokens=8,
                        priority=Priority.STANDARD, ttft_slo_ms=250.0)


def idle_ttft_s(config, prompt_len: int) -> float:
    """The TTFT the idle node gives the prompt when nothing is refused: its own prefill, in the chunks its step
    budget allows."""
    unguarded = dataclasses.replace(config, policies=dataclasses.replace(config.policies, admission=False))
    record = run_simulation(unguarded, [lm_request(prompt_len)], drain_s=30.0).records[0]
    return record.first_token_s - record.arrival_s


@pytest.mark.parametrize("profile", ["default", "pessimistic"])
def test_a_fresh_idle_node_admits_every_70b_prompt_it_prefills_within_the_ttft_slo(profile):
    """Before any calibration sample, a prompt alone on the idle 70B is admitted exactly when the idle instance
    gives it its first token within the 250 ms SLO, and then served within it."""
    config = dataclasses.replace(load_node_config(), cost_profile=profile)
    lengths = [500, 1000, 1500, 2000, 2500, 3000, 4000]
    admitted = []
    for n in lengths:
        record = run_simulation(config, [lm_request(n)], drain_s=30.0).records[0]
        fits = idle_ttft_s(config, n) <= 0.250
        assert record.refused is not fits, (profile, n, idle_ttft_s(config, n))
        if fits:
            assert record.first_token_s - record.arrival_s <= 0.250, (profile, n)
            admitted.append(n)
    assert admitted and admitted[-1] < lengths[-1]  # both sides of the limit are tried
    assert not run_simulation(config, [lm_request(1500)], drain_s=30.0).records[0].refused  # the prompt
