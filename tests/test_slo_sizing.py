"""SLO sizing: the sized batch and budget keep a step under the ITL target, and are the largest that do."""

from pathlib import Path

import pytest

from octoserve.services.core.cost_model import CostModel
from octoserve.services.core.slo_sizing import CHUNK_QUANTUM, size_for_slo
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS
from octoserve.services.core.types import Role

H100 = GPU_PRESETS["h100-sxm-80gb"]
CTX = 1200


@pytest.mark.parametrize("model,tp", [("llama-3-8b", 1), ("llama-3-70b", 4), ("llama-3-70b", 8)])
def test_decode_batch_is_the_largest_that_fits_the_target(model, tp):
    cost = CostModel(MODEL_PRESETS[model], H100, tp)
    s = size_for_slo(cost, Role.DECODE, itl_slo_ms=30, max_num_seqs=1024, max_num_batched_tokens=8192)
    assert s.step_target_s == pytest.approx(0.0255)
    assert cost.step_time_s([(1, CTX)] * s.max_num_seqs) <= s.step_target_s
    assert cost.step_time_s([(1, CTX)] * (s.max_num_seqs + 1)) > s.step_target_s
    assert s.max_num_batched_tokens == s.max_num_seqs


@pytest.mark.parametrize("model,tp", [("llama-3-8b", 1), ("llama-3-70b", 4), ("llama-3-70b", 8)])
def test_colocated_mixed_step_fits_and_one_more_chunk_quantum_does_not(model, tp):
    cost = CostModel(MODEL_PRESETS[model], H100, tp)
    s = size_for_slo(cost, Role.COLOCATED, itl_slo_ms=30, max_num_seqs=1024, max_num_batched_tokens=8192)
    decodes = [(1, CTX)] * s.max_num_seqs
    chunk = s.max_num_batched_tokens - s.max_num_seqs
    assert chunk % CHUNK_QUANTUM == 0 and chunk > 0
    assert cost.step_time_s([(chunk, 0), *decodes]) <= s.step_target_s
    assert cost.step_time_s([(chunk + CHUNK_QUANTUM, 0), *decodes]) > s.step_target_s
    # decodes alone use at most the decode share (0.85) of the target, and one more decode would not
    assert cost.step_time_s(decodes) <= 0.85 * s.step_target_s < cost.step_time_s([(1, CTX)] * (s.max_num_seqs + 1))


def test_sizing_only_tightens_and_leaves_prefill_alone():
    cost = CostModel(MODEL_PRESETS["llama-3-8b"], H100, 1)
    small = size_for_slo(cost, Role.COLOCATED, itl_slo_ms=30, max_num_seqs=8, max_num_batched_tokens=64)
    assert small.max_num_seqs == 8 and small.max_num_batched_tokens == 64
    p = size_for_slo(cost, Role.PREFILL, itl_slo_ms=30, max_num_seqs=256, max_num_batched_tokens=8192)
    assert (p.max_num_seqs, p.max_num_batched_tokens) == (256, 8192)


def test_a_looser_slo_allows_bigger_batches():
    cost = CostModel(MODEL_PRESETS["llama-3-70b"], H100, 4)
    tight = size_for_slo(cost, Role.COLOCATED, itl_slo_ms=30, max_num_seqs=1024, max_num_batched_tokens=8192)
    loose = size_for_slo(cost, Role.COLOCATED, itl_slo_ms=60, max_num_seqs=1024, max_num_batched_tokens=8192)
    assert loose.max_num_seqs > tight.max_num_seqs and loose.max_num_batched_tokens > tight.max_num_batched_tokens


@pytest.mark.parametrize("profile", ["default", "pessimistic"])
@pytest.mark.parametrize("model,tp", [("llama-3-8b", 1), ("llama-3-70b", 4)])
def test_sizing_probes_are_the_step_times_of_the_batches_they_stand_for(profile, model, tp):
    # size_for_slo prices its probes from integer totals instead of lists of chunks: the same floats exactly.
    from octoserve.services.core.cost_model import COST_PROFILES

    cost = CostModel(MODEL_PRESETS[model], H100, tp, COST_PROFILES[profile])
    for d in (0, 1, 7, 64, 300):
        for ctx in (0, 1, CTX, 2 * CTX):
            assert cost.decode_step_time_s(d, ctx) == cost.step_time_s([(1, ctx)] * d)
            for n in (1, 3, 40):
                chunk = n * CHUNK_QUANTUM
                probe = cost.chunks_time_s((chunk,), (0,), 1, num_steady=d, steady_tokens=d * (ctx + 1))
                assert probe == cost.step_time_s([(chunk, 0)] + [(1, ctx)] * d)


def test_with_the_tail_budget_decodes_fill_the_free_step_and_leave_the_tpot_slack():
    from octoserve.services.core.cost_model import COST_PROFILES

    cost = CostModel(MODEL_PRESETS["llama-3-70b"], H100, 4, COST_PROFILES["pessimistic"])
    plain = size_for_slo(cost, Role.COLOCATED, itl_slo_ms=30, max_num_seqs=256, max_num_batched_tokens=4096)
    assert plain.max_num_seqs == 1  # one 70B decode at TP=4 (26.4 ms) is past 0.85 x 0.85 x 30 ms: batch of one
    tail = size_for_slo(cost, Role.COLOCATED, itl_slo_ms=30, max_num_seqs=256, max_num_batched_tokens=4096,
                        tail_budget=True)
    limit_s = 0.95 * 0.97 * 0.030  # the free step's share decodes may fill
    assert tail.step_target_s == pytest.approx(0.95 * 0.030)
    assert cost.step_time_s([(1, CTX)] * tail.max_num_seqs) <= limit_s
    assert cost.step_time_s([(1, CTX)] * (tail.max_num_seqs + 1)) > limit_s
    assert tail.max_num_seqs > 4 * plain.max_num_seqs


def test_instances_size_for_the_tail_budget_only_where_the_plain_batch_starves_and_never_in_a_gang():
    import dataclasses

    from octoserve.services.config import load_node_config
    from octoserve.services.core.instance import instance_parts
    from octoserve.services.core.slo_sizing import SLOT_CEILING_CONTEXT, TAIL_SIZING_BELOW

    def sizing(node, inst, tail_budget, **kw):
        return size_for_slo(node.cost_model(inst), inst.role, itl_slo_ms=node.slo.for_model(inst.model).itl_ms,
                            max_num_seqs=inst.max_num_seqs, max_num_batched_tokens=inst.max_num_batched_tokens,
                            tail_budget=tail_budget, **kw)

    node = load_node_config()
    lm = next(i for i in node.instances if i.model == "llama-3-70b")
    # default profile: the plain batch (38 sequences) is narrow, not starved: decodes may fill the whole step
    plain = sizing(node, lm, False)
    assert plain.max_num_seqs == 38
    config = instance_parts(node, lm).batcher_config
    ceiling = sizing(node, lm, False, decode_share=1.0, context_tokens=SLOT_CEILING_CONTEXT).max_num_seqs
    assert config.max_num_seqs == ceiling == 102 > 2 * plain.max_num_seqs
    assert config.sized_context_tokens == 1200  # the tables stay at the sized context...
    assert len(config.decode_step_s_by_num_decodes) == ceiling + 1  # ...and reach every slot
    assert config.decode_step_s_by_num_decodes[:39] == plain.decode_step_s_by_num_decodes
    assert config.budget_by_num_decodes[:39] == plain.budget_by_num_decodes
    assert config.decode_slot_target_s == pytest.approx(0.85 * 0.030)
    # pessimistic profile: the plain batch is one sequence, so decodes fill the free step (a fixed batch)
    pessimistic = dataclasses.replace(node, cost_profile="pessimistic")
    assert sizing(pessimistic, lm, False).max_num_seqs == 1 < TAIL_SIZING_BELOW
    config = instance_parts(pessimistic, lm).batcher_config
    assert config.max_num_seqs == sizing(pessimistic, lm, True).max_num_seqs
    assert config.decode_slot_target_s == 0.0
    # the 8B keeps its fixed batch under both profiles (wide under the default, 0.95 of the ITL; 0.85 pessimistic)
    sm = next(i for i in node.instances if i.model == "llama-3-8b")
    config = instance_parts(node, sm).batcher_config
    assert config.max_num_seqs == sizing(node, sm, False, headroom=0.95).max_num_seqs >= 128
    assert config.decode_slot_target_s == 0.0
    config = instance_parts(pessimistic, sm).batcher_config
    assert config.max_num_seqs == sizing(pessimistic, sm, False).max_num_seqs
    assert config.decode_slot_target_s == 0.0
    gang = load_node_config(Path(__file__).resolve().parents[1] / "services" / "configs" / "node-gang.yaml")
    member = gang.instances[0]
    assert gang.gang.group_of(member.id) is not None
    assert instance_parts(gang, member).batcher_config.max_num_seqs == sizing(gang, member, False).max_num_seqs
    assert instance_parts(gang, member).batcher_config.decode_slot_target_s == 0.0
