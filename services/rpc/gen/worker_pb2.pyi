from octoserve.v1 import generate_pb2 as _generate_pb2
from . import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    COLOCATED: _ClassVar[Role]
    PREFILL: _ClassVar[Role]
    DECODE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
COLOCATED: Role
PREFILL: Role
DECODE: Role

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "drain_timeout_ms", "migration_targets", "max_migration_pause_s", "migration_itl_budget_s", "in_place")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_TARGETS_FIELD_NUMBER: _ClassVar[int]
    MAX_MIGRATION_PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ITL_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    role: Role
    drain_timeout_ms: int
    migration_targets: _containers.RepeatedCompositeFieldContainer[MigrationTarget]
    max_migration_pause_s: float
    migration_itl_budget_s: float
    in_place: bool
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., drain_timeout_ms: _Optional[int] = ..., migration_targets: _Optional[_Iterable[_Union[MigrationTarget, _Mapping]]] = ..., max_migration_pause_s: _Optional[float] = ..., migration_itl_budget_s: _Optional[float] = ..., in_place: _Optional[bool] = ...) -> None: ...

class MigrationTarget(_message.Message):
    __slots__ = ("instance_id", "address", "free_blocks", "block_size", "free_slots", "decode_batch", "kv_tokens", "tensor_parallel")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    free_blocks: int
    block_size: int
    free_slots: int
    decode_batch: int
    kv_tokens: int
    tensor_parallel: int
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., free_slots: _Optional[int] = ..., decode_batch: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., tensor_parallel: _Optional[int] = ...) -> None: ...

class SetRoleReply(_message.Message):
    __slots__ = ("drained_requests", "drain_s", "migrated_requests", "kept_by_reason")
    class KeptByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DRAINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KEPT_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    drained_requests: int
    drain_s: float
    migrated_requests: int
    kept_by_reason: _containers.ScalarMap[str, int]
    def __init__(self, drained_requests: _Optional[int] = ..., drain_s: _Optional[float] = ..., migrated_requests: _Optional[int] = ..., kept_by_reason: _Optional[_Mapping[str, int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class RequestSpec(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "arrival_s", "priority", "ttft_slo_ms", "sim_output_len")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    SIM_OUTPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    arrival_s: float
    priority: _generate_pb2.Priority
    ttft_slo_ms: float
    sim_output_len: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., arrival_s: _Optional[float] = ..., priority: _Optional[_Union[_generate_pb2.Priority, str]] = ..., ttft_slo_ms: _Optional[float] = ..., sim_output_len: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "num_prompt_tokens", "num_cached_prompt_tokens", "num_output_tokens", "error_code", "error_message", "migration", "migration_target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _generate_pb2.FinishReason
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_output_tokens: int
    error_code: int
    error_message: str
    migration: _kv_pb2.KVHandoff
    migration_target: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., migration: _Optional[_Union[_kv_pb2.KVHandoff, _Mapping]] = ..., migration_target: _Optional[str] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("seq", "deltas")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    deltas: _containers.RepeatedCompositeFieldContainer[TokenDelta]
    def __init__(self, seq: _Optional[int] = ..., deltas: _Optional[_Iterable[_Union[TokenDelta, _Mapping]]] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("session_id", "spec")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    spec: RequestSpec
    def __init__(self, session_id: _Optional[str] = ..., spec: _Optional[_Union[RequestSpec, _Mapping]] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request", "metadata")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    request: WorkerGenerateRequest
    metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    def __init__(self, request: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ..., metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ...) -> None: ...

class MetadataEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class SubmitResult(_message.Message):
    __slots__ = ("request_id", "code", "message", "trailing_metadata")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    trailing_metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., trailing_metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: RequestSpec
    def __init__(self, spec: _Optional[_Union[RequestSpec, _Mapping]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("handoff",)
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    handoff: _kv_pb2.KVHandoff
    def __init__(self, handoff: _Optional[_Union[_kv_pb2.KVHandoff, _Mapping]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("spec", "ttl_ms", "output_token_ids")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    spec: RequestSpec
    ttl_ms: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, spec: _Optional[_Union[RequestSpec, _Mapping]] = ..., ttl_ms: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("reserved",)
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    reserved: bool
    def __init__(self, reserved: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "spec", "handoff", "source_address")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    spec: RequestSpec
    handoff: _kv_pb2.KVHandoff
    source_address: str
    def __init__(self, session_id: _Optional[str] = ..., spec: _Optional[_Union[RequestSpec, _Mapping]] = ..., handoff: _Optional[_Union[_kv_pb2.KVHandoff, _Mapping]] = ..., source_address: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("instance_id", "model", "role", "num_running", "num_waiting", "num_total_blocks", "num_free_blocks", "block_size", "queued_prefill_tokens", "prefill_tokens_per_s", "decode_step_time_s", "healthy", "paused", "kv_events", "seq", "max_num_seqs", "mean_output_tokens", "num_reserved", "long_prefill_tokens_per_s", "busy_until_s", "long_step_wait_s", "long_burst_tokens", "long_sustained_tokens_per_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MEAN_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    LONG_PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_UNTIL_S_FIELD_NUMBER: _ClassVar[int]
    LONG_STEP_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    LONG_BURST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LONG_SUSTAINED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    model: str
    role: Role
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    block_size: int
    queued_prefill_tokens: int
    prefill_tokens_per_s: float
    decode_step_time_s: float
    healthy: bool
    paused: bool
    kv_events: _containers.RepeatedCompositeFieldContainer[_kv_pb2.KVEvent]
    seq: int
    max_num_seqs: int
    mean_output_tokens: float
    num_reserved: int
    long_prefill_tokens_per_s: float
    busy_until_s: float
    long_step_wait_s: float
    long_burst_tokens: float
    long_sustained_tokens_per_s: float
    def __init__(self, instance_id: _Optional[str] = ..., model: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_time_s: _Optional[float] = ..., healthy: _Optional[bool] = ..., paused: _Optional[bool] = ..., kv_events: _Optional[_Iterable[_Union[_kv_pb2.KVEvent, _Mapping]]] = ..., seq: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., mean_output_tokens: _Optional[float] = ..., num_reserved: _Optional[int] = ..., long_prefill_tokens_per_s: _Optional[float] = ..., busy_until_s: _Optional[float] = ..., long_step_wait_s: _Optional[float] = ..., long_burst_tokens: _Optional[float] = ..., long_sustained_tokens_per_s: _Optional[float] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...
