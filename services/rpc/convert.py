"""Protobuf <-> core dataclass conversion: the one place where wire types meet `octoserve.services.core.types`.

Invariants:
- Pure functions, no I/O. Wire defaults map to the core's meaning here and nowhere else
  (top_p unset -> 1.0, ttft_slo_ms 0 -> None, PRIORITY_UNSPECIFIED -> STANDARD).
- Enums are mapped by explicit tables, so renumbering one side cannot silently shift the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from octoserve.services.core.continuation import continuation_spec
from octoserve.services.core.errors import InvalidArgument
from octoserve.services.core.types import (
    BlockRemoved,
    BlockStored,
    EngineLoad,
    FinishReason,
    KVEvent,
    Priority,
    RequestOutput,
    RequestSpec,
    Role,
    SamplingParams,
)
from octoserve.services.engine.base import KVHandoff
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.services.rpc.gen import kv_pb2 as kv_pb
from octoserve.services.rpc.gen import worker_pb2 as w_pb

PRIORITY_FROM_PB = {
    gen_pb.PRIORITY_UNSPECIFIED: Priority.STANDARD,
    gen_pb.INTERACTIVE: Priority.INTERACTIVE,
    gen_pb.STANDARD: Priority.STANDARD,
    gen_pb.BATCH: Priority.BATCH,
}
PRIORITY_TO_PB = {Priority.INTERACTIVE: gen_pb.INTERACTIVE, Priority.STANDARD: gen_pb.STANDARD, Priority.BATCH: gen_pb.BATCH}

FINISH_TO_PB = {
    None: gen_pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: gen_pb.STOP,
    FinishReason.LENGTH: gen_pb.LENGTH,
    FinishReason.ABORT: gen_pb.ABORT,
    # A hand-off never reaches a client: the router continues the request on a decode instance.
    FinishReason.HANDOFF: gen_pb.FINISH_REASON_UNSPECIFIED,
}
FINISH_FROM_PB = {
    gen_pb.FINISH_REASON_UNSPECIFIED: None,
    gen_pb.STOP: FinishReason.STOP,
    gen_pb.LENGTH: FinishReason.LENGTH,
    gen_pb.ABORT: FinishReason.ABORT,
}

ROLE_TO_PB = {Role.COLOCATED: w_pb.COLOCATED, Role.PREFILL: w_pb.PREFILL, Role.DECODE: w_pb.DECODE}
ROLE_FROM_PB = {v: k for k, v in ROLE_TO_PB.items()}


def text_to_token_ids(text: str) -> tuple[int, ...]:
    """Byte-level ids for text prompts when the model has no tokenizer (the sim engine): one id per UTF-8 byte."""
    return tuple(text.encode("utf-8"))


# Request metadata a load harness may send to a sim-engine node: the true output length of a trace request (the
# simulated model emits EOS after that many tokens). Real engines ignore it.
SIM_OUTPUT_LEN_KEY = "x-octoserve-sim-output-len"


def sim_output_len_from_metadata(metadata) -> int | None:
    for key, value in metadata or ():
        if key == SIM_OUTPUT_LEN_KEY:
            try:
                return max(1, int(value))
            except ValueError:
                return None
    return None


def spec_from_public(
    req: gen_pb.GenerateRequest, request_id: str, arrival_s: float, sim_output_len: int | None = None
) -> RequestSpec:
    """The router's view of a client request; validation happens afterwards on the dataclass."""
    if req.WhichOneof("prompt") == "token_ids":
        prompt = tuple(req.token_ids.ids)
    else:
        prompt = text_to_token_ids(req.text)
    sampling = SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p if req.HasField("top_p") else 1.0,  # an explicit 0 is then refused by validation
        seed=req.seed if req.HasField("seed") else None,
        stop=tuple(req.stop),
        ignore_eos=req.ignore_eos,
    )
    return RequestSpec(
        request_id=request_id,
        model=req.model,
        prompt_token_ids=prompt,
        sampling=sampling,
        arrival_s=arrival_s,
        priority=PRIORITY_FROM_PB.get(req.priority, Priority.STANDARD),
        ttft_slo_ms=float(req.ttft_slo_ms) if req.ttft_slo_ms else None,
        sim_output_len=sim_output_len,
    )


def resumed_spec(spec: RequestSpec, req: gen_pb.GenerateRequest, model) -> RequestSpec:
    """The request a client resumes (`GenerateRequest.resume_from`: the tokens its earlier stream received), as a
    continuation of `spec` (the request as validated without them), by the rule of the router's own continuation
    on another worker (`core/continuation.py`): prompt + those tokens, max_tokens less their number (and the sim
    engine's output length, so its EOS stays where it was), everything else unchanged. `spec` unchanged when
    resume_from is unset or empty.

    Refused (InvalidArgument, field resume_from): as many tokens as max_tokens or more (nothing would be left to
    generate), or an id outside the model's vocabulary. The context window needs no check of its own: the
    validated request has prompt + max_tokens <= window, so prompt + fewer than max_tokens tokens fits."""
    ids = tuple(req.resume_from.ids)
    if not ids:
        return spec
    max_tokens = spec.sampling.max_tokens
    if len(ids) >= max_tokens:
        raise InvalidArgument(
            "resume_from",
            f"resume_from holds {len(ids)} tokens but max_tokens is {max_tokens}; max_tokens counts the whole "
            f"request, resumed tokens included, so nothing is left to generate: send at most {max_tokens - 1} "
            "resumed tokens with the original max_tokens (a stream that received max_tokens tokens has finished)",
        )
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None:
        for position, token_id in enumerate(ids):
            if token_id >= vocab:
                raise InvalidArgument(
                    "resume_from",
                    f"resume_from token id {token_id} at position {position} is outside the vocabulary of "
                    f"{model.name} (ids 0..{vocab - 1}); send the token ids the stream returned",
                )
    return continuation_spec(spec, ids, spec.arrival_s)


def spec_to_pb(spec: RequestSpec) -> w_pb.RequestSpec:
    s = spec.sampling
    msg = w_pb.RequestSpec(
        request_id=spec.request_id,
        model=spec.model,
        prompt_token_ids=spec.prompt_token_ids,
        sampling=w_pb.SamplingParams(
            max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, stop=s.stop, ignore_eos=s.ignore_eos
        ),
        arrival_s=spec.arrival_s,
        priority=PRIORITY_TO_PB[spec.priority],
    )
    if s.seed is not None:
        msg.sampling.seed = s.seed
    if spec.ttft_slo_ms is not None:
        msg.ttft_slo_ms = spec.ttft_slo_ms
    if spec.sim_output_len is not None:
        msg.sim_output_len = spec.sim_output_len
    return msg


def spec_from_pb(msg: w_pb.RequestSpec) -> RequestSpec:
    s = msg.sampling
    return RequestSpec(
        request_id=msg.request_id,
        model=msg.model,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        sampling=SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed if s.HasField("seed") else None,
            stop=tuple(s.stop),
            ignore_eos=s.ignore_eos,
        ),
        arrival_s=msg.arrival_s,
        priority=PRIORITY_FROM_PB.get(msg.priority, Priority.STANDARD),
        ttft_slo_ms=msg.ttft_slo_ms if msg.HasField("ttft_slo_ms") else None,
        sim_output_len=msg.sim_output_len if msg.HasField("sim_output_len") else None,
    )


def handoff_to_pb(h: KVHandoff) -> kv_pb.KVHandoff:
    return kv_pb.KVHandoff(
        request_id=h.request_id,
        source_instance_id=h.source_instance_id,
        num_prompt_tokens=h.num_prompt_tokens,
        first_token_id=h.first_token_id,
        num_kv_bytes=h.num_kv_bytes,
        num_cached_prompt_tokens=h.num_cached_prompt_tokens,
        connector_params_json=h.connector_params_json,
        finish_reason=h.finish_reason,
        output_token_ids=h.output_token_ids,
    )


def handoff_from_pb(m: kv_pb.KVHandoff) -> KVHandoff:
    return KVHandoff(
        request_id=m.request_id,
        source_instance_id=m.source_instance_id,
        num_prompt_tokens=m.num_prompt_tokens,
        first_token_id=m.first_token_id,
        num_kv_bytes=m.num_kv_bytes,
        num_cached_prompt_tokens=m.num_cached_prompt_tokens,
        connector_params_json=m.connector_params_json,
        finish_reason=m.finish_reason,
        output_token_ids=tuple(m.output_token_ids),
    )


def output_to_delta(out: RequestOutput) -> w_pb.TokenDelta:
    return w_pb.TokenDelta(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        finish_reason=FINISH_TO_PB[out.finish_reason],
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_prompt_tokens=out.num_cached_prompt_tokens,
        num_output_tokens=out.num_output_tokens,
    )


def _hash_to_pb(h: int) -> int:
    return h & 0xFFFFFFFFFFFFFFFF  # uint64 on the wire; the core's hashes are non-negative 64-bit already


def kv_events_to_pb(events: Iterable[KVEvent]) -> list[kv_pb.KVEvent]:
    out: list[kv_pb.KVEvent] = []
    for e in events:
        if isinstance(e, BlockStored):
            stored = kv_pb.BlockStored(block_hashes=[_hash_to_pb(h) for h in e.block_hashes])
            if e.parent_hash is not None:
                stored.parent_hash = _hash_to_pb(e.parent_hash)
            out.append(kv_pb.KVEvent(stored=stored))
        else:
            out.append(kv_pb.KVEvent(removed=kv_pb.BlockRemoved(block_hashes=[_hash_to_pb(h) for h in e.block_hashes])))
    return out


def kv_events_from_pb(events: Sequence[kv_pb.KVEvent]) -> list[KVEvent]:
    out: list[KVEvent] = []
    for e in events:
        if e.WhichOneof("event") == "stored":
            parent = e.stored.parent_hash if e.stored.HasField("parent_hash") else None
            out.append(BlockStored(block_hashes=tuple(e.stored.block_hashes), parent_hash=parent))
        else:
            out.append(BlockRemoved(block_hashes=tuple(e.removed.block_hashes)))
    return out


def load_to_pb(load: EngineLoad, seq: int = 0, kv_events: Iterable[KVEvent] = ()) -> w_pb.LoadReport:
    return w_pb.LoadReport(
        instance_id=load.instance_id,
        model=load.model,
        role=ROLE_TO_PB[load.role],
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_total_blocks=load.num_total_blocks,
        num_free_blocks=load.num_free_blocks,
        block_size=load.block_size,
        queued_prefill_tokens=load.queued_prefill_tokens,
        prefill_tokens_per_s=load.prefill_tokens_per_s,
        decode_step_time_s=load.decode_step_time_s,
        healthy=load.healthy,
        paused=load.paused,
        kv_events=kv_events_to_pb(kv_events),
        seq=seq,
        max_num_seqs=load.max_num_seqs,
        mean_output_tokens=load.mean_output_tokens,
        num_reserved=load.num_reserved,
        long_prefill_tokens_per_s=load.long_prefill_tokens_per_s,
        busy_until_s=load.busy_until_s,
        long_step_wait_s=load.long_step_wait_s,
        long_burst_tokens=load.long_burst_tokens,
        long_sustained_tokens_per_s=load.long_sustained_tokens_per_s,
    )


def load_from_pb(m: w_pb.LoadReport) -> EngineLoad:
    return EngineLoad(
        instance_id=m.instance_id,
        model=m.model,
        role=ROLE_FROM_PB[m.role],
        num_running=m.num_running,
        num_waiting=m.num_waiting,
        num_total_blocks=m.num_total_blocks,
        num_free_blocks=m.num_free_blocks,
        block_size=m.block_size,
        queued_prefill_tokens=m.queued_prefill_tokens,
        prefill_tokens_per_s=m.prefill_tokens_per_s,
        decode_step_time_s=m.decode_step_time_s,
        healthy=m.healthy,
        paused=m.paused,
        max_num_seqs=m.max_num_seqs,
        mean_output_tokens=m.mean_output_tokens,
        num_reserved=m.num_reserved,
        long_prefill_tokens_per_s=m.long_prefill_tokens_per_s,
        busy_until_s=m.busy_until_s,
        long_step_wait_s=m.long_step_wait_s,
        long_burst_tokens=m.long_burst_tokens,
        long_sustained_tokens_per_s=m.long_sustained_tokens_per_s,
    )
