from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHandoff(_message.Message):
    __slots__ = ("request_id", "source_instance_id", "num_prompt_tokens", "first_token_id", "num_kv_bytes", "num_cached_prompt_tokens", "connector_params_json", "finish_reason", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_instance_id: str
    num_prompt_tokens: int
    first_token_id: int
    num_kv_bytes: int
    num_cached_prompt_tokens: int
    connector_params_json: str
    finish_reason: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., source_instance_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., first_token_id: _Optional[int] = ..., num_kv_bytes: _Optional[int] = ..., num_cached_prompt_tokens: _Optional[int] = ..., connector_params_json: _Optional[str] = ..., finish_reason: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ...) -> None: ...
