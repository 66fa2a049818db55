from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KVTier]
    KV_TIER_GPU: _ClassVar[KVTier]
    KV_TIER_KVSTORE: _ClassVar[KVTier]

class HandoffMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDOFF_MODE_UNSPECIFIED: _ClassVar[HandoffMode]
    HANDOFF_MODE_PULL: _ClassVar[HandoffMode]
    HANDOFF_MODE_KVSTORE: _ClassVar[HandoffMode]
    HANDOFF_MODE_NONE: _ClassVar[HandoffMode]
KV_TIER_UNSPECIFIED: KVTier
KV_TIER_GPU: KVTier
KV_TIER_KVSTORE: KVTier
HANDOFF_MODE_UNSPECIFIED: HandoffMode
HANDOFF_MODE_PULL: HandoffMode
HANDOFF_MODE_KVSTORE: HandoffMode
HANDOFF_MODE_NONE: HandoffMode

class KVLayout(_message.Message):
    __slots__ = ("block_size", "dtype", "layout", "num_layers", "num_kv_heads", "head_dim", "model_fingerprint")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    dtype: str
    layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_fingerprint: bytes
    def __init__(self, block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., layout: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., model_fingerprint: _Optional[bytes] = ...) -> None: ...

class KVBlockChunk(_message.Message):
    __slots__ = ("block_hash", "chunk_index", "num_chunks", "total_bytes", "shape", "dtype", "checksum", "data")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    chunk_index: int
    num_chunks: int
    total_bytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    checksum: bytes
    data: bytes
    def __init__(self, block_hash: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., num_chunks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., checksum: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVHandoff(_message.Message):
    __slots__ = ("mode", "source_address", "lease_id", "lease_ttl_ms", "block_hashes", "nixl")
    MODE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    mode: HandoffMode
    source_address: str
    lease_id: str
    lease_ttl_ms: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    nixl: NixlBlocks
    def __init__(self, mode: _Optional[_Union[HandoffMode, str]] = ..., source_address: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., nixl: _Optional[_Union[NixlBlocks, _Mapping]] = ...) -> None: ...

class NixlBlocks(_message.Message):
    __slots__ = ("agent_name", "block_ids", "checksums")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    checksums: bytes
    def __init__(self, agent_name: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., checksums: _Optional[bytes] = ...) -> None: ...

class NixlPoolRegion(_message.Message):
    __slots__ = ("base_address", "num_blocks", "num_layers", "layer_stride", "kv_stride", "block_stride", "piece_bytes", "mem_type", "device_id", "block_tokens", "num_kv_heads")
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_FIELD_NUMBER: _ClassVar[int]
    KV_STRIDE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    PIECE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    base_address: int
    num_blocks: int
    num_layers: int
    layer_stride: int
    kv_stride: int
    block_stride: int
    piece_bytes: int
    mem_type: str
    device_id: int
    block_tokens: int
    num_kv_heads: int
    def __init__(self, base_address: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_layers: _Optional[int] = ..., layer_stride: _Optional[int] = ..., kv_stride: _Optional[int] = ..., block_stride: _Optional[int] = ..., piece_bytes: _Optional[int] = ..., mem_type: _Optional[str] = ..., device_id: _Optional[int] = ..., block_tokens: _Optional[int] = ..., num_kv_heads: _Optional[int] = ...) -> None: ...

class NixlRank(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "region", "first_kv_head")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    FIRST_KV_HEAD_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    region: NixlPoolRegion
    first_kv_head: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., region: _Optional[_Union[NixlPoolRegion, _Mapping]] = ..., first_kv_head: _Optional[int] = ...) -> None: ...
