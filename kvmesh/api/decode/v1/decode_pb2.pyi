from kvmesh.api.common.v1 import accounting_pb2 as _accounting_pb2
from kvmesh.api.common.v1 import kv_pb2 as _kv_pb2
from kvmesh.api.common.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "local", "remote", "resume_token_ids", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    cache_salt: bytes
    local: LocalPrefill
    remote: RemotePrefill
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[bytes] = ..., local: _Optional[_Union[LocalPrefill, _Mapping]] = ..., remote: _Optional[_Union[RemotePrefill, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., adapter: _Optional[str] = ...) -> None: ...

class LocalPrefill(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemotePrefill(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprob", "handoff")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprob: _sampling_pb2.TokenLogprob
    handoff: _kv_pb2.KVHandoff
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[_Union[_sampling_pb2.TokenLogprob, _Mapping]] = ..., handoff: _Optional[_Union[_kv_pb2.KVHandoff, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("offset", "token_ids", "text", "logprobs", "accepted_draft_tokens", "final")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.TokenLogprob]
    accepted_draft_tokens: int
    final: DecodeFinal
    def __init__(self, offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_sampling_pb2.TokenLogprob, _Mapping]]] = ..., accepted_draft_tokens: _Optional[int] = ..., final: _Optional[_Union[DecodeFinal, _Mapping]] = ...) -> None: ...

class DecodeFinal(_message.Message):
    __slots__ = ("finish_reason", "stop_text", "usage", "timings", "draft_tokens_proposed", "draft_tokens_accepted", "system_fingerprint")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TEXT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _sampling_pb2.FinishReason
    stop_text: str
    usage: _accounting_pb2.Usage
    timings: _accounting_pb2.Timings
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    system_fingerprint: str
    def __init__(self, finish_reason: _Optional[_Union[_sampling_pb2.FinishReason, str]] = ..., stop_text: _Optional[str] = ..., usage: _Optional[_Union[_accounting_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_accounting_pb2.Timings, _Mapping]] = ..., draft_tokens_proposed: _Optional[int] = ..., draft_tokens_accepted: _Optional[int] = ..., system_fingerprint: _Optional[str] = ...) -> None: ...
