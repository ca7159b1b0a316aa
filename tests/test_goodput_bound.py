"""The prompt-blind goodput bound (services/lab/goodput_bound.py): its operating point on a linear step model, the
KV limit, and the shortest-prompt choice on a real placement."""

from __future__ import annotations

import pytest

from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.lab.goodput_bound import Sample, instance_rps, model_bound


class LinearSteps:
    """10 ms a step, 0.1 ms a token scheduled, 1 us a token of decode context read."""

    def step_time_s(self, chunks):
        return 0.010 + 0.0001 * sum(n for n, _ in chunks) + 1e-6 * sum(c for n, c in chunks if n == 1)


def test_the_best_uniform_step_is_the_widest_that_fits_the_itl():
    # 10 decode tokens and 10 prompt tokens a request, context 100: B decodes carry B prompt tokens, so a step is
    # 10 + 0.3 B ms; within 25.1 ms the widest is B = 50 (25 ms), serving 50 / (10 x 0.025) = 200 req/s
    rps, batch, step_s = instance_rps(LinearSteps(), 0.0251, 10**9, uncached=10, decode_tokens=10, context=100)
    assert batch == 50
    assert step_s == pytest.approx(0.025)
    assert rps == pytest.approx(200.0)


def test_the_kv_pool_caps_the_batch():
    # 3,000 tokens of KV hold 30 contexts of 100: 30 / (10 x 0.019) req/s
    rps, batch, step_s = instance_rps(LinearSteps(), 0.0251, 3000, uncached=10, decode_tokens=10, context=100)
    assert (batch, step_s) == (30, pytest.approx(0.019))
    assert rps == pytest.approx(30 / 0.19)


def test_no_decode_tokens_no_operating_point():
    assert instance_rps(LinearSteps(), 0.03, 10**9, uncached=10, decode_tokens=0, context=10) == (0.0, 0, 0.0)


def _one_8b() -> object:
    return node_config_from_dict({
        "gpu": "h100-sxm-80gb", "num_gpus": 8, "models": {"llama-3-8b": "llama-3-8b"},
        "instances": [{"id": "sm-0", "model": "llama-3-8b", "role": "colocated", "tp": 1, "gpu_ids": [0]}],
    })


def test_the_bound_serves_the_shortest_prompts_and_drops_those_that_cannot_meet_their_ttft():
    config = _one_8b()
    cost = config.cost_model(config.instances[0])
    # half short prompts, a quarter long ones, a quarter too long to prefill within 250 ms even alone
    too_long = 20_000
    assert cost.prefill_time_s(too_long) > 0.25
    requests = ([Sample(100, 100, 200, 250.0)] * 50 + [Sample(3000, 3000, 200, 250.0)] * 25
                + [Sample(too_long, too_long, 200, 250.0)] * 25)
    light = model_bound(config, "llama-3-8b", requests, offered_rps=1.0)
    assert light.feasible_share == 0.75
    assert light.served_rps == pytest.approx(0.75)  # every request that can be served in time is
    heavy = model_bound(config, "llama-3-8b", requests, offered_rps=10_000.0)
    assert heavy.mean_uncached_prompt == 100  # the short prompts only: their capacity is far below their offer
    kv = config.num_kv_blocks_for(config.instances[0]) * 16
    context = (199 * 100 + 199 * 200 / 2) / 199
    rps, batch, step_s = instance_rps(cost, 0.030, kv, 100, 199, context)
    assert heavy.served_rps == pytest.approx(rps) and (heavy.batch, heavy.step_s) == (batch, step_s)
    assert heavy.served_rps < 10_000.0 * 0.5 and heavy.served_share == pytest.approx(heavy.served_rps / 10_000.0)


def test_split_placements_are_refused_with_the_reason():
    config = node_config_from_dict({
        "gpu": "h100-sxm-80gb", "num_gpus": 8, "models": {"llama-3-8b": "llama-3-8b"},
        "instances": [{"id": "p0", "model": "llama-3-8b", "role": "prefill", "tp": 1, "gpu_ids": [0]},
                      {"id": "d0", "model": "llama-3-8b", "role": "decode", "tp": 1, "gpu_ids": [1]}],
    })
    with pytest.raises(ValueError, match="colocated instances only"):
        model_bound(config, "llama-3-8b", [Sample(100, 100, 10, 250.0)], 1.0)


def test_the_command_prints_the_bound_and_refuses_an_unknown_cost_profile(capsys):
    from octoserve.services.lab.goodput_bound import main

    assert main(["--cost-profiles", "default", "--samples", "2000"]) == 0
    out = capsys.readouterr().out
    assert "| default | llama-3-8b | 225.0 |" in out and "| default | node | 300 |" in out
    with pytest.raises(SystemExit) as exit_:
        main(["--cost-profiles", "bogus"])
    assert exit_.value.code == 2
    assert "unknown bogus; choose from default, pessimistic" in capsys.readouterr().err
