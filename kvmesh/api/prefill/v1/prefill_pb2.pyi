from kvmesh.api.common.v1 import accounting_pb2 as _accounting_pb2
from kvmesh.api.common.v1 import kv_pb2 as _kv_pb2
from kvmesh.api.common.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LeaseOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_OUTCOME_UNSPECIFIED: _ClassVar[LeaseOutcome]
    LEASE_OUTCOME_ACK: _ClassVar[LeaseOutcome]
    LEASE_OUTCOME_ABORT: _ClassVar[LeaseOutcome]
LEASE_OUTCOME_UNSPECIFIED: LeaseOutcome
LEASE_OUTCOME_ACK: LeaseOutcome
LEASE_OUTCOME_ABORT: LeaseOutcome

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "cache_salt", "handoff_mode", "lease_ttl_ms", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MODE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    cache_salt: bytes
    handoff_mode: _kv_pb2.HandoffMode
    lease_ttl_ms: int
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[bytes] = ..., handoff_mode: _Optional[_Union[_kv_pb2.HandoffMode, str]] = ..., lease_ttl_ms: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprob", "finish_reason", "handoff", "computed_tokens", "reused_tokens", "timings")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprob: _sampling_pb2.TokenLogprob
    finish_reason: _sampling_pb2.FinishReason
    handoff: _kv_pb2.KVHandoff
    computed_tokens: int
    reused_tokens: int
    timings: _accounting_pb2.Timings
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[_Union[_sampling_pb2.TokenLogprob, _Mapping]] = ..., finish_reason: _Optional[_Union[_sampling_pb2.FinishReason, str]] = ..., handoff: _Optional[_Union[_kv_pb2.KVHandoff, _Mapping]] = ..., computed_tokens: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., timings: _Optional[_Union[_accounting_pb2.Timings, _Mapping]] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("lease_id", "block_hashes", "max_chunk_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    max_chunk_bytes: int
    def __init__(self, lease_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class PullKVResponse(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: _kv_pb2.KVBlockChunk
    def __init__(self, chunk: _Optional[_Union[_kv_pb2.KVBlockChunk, _Mapping]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "outcome")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    outcome: LeaseOutcome
    def __init__(self, lease_id: _Optional[str] = ..., outcome: _Optional[_Union[LeaseOutcome, str]] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released", "unpinned_blocks")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    UNPINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    released: bool
    unpinned_blocks: int
    def __init__(self, released: _Optional[bool] = ..., unpinned_blocks: _Optional[int] = ...) -> None: ...

class NixlHandshakeRequest(_message.Message):
    __slots__ = ("layout", "agent_name")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    layout: _kv_pb2.KVLayout
    agent_name: str
    def __init__(self, layout: _Optional[_Union[_kv_pb2.KVLayout, _Mapping]] = ..., agent_name: _Optional[str] = ...) -> None: ...

class NixlHandshakeResponse(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "layout", "region", "ranks")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    layout: _kv_pb2.KVLayout
    region: _kv_pb2.NixlPoolRegion
    ranks: _containers.RepeatedCompositeFieldContainer[_kv_pb2.NixlRank]
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layout: _Optional[_Union[_kv_pb2.KVLayout, _Mapping]] = ..., region: _Optional[_Union[_kv_pb2.NixlPoolRegion, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[_kv_pb2.NixlRank, _Mapping]]] = ...) -> None: ...
