from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_KVSTORE: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_KVSTORE: WorkerRole

class WorkerEndpoint(_message.Message):
    __slots__ = ("worker_id", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("queued_requests", "active_sequences", "free_kv_blocks", "total_kv_blocks", "tokens_in_flight", "gpus", "adapters")
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    queued_requests: int
    active_sequences: int
    free_kv_blocks: int
    total_kv_blocks: int
    tokens_in_flight: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuStats]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterState]
    def __init__(self, queued_requests: _Optional[int] = ..., active_sequences: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., tokens_in_flight: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuStats, _Mapping]]] = ..., adapters: _Optional[_Iterable[_Union[AdapterState, _Mapping]]] = ...) -> None: ...

class AdapterState(_message.Message):
    __slots__ = ("name", "fingerprint", "resident")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: bytes
    resident: bool
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[bytes] = ..., resident: _Optional[bool] = ...) -> None: ...

class GpuStats(_message.Message):
    __slots__ = ("index", "name", "memory_used_bytes", "memory_total_bytes", "utilization_percent")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_percent: int
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., utilization_percent: _Optional[int] = ...) -> None: ...
