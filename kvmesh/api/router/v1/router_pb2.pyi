from kvmesh.api.common.v1 import accounting_pb2 as _accounting_pb2
from kvmesh.api.common.v1 import kv_pb2 as _kv_pb2
from kvmesh.api.common.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_TYPE_UNSPECIFIED: _ClassVar[KVEventType]
    KV_EVENT_TYPE_STORED: _ClassVar[KVEventType]
    KV_EVENT_TYPE_REMOVED: _ClassVar[KVEventType]
    KV_EVENT_TYPE_ALL_CLEARED: _ClassVar[KVEventType]
KV_EVENT_TYPE_UNSPECIFIED: KVEventType
KV_EVENT_TYPE_STORED: KVEventType
KV_EVENT_TYPE_REMOVED: KVEventType
KV_EVENT_TYPE_ALL_CLEARED: KVEventType

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "tokens", "hashed", "cache_salt", "max_new_tokens", "exclude_worker_ids", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HASHED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: TokenPrompt
    hashed: HashedPrompt
    cache_salt: bytes
    max_new_tokens: int
    exclude_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Union[TokenPrompt, _Mapping]] = ..., hashed: _Optional[_Union[HashedPrompt, _Mapping]] = ..., cache_salt: _Optional[bytes] = ..., max_new_tokens: _Optional[int] = ..., exclude_worker_ids: _Optional[_Iterable[str]] = ..., adapter: _Optional[str] = ...) -> None: ...

class TokenPrompt(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HashedPrompt(_message.Message):
    __slots__ = ("block_hashes", "block_size", "num_tokens")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    num_tokens: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("prefill_worker", "decode_worker", "prefill_locally", "total_blocks", "prefill_matched_blocks", "decode_matched_blocks", "kvstore_matched_blocks", "index_available", "timings", "predicted_cached_tokens")
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INDEX_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker: _worker_pb2.WorkerEndpoint
    decode_worker: _worker_pb2.WorkerEndpoint
    prefill_locally: bool
    total_blocks: int
    prefill_matched_blocks: int
    decode_matched_blocks: int
    kvstore_matched_blocks: int
    index_available: bool
    timings: _accounting_pb2.Timings
    predicted_cached_tokens: int
    def __init__(self, prefill_worker: _Optional[_Union[_worker_pb2.WorkerEndpoint, _Mapping]] = ..., decode_worker: _Optional[_Union[_worker_pb2.WorkerEndpoint, _Mapping]] = ..., prefill_locally: _Optional[bool] = ..., total_blocks: _Optional[int] = ..., prefill_matched_blocks: _Optional[int] = ..., decode_matched_blocks: _Optional[int] = ..., kvstore_matched_blocks: _Optional[int] = ..., index_available: _Optional[bool] = ..., timings: _Optional[_Union[_accounting_pb2.Timings, _Mapping]] = ..., predicted_cached_tokens: _Optional[int] = ...) -> None: ...

class WorkerCapacity(_message.Message):
    __slots__ = ("total_kv_blocks", "max_num_seqs", "max_model_len")
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    total_kv_blocks: int
    max_num_seqs: int
    max_model_len: int
    def __init__(self, total_kv_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "role", "address", "layout", "capacity", "model")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _worker_pb2.WorkerRole
    address: str
    layout: _kv_pb2.KVLayout
    capacity: WorkerCapacity
    model: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.WorkerRole, str]] = ..., address: _Optional[str] = ..., layout: _Optional[_Union[_kv_pb2.KVLayout, _Mapping]] = ..., capacity: _Optional[_Union[WorkerCapacity, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("lease_id", "lease_ttl_ms", "heartbeat_interval_ms", "expected_sequence")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    expected_sequence: int
    def __init__(self, lease_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., expected_sequence: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: str
    load: _worker_pb2.WorkerLoad
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., load: _Optional[_Union[_worker_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("reregister_required", "lease_ttl_ms", "resync_required")
    REREGISTER_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    reregister_required: bool
    lease_ttl_ms: int
    resync_required: bool
    def __init__(self, reregister_required: _Optional[bool] = ..., lease_ttl_ms: _Optional[int] = ..., resync_required: _Optional[bool] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: str
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("type", "block_hashes", "tier")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    type: KVEventType
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tier: _kv_pb2.KVTier
    def __init__(self, type: _Optional[_Union[KVEventType, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[_kv_pb2.KVTier, str]] = ...) -> None: ...

class PublishKVEventsRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id", "sequence", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: str
    sequence: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., sequence: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class PublishKVEventsResponse(_message.Message):
    __slots__ = ("accepted", "resync_required", "expected_sequence")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RESYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    resync_required: bool
    expected_sequence: int
    def __init__(self, accepted: _Optional[bool] = ..., resync_required: _Optional[bool] = ..., expected_sequence: _Optional[int] = ...) -> None: ...

class ResyncWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id", "sequence", "tier", "block_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: str
    sequence: int
    tier: _kv_pb2.KVTier
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., sequence: _Optional[int] = ..., tier: _Optional[_Union[_kv_pb2.KVTier, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ResyncWorkerResponse(_message.Message):
    __slots__ = ("indexed_blocks", "expected_sequence", "timings")
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    indexed_blocks: int
    expected_sequence: int
    timings: _accounting_pb2.Timings
    def __init__(self, indexed_blocks: _Optional[int] = ..., expected_sequence: _Optional[int] = ..., timings: _Optional[_Union[_accounting_pb2.Timings, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _worker_pb2.WorkerRole
    def __init__(self, role: _Optional[_Union[_worker_pb2.WorkerRole, str]] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "cluster_layout", "index_available")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    INDEX_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    cluster_layout: _kv_pb2.KVLayout
    index_available: bool
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., cluster_layout: _Optional[_Union[_kv_pb2.KVLayout, _Mapping]] = ..., index_available: _Optional[bool] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("endpoint", "role", "capacity", "load", "last_heartbeat_unix_ms", "lease_expires_unix_ms", "indexed_blocks", "model")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    endpoint: _worker_pb2.WorkerEndpoint
    role: _worker_pb2.WorkerRole
    capacity: WorkerCapacity
    load: _worker_pb2.WorkerLoad
    last_heartbeat_unix_ms: int
    lease_expires_unix_ms: int
    indexed_blocks: int
    model: str
    def __init__(self, endpoint: _Optional[_Union[_worker_pb2.WorkerEndpoint, _Mapping]] = ..., role: _Optional[_Union[_worker_pb2.WorkerRole, str]] = ..., capacity: _Optional[_Union[WorkerCapacity, _Mapping]] = ..., load: _Optional[_Union[_worker_pb2.WorkerLoad, _Mapping]] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., lease_expires_unix_ms: _Optional[int] = ..., indexed_blocks: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...
