from kvmesh.api.common.v1 import accounting_pb2 as _accounting_pb2
from kvmesh.api.common.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutRequest(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: _kv_pb2.KVBlockChunk
    def __init__(self, chunk: _Optional[_Union[_kv_pb2.KVBlockChunk, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored_blocks", "already_present_blocks", "evicted_blocks", "timings")
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    stored_blocks: int
    already_present_blocks: int
    evicted_blocks: int
    timings: _accounting_pb2.Timings
    def __init__(self, stored_blocks: _Optional[int] = ..., already_present_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., timings: _Optional[_Union[_accounting_pb2.Timings, _Mapping]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("block_hashes", "max_chunk_bytes")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    max_chunk_bytes: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("chunk", "missing_block_hash", "summary")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MISSING_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    chunk: _kv_pb2.KVBlockChunk
    missing_block_hash: bytes
    summary: GetSummary
    def __init__(self, chunk: _Optional[_Union[_kv_pb2.KVBlockChunk, _Mapping]] = ..., missing_block_hash: _Optional[bytes] = ..., summary: _Optional[_Union[GetSummary, _Mapping]] = ...) -> None: ...

class GetSummary(_message.Message):
    __slots__ = ("found_blocks", "missing_blocks", "timings")
    FOUND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    found_blocks: int
    missing_blocks: int
    timings: _accounting_pb2.Timings
    def __init__(self, found_blocks: _Optional[int] = ..., missing_blocks: _Optional[int] = ..., timings: _Optional[_Union[_accounting_pb2.Timings, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_present_prefix", "timings")
    NUM_PRESENT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    num_present_prefix: int
    timings: _accounting_pb2.Timings
    def __init__(self, num_present_prefix: _Optional[int] = ..., timings: _Optional[_Union[_accounting_pb2.Timings, _Mapping]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted_blocks",)
    DELETED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    deleted_blocks: int
    def __init__(self, deleted_blocks: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("ram_blocks", "ram_bytes", "ram_budget_bytes", "disk_blocks", "disk_bytes", "disk_budget_bytes", "hits", "misses", "evictions", "corrupt_blocks")
    RAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ram_blocks: int
    ram_bytes: int
    ram_budget_bytes: int
    disk_blocks: int
    disk_bytes: int
    disk_budget_bytes: int
    hits: int
    misses: int
    evictions: int
    corrupt_blocks: int
    def __init__(self, ram_blocks: _Optional[int] = ..., ram_bytes: _Optional[int] = ..., ram_budget_bytes: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_budget_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ...) -> None: ...

class NixlHandshakeRequest(_message.Message):
    __slots__ = ("layout", "agent_name", "agent_metadata", "region")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    layout: _kv_pb2.KVLayout
    agent_name: str
    agent_metadata: bytes
    region: _kv_pb2.NixlPoolRegion
    def __init__(self, layout: _Optional[_Union[_kv_pb2.KVLayout, _Mapping]] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., region: _Optional[_Union[_kv_pb2.NixlPoolRegion, _Mapping]] = ...) -> None: ...

class NixlHandshakeResponse(_message.Message):
    __slots__ = ("agent_name", "layout")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    layout: _kv_pb2.KVLayout
    def __init__(self, agent_name: _Optional[str] = ..., layout: _Optional[_Union[_kv_pb2.KVLayout, _Mapping]] = ...) -> None: ...

class PutNixlRequest(_message.Message):
    __slots__ = ("agent_name", "block_hashes", "block_ids", "checksums")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    checksums: bytes
    def __init__(self, agent_name: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ..., checksums: _Optional[bytes] = ...) -> None: ...

class PutNixlResponse(_message.Message):
    __slots__ = ("stored_blocks", "already_present_blocks", "evicted_blocks", "timings")
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    stored_blocks: int
    already_present_blocks: int
    evicted_blocks: int
    timings: _accounting_pb2.Timings
    def __init__(self, stored_blocks: _Optional[int] = ..., already_present_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., timings: _Optional[_Union[_accounting_pb2.Timings, _Mapping]] = ...) -> None: ...

class GetNixlRequest(_message.Message):
    __slots__ = ("agent_name", "block_hashes", "block_ids")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, agent_name: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetNixlResponse(_message.Message):
    __slots__ = ("found_blocks", "checksums", "timings")
    FOUND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    found_blocks: int
    checksums: bytes
    timings: _accounting_pb2.Timings
    def __init__(self, found_blocks: _Optional[int] = ..., checksums: _Optional[bytes] = ..., timings: _Optional[_Union[_accounting_pb2.Timings, _Mapping]] = ...) -> None: ...
