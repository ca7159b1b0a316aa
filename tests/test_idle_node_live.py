"""A freshly started idle node, live: the default placement's router and sim-engine workers over real gRPC on
127.0.0.1 admit every 70B prompt the idle 70B instance prefills within its TTFT SLO, before any calibration sample,
serve it within the SLO, and refuse the rest at once without a retry hint (retrying an idle node cannot help).

Which prompts fit is not a constant of the test: the seeded simulator, with admission off, says what TTFT the idle
instance gives each prompt (tests/test_slo_budget.py checks the simulator's admission against the same figure).
The node runs at time_scale 10 (a modelled 250 ms is 2.5 s of wall clock), so a loaded test machine does not move a
first token across the SLO."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest

from octoserve.router.servicer import RouterSettings
from octoserve.services.config import load_node_config
from octoserve.v1 import generate_pb2 as gen_pb
from tests.service_fixtures import start_inprocess_node
from tests.test_slo_budget import LM, idle_ttft_s

pytestmark = pytest.mark.asyncio

TIME_SCALE = 10.0
TTFT_SLO_S = 0.250
LENGTHS = (1000, 1500, 2500, 4000)


def lm_request(prompt_len: int) -> gen_pb.GenerateRequest:
    prompt = gen_pb.TokenIds(ids=[1000 + i for i in range(prompt_len)])
    return gen_pb.GenerateRequest(model=LM, token_ids=prompt, max_tokens=8, ignore_eos=True,
                                  priority=gen_pb.STANDARD, ttft_slo_ms=250)


async def first_token_or_refusal(node, prompt_len: int):
    """(modelled TTFT in s, None) when served to the end; (None, the refusal) when refused."""
    call = node.generation().Generate(lm_request(prompt_len), timeout=60.0)
    start = time.monotonic()
    first_s, tokens = None, 0
    try:
        async for response in call:
            if first_s is None and response.token_ids:
                first_s = (time.monotonic() - start) / TIME_SCALE
            tokens += len(response.token_ids)
    except grpc.aio.AioRpcError as e:
        assert first_s is None, f"{prompt_len}-token prompt failed after its first token: {e.details()}"
        return None, e
    assert tokens == 8
    return first_s, None


@pytest.mark.parametrize("profile", ["default", "pessimistic"])
async def test_a_fresh_live_idle_node_admits_every_70b_prompt_it_prefills_within_the_slo(profile):
    config = dataclasses.replace(load_node_config(), cost_profile=profile)
    admitted, refused = [], []
    for n in LENGTHS:
        fits = idle_ttft_s(config, n) <= TTFT_SLO_S
        node = await start_inprocess_node(config, settings=RouterSettings(time_scale=TIME_SCALE))
        try:
            ttft_s, error = await first_token_or_refusal(node, n)
        finally:
            await node.stop()
        if fits:
            assert error is None, (profile, n, idle_ttft_s(config, n), error and error.details())
            assert ttft_s <= TTFT_SLO_S, (profile, n, ttft_s)
            admitted.append(n)
        else:
            assert error is not None, (profile, n, idle_ttft_s(config, n), ttft_s)
            # Too long for the idle node: refused as infeasible, with no "retry after" that could not come true.
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, (profile, n, error.details())
            assert "retry-after-ms" not in dict(error.trailing_metadata() or ()), (profile, n)
            refused.append(n)
    assert admitted and refused  # both sides of the limit are tried, under each profile
