"""Shared builders for the admission and routing tests: hand-built loads, a linear cost model, a fake index."""

from __future__ import annotations

from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.types import EngineLoad, Priority, RequestSpec, Role, SamplingParams

LM, SM = "llama-3-70b", "llama-3-8b"
TOKENS_PER_S = 10_000.0


class LinearCost:
    """Prefill at a flat 10,000 tokens/s whatever the chunk or context, so expected times are hand arithmetic;
    a decode step of `decode_step_s` (10 ms) whatever the batch."""

    def __init__(self, decode_step_s: float = 0.010) -> None:
        self.decode_step_s = decode_step_s

    def prefill_time_s(self, num_tokens: int, num_context_tokens: int = 0) -> float:
        return num_tokens / TOKENS_PER_S

    def prefill_tokens_per_s(self, chunk_tokens: int) -> float:
        return TOKENS_PER_S

    def decode_step_time_s(self, batch_size: int, context_len: int) -> float:
        return self.decode_step_s


class FakeIndex:
    """PrefixIndex stand-in: fixed overlaps, and a log of the events it was fed."""

    def __init__(self, overlaps: dict[str, int] | None = None) -> None:
        self.overlaps = overlaps or {}
        self.events: list = []

    def apply(self, instance_id, event) -> None:
        self.events.append((instance_id, event))

    def apply_all(self, instance_id, events) -> None:
        for event in events:
            self.apply(instance_id, event)

    def overlap_blocks(self, block_hashes) -> dict[str, int]:
        return dict(self.overlaps)


class FixedRng:
    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def fake_hasher(token_ids, block_size, extra_key):
    return list(range(len(token_ids) // block_size))


def colocated_config(**policies):
    return node_config_from_dict(
        {
            "models": [LM, SM],
            "instances": [{"id": "lm-0", "model": LM, "tp": 4, "gpu_ids": [0, 1, 2, 3]}]
            + [{"id": f"sm-{i}", "model": SM, "tp": 1, "gpu_ids": [4 + i]} for i in range(3)],
            "policies": policies,
        }
    )


def disagg_config(**policies):
    return node_config_from_dict(
        {
            "models": [LM],
            "instances": [
                {"id": "p-0", "model": LM, "role": "prefill", "tp": 4, "gpu_ids": [0, 1, 2, 3]},
                {"id": "d-0", "model": LM, "role": "decode", "tp": 2, "gpu_ids": [4, 5]},
                {"id": "d-1", "model": LM, "role": "decode", "tp": 2, "gpu_ids": [6, 7]},
            ],
            "policies": policies,
        }
    )


def load(iid, model=SM, role=Role.COLOCATED, *, free=1000, total=1000, queued=0, waiting=0, running=0,
         tps=TOKENS_PER_S, healthy=True, paused=False) -> EngineLoad:
    return EngineLoad(iid, model, role, running, waiting, total, free, 16, queued, tps, 0.01, healthy, paused)


def request(rid="r", model=SM, prompt=1000, max_tokens=100, tier=Priority.STANDARD, ttft_slo_ms=None) -> RequestSpec:
    return RequestSpec(rid, model, tuple(range(prompt)), SamplingParams(max_tokens=max_tokens), 0.0, tier, ttft_slo_ms)


def policy(config, overlaps=None, rng=None):
    from octoserve.services.core.routing import RouterPolicy

    costs = {i.id: LinearCost() for i in config.instances}
    return RouterPolicy(config, costs, rng or FixedRng(*[0.5] * 100), prefix_index=FakeIndex(overlaps),
                        block_hasher=fake_hasher)
