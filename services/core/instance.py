"""Build the core objects of one engine instance from the node config: batcher config, KV pool, cost model.

The live sim engine and the discrete-event simulator both call this, so an instance is the same object graph under
either clock (DESIGN.md section 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.core.batcher import BatcherConfig
from services.core.cost_model import CostModel
from services.core.kv_cache import KVCacheManager
from services.core.placement import InstanceConfig, NodeConfig, num_kv_blocks_for

EOS_TOKEN_ID = 2


@dataclass(frozen=True, slots=True)
class InstanceParts:
    batcher_config: BatcherConfig
    num_kv_blocks: int
    cost_model: CostModel

    def new_kv(self, instance: InstanceConfig) -> KVCacheManager:
        # The model name is the prefix-cache key: blocks of different models never match.
        return KVCacheManager(
            self.num_kv_blocks, instance.block_size, instance.enable_prefix_caching, extra_key=instance.model
        )


def instance_parts(node: NodeConfig, instance: InstanceConfig, cost_model: CostModel | None = None) -> InstanceParts:
    model = node.models[instance.model]
    policies = node.policies
    swap_block_bytes = instance.block_size * model.kv_bytes_per_token
    batcher_config = BatcherConfig(
        role=instance.role,
        max_num_seqs=instance.max_num_seqs,
        max_num_batched_tokens=instance.max_num_batched_tokens,
        max_model_len=model.max_context_len,
        queue_policy=policies.queue,
        reservation_policy=policies.reservation,
        preemption_mode=policies.preemption,
        num_swap_blocks=policies.swap_space_bytes // swap_block_bytes,
        eos_token_id=EOS_TOKEN_ID,
        tier_ttft_slo_ms=dict(node.slo.tier_ttft_ms),
        predictor_prior_tokens=policies.predicted_output_tokens,
    )
    return InstanceParts(
        batcher_config=batcher_config,
        num_kv_blocks=num_kv_blocks_for(node, instance),
        cost_model=cost_model or CostModel(model, node.gpu, instance.tp),
    )
