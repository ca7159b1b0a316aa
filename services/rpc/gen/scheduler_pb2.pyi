from . import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_SERVING: _ClassVar[InstanceState]
    INSTANCE_DRAINING: _ClassVar[InstanceState]
    INSTANCE_STARTING: _ClassVar[InstanceState]
INSTANCE_SERVING: InstanceState
INSTANCE_DRAINING: InstanceState
INSTANCE_STARTING: InstanceState

class ModelArrivals(_message.Message):
    __slots__ = ("model", "arrivals", "prompt_tokens", "output_tokens", "refused")
    class RefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARRIVALS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    model: str
    arrivals: int
    prompt_tokens: int
    output_tokens: int
    refused: _containers.ScalarMap[str, int]
    def __init__(self, model: _Optional[str] = ..., arrivals: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., refused: _Optional[_Mapping[str, int]] = ...) -> None: ...

class DemandReport(_message.Message):
    __slots__ = ("models", "interval_s")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelArrivals]
    interval_s: float
    def __init__(self, models: _Optional[_Iterable[_Union[ModelArrivals, _Mapping]]] = ..., interval_s: _Optional[float] = ...) -> None: ...

class DemandReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstancePlacement(_message.Message):
    __slots__ = ("instance_id", "model", "role", "gpu_ids", "tensor_parallel", "address", "context_window", "state", "instance_config_json", "engine_generation")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    ENGINE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    model: str
    role: _worker_pb2.Role
    gpu_ids: _containers.RepeatedScalarFieldContainer[int]
    tensor_parallel: int
    address: str
    context_window: int
    state: InstanceState
    instance_config_json: str
    engine_generation: int
    def __init__(self, instance_id: _Optional[str] = ..., model: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.Role, str]] = ..., gpu_ids: _Optional[_Iterable[int]] = ..., tensor_parallel: _Optional[int] = ..., address: _Optional[str] = ..., context_window: _Optional[int] = ..., state: _Optional[_Union[InstanceState, str]] = ..., instance_config_json: _Optional[str] = ..., engine_generation: _Optional[int] = ...) -> None: ...

class WatchPlacementRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoleChange(_message.Message):
    __slots__ = ("instance_id", "role", "in_place")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: _worker_pb2.Role
    in_place: bool
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.Role, str]] = ..., in_place: _Optional[bool] = ...) -> None: ...

class ModelChange(_message.Message):
    __slots__ = ("retire", "model", "role", "tensor_parallel")
    RETIRE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    retire: _containers.RepeatedScalarFieldContainer[str]
    model: str
    role: _worker_pb2.Role
    tensor_parallel: int
    def __init__(self, retire: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.Role, str]] = ..., tensor_parallel: _Optional[int] = ...) -> None: ...

class ReconfigureRequest(_message.Message):
    __slots__ = ("role_change", "model_change", "reason", "drain_timeout_ms", "drain_only")
    ROLE_CHANGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_CHANGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_ONLY_FIELD_NUMBER: _ClassVar[int]
    role_change: RoleChange
    model_change: ModelChange
    reason: str
    drain_timeout_ms: int
    drain_only: bool
    def __init__(self, role_change: _Optional[_Union[RoleChange, _Mapping]] = ..., model_change: _Optional[_Union[ModelChange, _Mapping]] = ..., reason: _Optional[str] = ..., drain_timeout_ms: _Optional[int] = ..., drain_only: _Optional[bool] = ...) -> None: ...

class ReconfigureReply(_message.Message):
    __slots__ = ("reconfig_id", "started", "drain_s", "switch_s", "total_s", "drained_requests", "migrated_requests")
    RECONFIG_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    DRAINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    reconfig_id: str
    started: _containers.RepeatedScalarFieldContainer[str]
    drain_s: float
    switch_s: float
    total_s: float
    drained_requests: int
    migrated_requests: int
    def __init__(self, reconfig_id: _Optional[str] = ..., started: _Optional[_Iterable[str]] = ..., drain_s: _Optional[float] = ..., switch_s: _Optional[float] = ..., total_s: _Optional[float] = ..., drained_requests: _Optional[int] = ..., migrated_requests: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("instance_id", "address", "pid")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    pid: int
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class RegisterWorkerReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Placement(_message.Message):
    __slots__ = ("instances", "complete", "node_config_json", "version")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    NODE_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstancePlacement]
    complete: bool
    node_config_json: str
    version: int
    def __init__(self, instances: _Optional[_Iterable[_Union[InstancePlacement, _Mapping]]] = ..., complete: _Optional[bool] = ..., node_config_json: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GetLoadsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Loads(_message.Message):
    __slots__ = ("loads",)
    LOADS_FIELD_NUMBER: _ClassVar[int]
    loads: _containers.RepeatedCompositeFieldContainer[_worker_pb2.LoadReport]
    def __init__(self, loads: _Optional[_Iterable[_Union[_worker_pb2.LoadReport, _Mapping]]] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("holder", "instance_ids", "duration_ms")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    holder: str
    instance_ids: _containers.RepeatedScalarFieldContainer[str]
    duration_ms: int
    def __init__(self, holder: _Optional[str] = ..., instance_ids: _Optional[_Iterable[str]] = ..., duration_ms: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "instance_ids", "expires_at_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    instance_ids: _containers.RepeatedScalarFieldContainer[str]
    expires_at_s: float
    def __init__(self, lease_id: _Optional[str] = ..., instance_ids: _Optional[_Iterable[str]] = ..., expires_at_s: _Optional[float] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GangReport(_message.Message):
    __slots__ = ("instance_id", "event", "has_work", "min_step_s", "has_deadline", "deadline_s", "step_s", "time_scale", "due_prefill_s", "lends_tail")
    class Event(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        HELLO: _ClassVar[GangReport.Event]
        BOUNDARY: _ClassVar[GangReport.Event]
        STARTED: _ClassVar[GangReport.Event]
        NOTHING: _ClassVar[GangReport.Event]
        ENDED: _ClassVar[GangReport.Event]
    HELLO: GangReport.Event
    BOUNDARY: GangReport.Event
    STARTED: GangReport.Event
    NOTHING: GangReport.Event
    ENDED: GangReport.Event
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    HAS_WORK_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_S_FIELD_NUMBER: _ClassVar[int]
    HAS_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    TIME_SCALE_FIELD_NUMBER: _ClassVar[int]
    DUE_PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    LENDS_TAIL_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    event: GangReport.Event
    has_work: bool
    min_step_s: float
    has_deadline: bool
    deadline_s: float
    step_s: float
    time_scale: float
    due_prefill_s: float
    lends_tail: bool
    def __init__(self, instance_id: _Optional[str] = ..., event: _Optional[_Union[GangReport.Event, str]] = ..., has_work: _Optional[bool] = ..., min_step_s: _Optional[float] = ..., has_deadline: _Optional[bool] = ..., deadline_s: _Optional[float] = ..., step_s: _Optional[float] = ..., time_scale: _Optional[float] = ..., due_prefill_s: _Optional[float] = ..., lends_tail: _Optional[bool] = ...) -> None: ...

class GangGrant(_message.Message):
    __slots__ = ("cap_s", "shared", "notice", "tail_lent")
    CAP_S_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    TAIL_LENT_FIELD_NUMBER: _ClassVar[int]
    cap_s: float
    shared: bool
    notice: bool
    tail_lent: bool
    def __init__(self, cap_s: _Optional[float] = ..., shared: _Optional[bool] = ..., notice: _Optional[bool] = ..., tail_lent: _Optional[bool] = ...) -> None: ...
